"""Per-architecture knowledge: which modules are decoder layers, norms, TP regions, and the TP plan."""
from .plan import ModelPlan

__all__ = ["ModelPlan"]
