"""Float8 training through torchao (tensorwise, rowwise)."""
