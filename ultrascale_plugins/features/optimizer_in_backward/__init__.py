"""The optimizer step inside the backward: each parameter is stepped as soon as its gradient is reduced, and the gradient is freed."""
