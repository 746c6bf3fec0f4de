"""This project's models: plain torch nn.Modules, nothing from the runner."""
