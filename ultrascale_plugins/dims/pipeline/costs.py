"""The pipeline's part of a layout's cost: which parameters and layers a pipeline rank holds, how many
micro-batches of activations its schedule keeps in flight, the bubble, and the point-to-point traffic
(formulas: the reference notes' pipeline table — Narayanan et al. 2021, the ZB-pipeline and DualPipe papers)."""
from __future__ import annotations

from ...interface.facts import layout_facts
from .split import LOOPED, V_SHAPED, stage_ids_for_rank, stage_layer_counts, stages_per_rank


def in_flight(schedule: str, p: int, v: int, m: int, rank: int) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak, in units of all its layers."""
    if schedule == "gpipe":
        return m
    if schedule in V_SHAPED:
        return min(m, p + 1) if schedule == "dualpipev" else min(m, p)
    base = min(m, p - rank)
    if schedule in LOOPED:
        return base * (1 + (p - 1) / (p * v))
    return base


def bubble(schedule: str, p: int, v: int, m: int) -> float:
    """Idle time of a pipeline step as a fraction of its busy time (backward ~ 2x forward)."""
    if p == 1:
        return 0.0
    if schedule == "zero_bubble":
        return (p - 1) / (3 * v * m)
    if schedule == "zbv":
        return 0.0
    if schedule == "dualpipev":
        return max(0.0, p / 2 - 1) / m
    if schedule in LOOPED:
        return (p - 1) / (v * m)
    return (p - 1) / m


def nanotron_split(mc, n_layers: int, p: int) -> tuple[list[int], int]:
    """(decoder layers per pipeline rank, the rank holding the head) as nanotron splits a Llama: the blocks
    (embedding, layers, final norm, head, loss) in order, each costing its matmul weights (a layer 4h² + 3hf,
    GQA ignored; the head V·h; the rest nothing), each rank taking blocks until the running cost passes its share
    (its ``PipelineBlock`` assignment from ``get_block_compute_costs``). Ranks past the head may be left empty."""
    h = mc.hidden_size
    f = getattr(mc, "intermediate_size", None) or 4 * h
    costs = [0.0] + [4.0 * h * h + 3.0 * h * f] * n_layers + [0.0, float(mc.vocab_size * h)]
    total, running, rank = sum(costs), 0.0, 0
    counts, head = [0] * p, 0
    for i, cost in enumerate(costs):
        running += cost
        if 1 <= i <= n_layers:
            counts[rank] += 1
        if i == len(costs) - 1:
            head = rank
        if running > total * (rank + 1) / p and rank < p - 1:
            rank += 1
    return counts, head


def pipeline_terms(config, shape, est) -> None:
    n_layers = 1 + max((r.layer for r in shape.inventory if r.layer is not None), default=-1)
    if config.pp == 1:
        shape.layers_here, shape.in_flight, shape.holds_head = n_layers, 1, True
        return
    p, v = config.pp, stages_per_rank(config)
    m = shape.micro_batches
    rank = shape.coords.get("pp", 0)
    n_stages = p * v
    last = n_stages - 1  # the stage holding the final norm and the head
    if shape.profile == "nanotron" and v == 1 and not config.pp_split:
        counts, last = nanotron_split(shape.model_config, n_layers, p)
        if rank == p - 1:  # the pipeline's end, as the cost coordinates name it: the rank holding the head
            rank = last
    elif shape.profile == "megatron_deepspeed" and not config.pp_split and n_stages <= n_layers:
        # DeepSpeed's PipelineModule(partition_method="type:transformer"): the decoder layers evenly, the embedding
        # on the first stage and the head (a tied copy of it) on the last besides
        counts = [n_layers // n_stages + (1 if s < n_layers % n_stages else 0) for s in range(n_stages)]
    elif n_stages > n_layers:  # more stages than layers: this engine refuses it, the planner still costs it
        counts = [1] * n_layers + [0] * (n_stages - n_layers)
    else:  # this engine's split: the embedding and the head count as a layer of work each
        counts = stage_layer_counts(config, n_layers)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    stages = stage_ids_for_rank(config, rank)
    layers = set()
    for s in stages:
        layers.update(range(starts[s], starts[s] + counts[s]))
    kept = []
    for r in shape.inventory:
        if r.part == "layer" and r.layer in layers or r.part == "pre" and 0 in stages \
                or r.part == "post" and last in stages:
            kept.append(r)
        if r.tied_head and last in stages:  # the last stage has its own copy of a tied head (V schedules too)
            copy = r.clone()
            copy.part, copy.tied_head = "post", False
            kept.append(copy)
    shape.inventory[:] = kept
    shape.layers_here = len(layers)
    shape.in_flight = in_flight(config.pp_schedule, p, v, m, rank)
    shape.holds_head = last in stages
    est.factors["bubble"] = bubble(config.pp_schedule, p, v, m)
    element = shape.activation_bytes(config)
    act = shape.tokens_per_micro_batch * shape.model_config.hidden_size * element
    facts = layout_facts(config)
    if facts.sequence_sharded:
        act /= facts.degree("tp")
    # each micro-batch: activations to the next stage and their gradient back, on every stage boundary it crosses
    est.add_comm("pp", 2 * act * v, "p2p", calls=2 * v, per="micro_batch")
    if shape.profile == "ultrascale" and 0 not in stages:
        # torch's stages receive each micro-batch's input into a buffer of its own, made once and kept
        est.add_memory("other", m * len(stages) * act)
    if shape.profile == "megatron_deepspeed":
        # DeepSpeed's pipeline engine keeps for each micro-batch in flight: the stage's output until its backward
        # (under tp only this rank's part of it, pipe_partitioned), except on the last stage; the attention mask
        # Megatron's GPT passes from stage to stage (a byte per pair of positions); on the first stage, the mask
        # of the embedding's dropout (a byte per element of its output, whole on every tp rank)
        mc = shape.model_config
        tokens = shape.tokens_per_micro_batch
        kept = shape.micro_batch * shape.seq_len ** 2
        if last not in stages:
            kept += element * tokens * mc.hidden_size / facts.degree("tp")
        if 0 in stages:
            kept += tokens * mc.hidden_size
        est.add_memory("activations", kept * shape.in_flight)
