"""PEFT adapters: the wrapper, the meta-device build, adapter checkpoints and exports, a 4-bit frozen base."""
