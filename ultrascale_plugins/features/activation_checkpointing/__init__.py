"""Activation checkpointing of each decoder layer (full or selective) and the activation memory it prices."""
