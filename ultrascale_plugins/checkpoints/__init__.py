"""Checkpoint I/O: sharded checkpoints in any layout, pretrained Hugging Face directories, export."""
