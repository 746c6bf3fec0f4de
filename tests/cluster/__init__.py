"""The multi-node test bed: nodes with their own network and hostname on one Linux machine (``nodes.py``)."""
