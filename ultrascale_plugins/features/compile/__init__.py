"""Regional torch.compile of each decoder layer."""
