"""The pipeline's least communication for one optimizer step on one rank (``ultrascale_cost_comm_minimum``), in the
notation of ``interface.comm_minimum``: each micro-batch's activation forward and its gradient back at every stage
boundary this rank holds, the stages placed as the schedule places them (``split``)."""
from __future__ import annotations

from ...interface.comm_minimum import MinimumTerm, activation
from ...interface.facts import layout_facts
from .split import pp_rank_of_stage, stage_ids_for_rank, stages_per_rank


def pipeline_minimum(config, shape) -> list[MinimumTerm]:
    """The ``pp`` axis's point-to-point transfers, of the most loaded pipeline rank unless ``shape.coords`` names
    one."""
    if config.pp == 1:
        return []
    rank = shape.coords.get("pp")
    ends = max(boundary_ends(config, r) for r in ([rank] if rank is not None else range(config.pp)))
    facts = layout_facts(config)
    act = activation(config, shape)
    if facts.sequence_sharded:
        act /= facts.degree("tp")  # each tensor-parallel rank sends its slice of the sequence
    calls = 2 * ends * shape.micro_batches
    return [MinimumTerm("pp", "p2p", calls, calls * act,
                        f"per micro-batch and stage boundary this rank holds ({ends}): the activation sent forward "
                        "and its gradient back, b·s·h each (÷tp with sequence parallel), counted at both ends")]


def boundary_ends(config, rank: int) -> int:
    """The stage boundaries pipeline rank ``rank`` sends or receives across: each of its stages' neighbours held
    by another rank."""
    total = config.pp * stages_per_rank(config)
    away = lambda stage: pp_rank_of_stage(config, stage) != rank  # noqa: E731
    return sum((s > 0 and away(s - 1)) + (s < total - 1 and away(s + 1)) for s in stage_ids_for_rank(config, rank))
