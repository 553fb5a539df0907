"""GGUF files → model hyperparameters and weights. The only package that knows file formats."""
