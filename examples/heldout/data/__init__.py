"""This project's data sets: plain torch Datasets, nothing from the runner."""
