"""The own engine: a PyTorch runner over GGUF weights (`appliance serve --engine torch`)."""
