"""How one training step runs its micro-batches, as the dimension that schedules them inside the step (a pipeline)
tells the recipe, the planner and the plot (``ultrascale_cost_schedule``). The defaults are those of a step with no
such dimension: one micro-batch per call, every rank costing alike, each micro-batch's forward then its backward."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StepSchedule:
    """``microbatches``: how many micro-batches one training step runs inside the dimension (the recipe splits its
    batch by it; ``ParallelModel.tokens.microbatches_inside`` reports it). ``coordinates``: ``{axis: [index, ...]}``,
    the positions along the dimension's mesh axes whose ranks can differ in cost (a pipeline's first, second and
    last stages); the planner estimates every combination and takes the most loaded. A plugin returns a subclass
    that overrides ``timeline`` with its own schedule's."""

    microbatches: int = 1
    coordinates: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def role(self, coords: dict[str, int]) -> str:
        """The rank at ``coords`` (one combination of ``coordinates``) in words, for the dry run's report of each
        rank role: the default names its coordinates, or "every rank" with none."""
        return ", ".join(f"{axis} rank {index}" for axis, index in coords.items()) or "every rank"

    def timeline(self, microbatches: int) -> list[list[tuple]]:
        """Per rank, its actions over one step of ``microbatches`` micro-batches (the plot draws fewer than a step's
        when they are many) as (start, end, kind, micro-batch, chunk): kind F (forward), B (backward, or only its
        input gradient where W follows) or W (weight gradient), in units of one forward of one micro-batch on one
        stage. The default: one row, as every rank runs alike, each forward followed by its backward (2 units)."""
        return [[action for mb in range(microbatches)
                 for action in ((3 * mb, 3 * mb + 1, "F", mb, 0), (3 * mb + 1, 3 * mb + 3, "B", mb, 0))]]
