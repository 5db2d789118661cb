"""Architecture knowledge: decoder layers, norms, TP plans and regions, the data-flow trace of a model's blocks."""
from .plan import ModelPlan

__all__ = ["ModelPlan"]
