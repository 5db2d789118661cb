"""What a family's data-dependent read answers on fake tensors (a dry run's: shape, no values), and the assumptions
that answer rests on, stated so the dry run's report can say them.

Why an interface: a few steps read values to decide a shape or a branch (expert parallel's routing counts size its
all-to-all; context parallel asks whether a row restarts its positions). On fake tensors there are no values, so
the read must be answered by an assumption. The family makes the read, so it answers it here, at the read, from
what this module says is assumed; the dry run (the engine) only sets the assumptions and prints ``said()``, and
learns no dimension's name. Outside a dry run nothing here is consulted: ``is_fake`` is False for real tensors.

The assumptions:

- **one sequence per row**: the dry run's batch holds no packed documents and no padding, so "does a row restart
  its positions?" and "is there padding before a real token?" are answered no, which is exact for that batch;
- **routing** of tokens to experts, which the router decides from values: ``uniform`` (default) or
  ``all-to-one`` (``ROUTINGS`` says each exactly).
"""
from __future__ import annotations

import contextlib
import dataclasses

from .config import ConfigError
from .moe_config import routed_experts

ONE_SEQUENCE_PER_ROW = "each row one sequence (no packed documents, no padding)"
ROUTINGS = {
    "uniform": "routing uniform: each rank's tokens x top_k (token, expert) pairs split evenly over the ep ranks "
               "(the first pairs % ep ranks one more), every ep rank holding as many tokens",
    "all-to-one": "routing all-to-one: every rank's tokens x top_k pairs go to the first ep rank's first expert "
                  "(the worst case for that rank, the one traced)",
}


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """What the dry run assumes where values would decide: ``routing``, one of ``ROUTINGS``."""

    routing: str = "uniform"

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ConfigError(f"routing={self.routing!r}: not an assumption the dry run knows. Fix: one of "
                              f"{', '.join(ROUTINGS)}")

    def said(self, model_config) -> list[str]:
        """The assumptions a step of ``model_config`` rests on, in words, for the report's "assumed:" line (the
        routing only where the model routes tokens to experts)."""
        return [ONE_SEQUENCE_PER_ROW, *([ROUTINGS[self.routing]] if routed_experts(model_config) else [])]


_active = Assumptions()


def is_fake(tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (no storage: a dry run's); False where torch has no fake tensors."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover - every supported torch has them
        return False
    return isinstance(tensor, FakeTensor)


def assumed() -> Assumptions:
    """The assumptions in force: the dry run's while it runs (``assuming``), the defaults otherwise."""
    return _active


@contextlib.contextmanager
def assuming(assumptions: Assumptions):
    """``assumptions`` in force for the body (the dry run's step)."""
    global _active
    before, _active = _active, assumptions
    try:
        yield assumptions
    finally:
        _active = before


def even_split(total: int, parts: int) -> list[int]:
    """``total`` split over ``parts`` as evenly as integers allow, the first ``total % parts`` one more."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


@contextlib.contextmanager
def fake_mode_of(module):
    """The fake mode ``module``'s parameters live in, entered (a dry run's), or nothing (real weights): for a step
    that allocates from the parameters' shapes in C++, where the dry run's mode does not reach (DDP's reducer sizes
    its gradient buckets from them: outside the mode, a real fp32 copy of the model in host memory). Inside it,
    DDP's check that every rank's parameter shapes agree (a collective of their values' sizes, which fake tensors
    cannot hand to the fake group) is answered yes: every rank of a dry run builds the same model."""
    fake = next((p.fake_mode for p in module.parameters() if is_fake(p)), None)
    if fake is None:
        yield
        return
    from torch.nn.parallel import distributed

    verify = distributed._verify_param_shape_across_processes
    distributed._verify_param_shape_across_processes = lambda process_group, tensors, logger=None: None
    try:
        with fake:
            yield
    finally:
        distributed._verify_param_shape_across_processes = verify
