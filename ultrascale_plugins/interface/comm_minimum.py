"""The least communication a layout needs for one optimizer step on one rank, as each dimension states it for its
own mesh axes (``ultrascale_cost_comm_minimum``): the term type and the notation the families' formulas share. The
built-in families give the Ultra-Scale Playbook's formulas (with Megatron-LM's count at the ends of a
tensor-parallel model), each in its folder (``dims/<family>/minimum.py``); docs/performance.md explains them and
their sources. An axis no plugin states a minimum for has none (the communication report's rows say so).

Units: those the communication ledger measures (``comm_ledger``): the payload is the whole tensor a collective is
about, and a point-to-point transfer counts on both ends, the send and the receive. A minimum keeps what the layout
promises to shard: ZeRO-2 keeps gradients sharded across an accumulation window, so it reduce-scatters every
micro-batch; ZeRO-3 keeps parameters sharded between uses, so it gathers them for every forward and backward.

Notation: b rows per micro-batch, s the sequence (s/cp per rank), h the hidden size, m micro-batches per step, A =
b·s·h bytes of one activation in the compute dtype, Ψg the bytes of this rank's trainable parameters in fp32 (its
tensor- and pipeline-parallel share) and Ψw the bytes of its weights in the compute dtype. The helpers below read
the ``estimates.Shape`` the dimensions' ``ultrascale_cost_estimate`` left (the inventory cut to this rank's share,
``layers_here`` set) and the layout's facts, never another family's fields.
"""
from __future__ import annotations

import dataclasses

from .facts import layout_facts
from .moe_config import text_config


@dataclasses.dataclass
class MinimumTerm:
    """``calls`` collectives of kind ``op`` on mesh axis ``axis`` moving ``payload`` bytes in all, per optimizer
    step; ``op`` "p2p" counts sends and receives together; ``formula`` says how the numbers were reached."""

    axis: str
    op: str
    calls: int
    payload: float
    formula: str


def tokens(config, shape) -> int:
    """This rank's tokens of one micro-batch: b · s/cp."""
    return shape.micro_batch * -(-shape.seq_len // layout_facts(config).degree("cp"))


def activation(config, shape) -> int:
    """A: the bytes of one micro-batch's activation on this rank, b · s/cp · h in the compute dtype."""
    return tokens(config, shape) * text_config(shape.model_config).hidden_size * shape.activation_bytes(config)


def layers(shape) -> int:
    """The decoder layers this rank holds (a pipeline stage's, or all of them)."""
    return shape.layers_here if shape.layers_here is not None else shape.model_config.num_hidden_layers

