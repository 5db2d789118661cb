"""torch's private tools for running the real step on tensors without storage, in one place (``us.dry_run``).

Every name imported here is private to torch (no public API has them in torch 2.13): the ``fake`` process-group
backend (``torch.testing._internal.distributed.fake_pg``: importing it registers the backend; its collectives
return at once), ``FakeTensorMode`` (tensors with a shape, a dtype and a device, and no storage) and
``MemTracker`` (live bytes by category: parameters, buffers, gradients, activations, temporaries, optimizer
states). Checked on torch 2.13; the package's floor is 2.11, which has all three. A torch without them is named in
one line (``private_tools``) before any work. ``peak_tracker`` also uses DTensor's
``ShardingPropagator._fake_mode_lock`` where torch has it (2.13 does; without it the tracker counts as before).
"""
from __future__ import annotations

import contextlib

import torch

from ..interface.fake_values import is_fake

TORCH_CHECKED = "2.13"
AGAIN = "a module run again in the step"  # peak_tracker: what torch's MemTracker sees running beside it


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


@contextlib.contextmanager
def grouped_mm_in_any_dtype():
    """``aten._grouped_mm`` (transformers' grouped experts: an MoE layer's matmuls) on fake tensors of any dtype,
    its output shaped by torch's own rule, for the body.

    Why by hand: torch 2.13's meta kernel for it (what fake tensors run) still refuses all but bf16, where the
    CPU kernel takes fp32 too (and CUDA's falls back to a loop for other dtypes): an fp32 MoE step runs for real
    and not on fake tensors. Only the dtype check is left out: the shape is torch's
    (``_create_grouped_mm_output_tensor``), the output in the input's dtype as the kernel gives it; bf16 goes to
    torch's meta as before."""
    from torch._meta_registrations import _create_grouped_mm_output_tensor
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    op = torch.ops.aten._grouped_mm.default

    def grouped_mm(fake_mode, func, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        if mat_a.dtype == torch.bfloat16 or offs is None:
            return NotImplemented  # torch's meta kernel
        with in_kernel_invocation_manager(fake_mode):
            out = _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return FakeTensor(fake_mode, out, mat_a.fake_device)

    if op in fake_impls.op_implementations_dict:  # a torch with its own: leave it
        yield
        return
    fake_impls.op_implementations_dict[op] = grouped_mm
    try:
        yield
    finally:
        del fake_impls.op_implementations_dict[op]


class FakeWeights:
    """``init_weights`` for ``parallelize``: this rank's shards get fake storage; no value is drawn or read (the
    real loaders draw or copy every weight, which a full-size model on one machine cannot hold)."""

    def __init__(self, mode):
        self.mode = mode

    def load(self, ctx, buffers) -> None:
        from .local_shards import give_storage

        with self.mode:
            give_storage(ctx, buffers)


class _Propagating:
    """DTensor's ``ShardingPropagator._fake_mode_lock`` while a tracker runs: the context torch enters around
    exactly the work that derives an op's output shape from fake tensors of the global shape (a no-op by default,
    a lock in torch's threaded tests: ``inner``, still entered); ``depth`` > 0 inside it."""

    def __init__(self, inner):
        self.inner = inner
        self.depth = 0

    def __enter__(self):
        self.inner.__enter__()
        self.depth += 1

    def __exit__(self, *exc):
        self.depth -= 1
        return self.inner.__exit__(*exc)


def _run_again(tracker, module, pre_forward) -> None:
    """``pre_forward()``, MemTracker's hook before ``module``'s forward, where a top-level module run again in the
    step's forward (a pipeline stage, once per micro-batch) is tracked as torch tracks a submodule run again:
    torch refuses it, taking it for the next iteration, so for that call it sees one more running module than
    "Global" (``AGAIN``)."""
    running = tracker._mod_tracker.parents
    again = module in tracker.memory_tracking and not tracker._mod_tracker.is_bw and AGAIN not in running
    if again:
        running.add(AGAIN)
    try:
        pre_forward()
    finally:
        if again:
            running.discard(AGAIN)


def _views_unhooked(tracker, module) -> None:
    """Before torch's tracking of ``module``'s parameters: a parameter that is a view for the forward is marked as
    hooked, so torch registers no gradient hooks on it (its post-accumulate hook takes only a leaf). Tensor parallel
    runs a module's replicated parameters on their local values, ``param.to_local()``, views whose gradients reach
    the DTensor parameters, leaves tracked with their hooks before the swap."""
    for param in module.parameters():
        if not param.is_leaf and param not in tracker._param_to_grad_hook_handles:
            tracker._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)


def _where(tracker) -> str:
    """Where the tracker is now: the innermost module running, forward or backward, or the step's phase."""
    running = [fqn for fqn in tracker._mod_tracker.parents if fqn != "Global"]
    if not running:
        return f"{tracker.phase}, outside any module"
    inner = max(running, key=lambda fqn: fqn.count("."))
    return f"{inner} ({'backward' if tracker._mod_tracker.is_bw else 'forward'})"


class _NoHook:
    """The handle of a hook not registered (``peak_tracker``): removing it does nothing."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def peak_tracker():
    """A ``MemTracker`` that also records where the peak falls (the innermost module running, forward or
    backward), updates its per-module peaks in time linear in the modules running, not in all modules, and leaves
    DTensor's sharding propagation uncounted under a fake mode too.

    Why by hand: torch's ``_update_peak_stats`` walks every tracked module on every allocation (quadratic in the
    layers: a 70B model's step spent most of its time there); this walk visits only the modules running, the same
    ones torch's loop updates. And DTensor derives an op's output shape by running it on fake tensors of the
    *global* shape, under the fake mode already active if there is one (``detect_fake_mode() or
    FakeTensorMode()``): in a real step that is a fresh mode, which ``MemTracker`` skips (its entry-mode check), in
    the dry run it is the dry run's own, so ``MemTracker`` counted those tensors as live. Clipping's
    ``_foreach_norm`` over every FSDP-sharded gradient at once built each at full size: the whole gradients' bytes
    counted at its peak (Llama 16 x 512, vocabulary 32,000, over 2 ranks: 906 MB in clipping where the real step
    holds 604)."""
    mem_tracker = private_tools()[3]
    total_key = mem_tracker._TOTAL_KEY
    from copy import deepcopy

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    class PeakTracker(mem_tracker.MemTracker):
        peak_where: str = "outside any module"
        phase: str = "the step"  # what the dry run is doing now, for a peak outside every module
        _propagating: _Propagating | None = None

        def __enter__(self):
            inner = getattr(ShardingPropagator, "_fake_mode_lock", None)
            if self._depth == 0 and inner is not None:
                self._propagating = ShardingPropagator._fake_mode_lock = _Propagating(inner)
            return super().__enter__()

        def __exit__(self, *args) -> None:
            super().__exit__(*args)
            if self._depth == 0 and self._propagating is not None:
                ShardingPropagator._fake_mode_lock, self._propagating = self._propagating.inner, None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self._propagating is not None and self._propagating.depth and DTensor not in types:
                return func(*args, **(kwargs or {}))  # the shape's derivation: no memory of the step
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _pre_fw_hook(self, module, inputs) -> None:  # see _run_again
            _run_again(self, module, lambda: super(PeakTracker, self)._pre_fw_hook(module, inputs))

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):  # _views_unhooked
            _views_unhooked(self, module)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

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
            return _where(self)

    return PeakTracker()
