"""Activation offload: what each decoder layer saves for its backward is held in host memory between its forward and its backward."""
