"""torch's private tools for running the real step on tensors without storage, in one place (``us.dry_run``).

Every name imported here is private to torch (no public API has them in torch 2.13): the ``fake`` process-group
backend (``torch.testing._internal.distributed.fake_pg``: importing it registers the backend; its collectives
return at once), ``FakeTensorMode`` (tensors with a shape, a dtype and a device, and no storage) and
``MemTracker`` (live bytes by category: parameters, buffers, gradients, activations, temporaries, optimizer
states). Checked on torch 2.13; the package's floor is 2.11, which has all three. A torch without them is named in
one line (``private_tools``) before any work.
"""
from __future__ import annotations

import contextlib

import torch

TORCH_CHECKED = "2.13"


def private_tools():
    """(FakeStore, FakeTensorMode, FakeTensor, MemTracker module), imported; a ``ConfigError`` naming what this
    torch lacks otherwise."""
    from ..interface.config import ConfigError

    try:
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
        from torch.distributed._tools import mem_tracker
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    except ImportError as exc:
        raise ConfigError(f"the dry run needs torch's fake process group, FakeTensorMode and MemTracker (private to "
                          f"torch, checked on {TORCH_CHECKED}); this torch {torch.__version__} lacks one: {exc}. "
                          "Fix: install torch >= 2.11") from None
    return FakeStore, FakeTensorMode, FakeTensor, mem_tracker


def is_fake(tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (no storage: a dry run's); False where torch has no fake tensors."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover - every supported torch has them
        return False
    return isinstance(tensor, FakeTensor)


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """A fake process group of ``world_size`` ranks, this process being ``rank``, for the body; destroyed after."""
    import torch.distributed as dist

    FakeStore = private_tools()[0]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def unpacked_rows():
    """transformers' mask builder as a real run of the dry run's batch sees it: each row one sequence.

    Why by hand: ``masking_utils.find_packed_sequence_indices`` reads the position ids' values to find packed
    sequences, and treats a fake tensor as a trace whose values it cannot read, so it reports packing; the model
    then builds a full attention mask and expands the KV heads for it, where the real run (positions 0..n-1, no
    packing found) passes no mask and lets SDPA use the grouped heads: 26 % more activations counted in an 8-layer
    Llama. The dry run's rows hold no packing, so the answer the real check gives them, None, is exact."""
    from transformers import masking_utils

    real = masking_utils.find_packed_sequence_indices

    def find(position_ids):
        return None if is_fake(position_ids) else real(position_ids)

    masking_utils.find_packed_sequence_indices = find
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = real


class FakeWeights:
    """``init_weights`` for ``parallelize``: this rank's shards get fake storage; no value is drawn or read (the
    real loaders draw or copy every weight, which a full-size model on one machine cannot hold)."""

    def __init__(self, mode):
        self.mode = mode

    def load(self, ctx, buffers) -> None:
        from .local_shards import give_storage

        with self.mode:
            give_storage(ctx, buffers)


def peak_tracker():
    """A ``MemTracker`` that also records where the peak falls (the innermost module running, forward or
    backward) and updates its per-module peaks in time linear in the modules running, not in all modules.

    Why by hand: torch's ``_update_peak_stats`` walks every tracked module on every allocation (quadratic in the
    layers: a 70B model's step spent most of its time there); this walk visits only the modules running, the same
    ones torch's loop updates."""
    mem_tracker = private_tools()[3]
    total_key = mem_tracker._TOTAL_KEY
    from copy import deepcopy

    class PeakTracker(mem_tracker.MemTracker):
        peak_where: str = "outside any module"
        phase: str = "the step"  # what the dry run is doing now, for a peak outside every module

        def _update_peak_stats(self, peak_state) -> None:
            curr = self._curr_mem_snap
            by_fqn = self._by_fqn()
            for fqn in self._mod_tracker.parents:
                for stats in by_fqn.get(fqn, ()):
                    if peak_state in stats.snapshots:
                        for dev, snap in curr.items():
                            if stats.local_peak.get(dev, 0) < snap[total_key]:
                                stats.local_peak[dev] = snap[total_key]
                                stats.snapshots[peak_state][-1][dev] = deepcopy(snap)
            for dev, snap in curr.items():
                if self._peak_mem.get(dev, 0) < snap[total_key]:
                    self._peak_mem[dev] = snap[total_key]
                    self._peak_mem_snap[dev] = deepcopy(snap)
                    self.peak_where = self._where()

        def _by_fqn(self) -> dict:
            """{module name: its stats}, rebuilt only when a module joins the tracking."""
            cached = getattr(self, "_fqn_index", None)
            if cached is None or cached[0] != len(self.memory_tracking):
                index: dict = {}
                for stats in self.memory_tracking.values():
                    index.setdefault(stats.mod_fqn, []).append(stats)
                cached = self._fqn_index = (len(self.memory_tracking), index)
            return cached[1]

        def _where(self) -> str:
            running = [fqn for fqn in self._mod_tracker.parents if fqn != "Global"]
            if not running:
                return f"{self.phase}, outside any module"
            inner = max(running, key=lambda fqn: fqn.count("."))
            return f"{inner} ({'backward' if self._mod_tracker.is_bw else 'forward'})"

    return PeakTracker()
