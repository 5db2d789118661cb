"""``Absent``: the placeholder left where a module lives elsewhere (another pipeline stage owns it). Every
transform skips it; it has no parameters and passes its input through."""
from __future__ import annotations

from torch import nn


class Absent(nn.Module):
    """Placeholder for a module another part of the layout owns: no parameters, passes its input through."""

    def forward(self, hidden_states=None, *args, **kwargs):
        return hidden_states


def present_modules(model: nn.Module) -> set[str]:
    """The names of ``model``'s modules that are really there (not placeholders, not inside one)."""
    return {fqn for fqn, m in model.named_modules() if not isinstance(m, Absent)}
