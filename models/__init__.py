"""Models: plain ``torch.nn.Module`` classes, one module each, with the schema of their YAML keys."""
