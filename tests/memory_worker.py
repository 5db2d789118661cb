"""Measure the per-rank peak memory of whole optimizer steps on every rank of a torchrun launch, beside the package's
own estimate (``us.estimate``) for that rank's mesh coordinates; rank 0 writes {case: result} as JSON.

Each case trains a tiny Llama (built from a config, nothing downloaded) under one layout with torch's AdamW
(``foreach=True``, what a GPU user gets by default; on CPU torch would pick the for-loop) and the engine's gradient
clipping, STEPS optimizer steps of the same global batch; the last step (optimizer states exist by then) is measured
from the first micro-batch's forward to ``zero_grad`` by two independent counters of live tensor storage:

* ``LiveStorages``: a ``TorchDispatchMode`` ledger of every untyped storage alive — all tensors the garbage
  collector can see before the step, plus every storage an op returns during it (``UntypedStorage.resize_`` is
  patched too: FSDP2 allocates and frees its unsharded parameters that way), each dropped by a weakref finalizer
  when it dies. DDP's buckets, which only C++ holds, are added from the bytes DDP reports until the reducer's
  ``mul.out`` writes into one (then that storage is the bucket).
  Peak = max over the step of the bytes alive; at that moment it records the phase (micro-batch, forward /
  backward, finish_backward, clip, optimizer step, zero_grad), the op, the innermost module, the largest storages,
  and a breakdown by what the bytes are: the trained (sharded) params, their grads, optimizer states, FSDP2's
  gathered params and unsharded grads, DDP's buckets, with a pipeline the given model's weights no stage shares
  (``unsplit_model``: none since the engine moves them to the meta device, engine.release_unheld), the rest by when it was made (``fwd``: the forward up to
  the head; ``logits``: the head's output; ``loss``: the forward after it; ``loss_bwd``: the backward until the
  logits' gradient exists; ``bwd``: the rest of the backward; ``finish_backward``, ``clip``, ``optimizer_step``,
  ``zero_grad``), and ``baseline_other`` (buffers, the batch, pipeline receive buffers). It also keeps the highest
  total of each phase.
* ``StepMemTracker``: torch's ``torch.distributed._tools.mem_tracker.MemTracker`` (parameters, buffers,
  gradients, activations, temporaries, optimizer states; it knows DTensor and FSDP2's storage resizing), with its
  one-call-per-iteration check relaxed (gradient accumulation and pipeline schedules call the root module once per
  micro-batch) and the phase recorded when its peak rises. It counts only what it was given (the trained modules,
  the optimizer) and what ops make while it runs: not DDP's buckets nor the given model's unshared weights.

Neither sees memory outside torch's tensors (gloo's own buffers, the allocator's slack). The process's peak resident
memory over the step (VmHWM after resetting it through /proc/self/clear_refs) is recorded too, but it is coarse: the
allocator reuses memory freed by the steps before, so it rises far less than the tensors alive do.

Usage (see benchmarks/own_memory.py):

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/memory_worker.py OUT.json CASE...
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
import time
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import rows  # noqa: E402

import ultrascale_plugins as us  # noqa: E402

# A tiny Llama whose activations (with the loss's logits) are about half of a rank's peak, one step well under 2 s
MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=8000, max_position_embeddings=256, tie_word_embeddings=False)
SEQ, GLOBAL_BATCH = 256, 8
STEPS = 3  # the first allocates the optimizer states, the second DDP's rebuilt buckets; the third is measured
LR, CLIP = 1e-4, 1.0  # the recipe's defaults: clipping at 1.0 (train.py's max_grad_norm)

# name -> world size, ParallelConfig fields, rows per micro-batch, AdamW flags. The global batch is the same for all
# (GLOBAL_BATCH rows): without a pipeline each rank accumulates its rows in micro-batches of ``mbs`` rows
# (train.accumulate_step's rule: no gradient sync before the last); with one, the schedule splits them into
# pp_microbatches. CI's test_estimates runs the 2-rank cases, less those marked "ci": False (the same layouts
# as one it runs, with one feature more); benchmarks/own_memory.py runs every case.
CASES = {
    # 2 ranks
    "zero3_dp2": {"world": 2, "layout": {"dp_shard": 2, "zero_stage": 3}, "mbs": 2},
    "ddp_dp2_ac_full": {"world": 2, "layout": {"dp_shard": 2, "zero_stage": 0, "activation_checkpointing": "full"},
                        "mbs": 2},
    "zero3_dp2_bf16": {"world": 2, "layout": {"dp_shard": 2, "zero_stage": 3, "mixed_precision": "bf16"}, "mbs": 2},
    # the chunked loss (features/chunked_loss): 128 of a micro-batch's 512 tokens at a time
    "zero3_dp2_chunked": {"world": 2, "layout": {"dp_shard": 2, "zero_stage": 3, "chunked_loss": 128}, "mbs": 2},
    "zero3_dp2_bf16_chunked": {"world": 2, "layout": {"dp_shard": 2, "zero_stage": 3, "mixed_precision": "bf16",
                                                      "chunked_loss": 128}, "mbs": 2, "ci": False},
    # weights, gradients and optimizer states in bf16 (param_dtype); torchao's 8-bit and 4-bit AdamW states (one
    # torchao class per launch: inductor's compiled step of one is reused, wrongly, for the other in a process)
    "zero3_dp2_bf16_params": {"world": 2, "layout": {"dp_shard": 2, "zero_stage": 3, "param_dtype": "bf16"}, "mbs": 2,
                              "ci": False},
    "zero3_dp2_adamw_8bit": {"world": 2, "layout": {"dp_shard": 2, "zero_stage": 3}, "mbs": 2,
                             "optimizer": "adamw_8bit", "ci": False},
    # 4 ranks
    "zero2_dp2_tp2_sp_adamw_4bit": {"world": 4, "layout": {"dp_shard": 2, "tp": 2, "sequence_parallel": True,
                                                           "zero_stage": 2}, "mbs": 2, "optimizer": "adamw_4bit"},
    "zero1_dp2_pp2_1f1b_bf16_params": {"world": 4, "layout": {"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 4,
                                                              "dp_shard": 2, "zero_stage": 1, "param_dtype": "bf16"},
                                       "mbs": 1},
    # a third layout each for bf16 states and the low-bit ones (benchmarks/own_memory.py only)
    "zero2_dp2_tp2_sp_bf16_params": {"world": 4, "layout": {"dp_shard": 2, "tp": 2, "sequence_parallel": True,
                                                            "zero_stage": 2, "param_dtype": "bf16"}, "mbs": 2,
                                     "ci": False},
    "zero1_dp2_pp2_1f1b_adamw_4bit": {"world": 4, "layout": {"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 4,
                                                             "dp_shard": 2, "zero_stage": 1}, "mbs": 1,
                                      "optimizer": "adamw_4bit", "ci": False},
    "zero2_dp2_tp2_sp_chunked": {"world": 4, "layout": {"dp_shard": 2, "tp": 2, "sequence_parallel": True,
                                                        "zero_stage": 2, "chunked_loss": 128}, "mbs": 2},
    "zero1_dp2_pp2_1f1b_chunked": {"world": 4, "layout": {"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 4,
                                                          "dp_shard": 2, "zero_stage": 1, "chunked_loss": 128},
                                   "mbs": 1},
    "zero2_dp2_tp2_sp": {"world": 4, "layout": {"dp_shard": 2, "tp": 2, "sequence_parallel": True, "zero_stage": 2},
                         "mbs": 2},
    "zero1_dp2_pp2_1f1b": {"world": 4, "layout": {"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 4,
                                                  "dp_shard": 2, "zero_stage": 1}, "mbs": 1},
    # the shards, gradients and optimizer states held on the host (cpu_offload; on a CPU the ledger counts them
    # with the rest: the estimate's device and host bytes together), the optimizer step inside the backward
    # (optimizer_in_backward: one micro-batch per step, no clipping)
    "zero3_dp2_offload": {"world": 2, "layout": {"dp_shard": 2, "zero_stage": 3, "cpu_offload": True}, "mbs": 2,
                          "ci": False},
    "zero3_dp2_step_in_backward": {"world": 2, "layout": {"dp_shard": 2, "zero_stage": 3,
                                                          "optimizer_in_backward": True}, "mbs": 4, "clip": False,
                                   "ci": False},
    "zero3_dp2_offload_step_in_backward": {"world": 2, "layout": {"dp_shard": 2, "zero_stage": 3, "cpu_offload": True,
                                                                  "optimizer_in_backward": True},
                                           "mbs": 4, "clip": False},
    "zero2_dp2_tp2_sp_offload": {"world": 4, "layout": {"dp_shard": 2, "tp": 2, "sequence_parallel": True,
                                                        "zero_stage": 2, "cpu_offload": True}, "mbs": 2},
    "zero2_dp2_tp2_sp_step_in_backward": {"world": 4, "layout": {"dp_shard": 2, "tp": 2, "sequence_parallel": True,
                                                                 "zero_stage": 2, "optimizer_in_backward": True},
                                          "mbs": 4, "clip": False},
    "zero3_dp4_step_in_backward": {"world": 4, "layout": {"dp_shard": 4, "zero_stage": 3,
                                                          "optimizer_in_backward": True}, "mbs": 2, "clip": False},
    # what the layers save for their backward held on the host (activation_offload; counted with the rest here)
    "zero3_dp2_act_offload": {"world": 2, "layout": {"dp_shard": 2, "zero_stage": 3, "activation_offload": True},
                              "mbs": 2, "ci": False},
    "zero2_dp2_tp2_sp_ac_full_act_offload": {"world": 4, "layout": {"dp_shard": 2, "tp": 2, "sequence_parallel": True,
                                                                    "zero_stage": 2, "activation_checkpointing": "full",
                                                                    "activation_offload": True}, "mbs": 2},
    "zero1_dp2_pp2_1f1b_act_offload": {"world": 4, "layout": {"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 4,
                                                              "dp_shard": 2, "zero_stage": 1,
                                                              "activation_offload": True}, "mbs": 1},
    # 8 ranks
    "zero3_dp2_tp2_pp2": {"world": 8, "layout": {"dp_shard": 2, "tp": 2, "sequence_parallel": True, "pp": 2,
                                                 "pp_schedule": "1f1b", "pp_microbatches": 4, "zero_stage": 3},
                          "mbs": 1},
}
# beside the five layouts (benchmarks/own_memory.py --extra): the package's own trainer's fused AdamW (train.py)
# and one micro-batch per step
EXTRA_CASES = {
    "zero3_dp2_fused": {"world": 2, "layout": {"dp_shard": 2, "zero_stage": 3}, "mbs": 2, "adamw": {"fused": True}},
    "zero3_dp2_ga1": {"world": 2, "layout": {"dp_shard": 2, "zero_stage": 3}, "mbs": 4},
}
ADAMW_DEFAULT = {"foreach": True}
warnings.filterwarnings("ignore")
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def make_model(seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**MODEL), attn_implementation="sdpa")


def make_batches() -> list[dict]:
    """Full rows of random tokens (no padding: every token is a target), one global batch per step."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, MODEL["vocab_size"], (GLOBAL_BATCH, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


# ---- counter 1: a ledger of live storages ---------------------------------------------------------------------
def storages(t) -> list:
    """The untyped storages behind ``t`` (a wrapper subclass such as DTensor: its inner tensors'); none for meta
    tensors or tensors without storage."""
    if not isinstance(t, torch.Tensor):
        return []
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return [s for a in attrs for s in storages(getattr(t, a))]
    if t.device.type == "meta":
        return []
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return []
    # a fake tensor (torch.compile's caches keep them: torchao's compiled optimizer step) says its device is the
    # CPU, but its storage is on the meta device: no memory
    return [] if st.device.type == "meta" else [st]


def fsdp_params(pmodel) -> list:
    """FSDP2's per-parameter records (``FSDPParam``) of this rank's modules: they hold the unsharded parameters and
    the unsharded gradients accumulated without sync (torch internals, read only)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for part in pmodel.modules:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                group = m._get_fsdp_state()._fsdp_param_group
                out.extend(group.fsdp_params if group is not None else [])
    return out


def head_of(model):
    """The module that makes the logits (the output embedding), or None (a pipeline stage without it)."""
    getter = getattr(model, "get_output_embeddings", None)
    try:
        return getter() if getter is not None else None
    except (AttributeError, NotImplementedError):
        return None


class LiveStorages(TorchDispatchMode):
    """Bytes of every untyped storage alive, by the tag it got when first seen: what it is (``params``,
    ``optimizer``, ``grads``, ``baseline_other``) for storages alive before the step, else the phase that created it
    (``fwd``, ``bwd``, ``finish_backward``, ``clip``, ``optimizer_step``, ``zero_grad``)."""

    def __init__(self, pmodel, optimizer, where=lambda: "", ignore=(), hidden=()):
        super().__init__()
        self.pmodel, self.where = pmodel, where
        self.ignore = {id(st) for st in ignore}  # storages of earlier cases still alive: not this layout's
        # storages only C++ holds (DDP's buckets): counted from their sizes until an op returns them
        self.hidden = list(hidden)
        self.hidden_left = sum(self.hidden)  # DDP reports its buckets' total, not each bucket's size
        self.live: dict[int, tuple] = {}  # id(storage) -> (nbytes, tag, weakref, "phase op" that made it)
        self.by_tag: dict[str, int] = {}
        self.total = self.peak = self.rises = 0
        self.at_peak: dict[int, tuple] = {}  # self.live when the peak was reached
        self.phase, self.mb_fwd, self.graph_tasks = "setup", -1, []
        self.phase_max: dict[str, int] = {}
        self.peak_at: dict = {}
        self.params = list(pmodel.parameters())  # what the optimizer trains: sharded under FSDP2
        self.param_ids = {id(p) for p in self.params}
        inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its partition's in .optim
        self.opt_states = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
        self.fsdp_params = fsdp_params(pmodel)
        self._orig_resize = None
        # the loss's tensors: the head's output (``logits``), what the forward makes of it (``loss``), and the
        # backward's work until the logits' gradient is complete (``loss_bwd``)
        self.after_head, self.head_grad_tasks = False, set()
        self._hooks = [part.register_forward_pre_hook(self._count_forward) for part in pmodel.modules[:1]]
        # a pipeline stage without the head holds a parameterless placeholder in its place
        head = next((h for h in map(head_of, pmodel.modules) if h is not None and any(True for _ in h.parameters())),
                    None)
        self.has_head = head is not None
        if head is not None:
            self._hooks.append(head.register_forward_hook(self._head_output))

    def _count_forward(self, module, args):
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            self.mb_fwd += 1
            self.after_head = False

    def _head_output(self, module, args, output):
        if torch._C._current_graph_task_id() != -1:
            return
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor):
                for st in storages(t):
                    self._retag(id(st), "logits")  # created as "fwd": it is the logits
                if t.requires_grad:
                    t.register_hook(self._logits_grad)
        self.after_head = True

    def _logits_grad(self, grad):
        self.head_grad_tasks.add(torch._C._current_graph_task_id())

    # storage bookkeeping (entries are tuples, replaced on change, so a shallow copy of ``live`` is a snapshot)
    def _add(self, st, tag: str, origin: str = "") -> None:
        key = id(st)
        entry = self.live.get(key)
        if entry is not None:
            n = st.nbytes()
            if n != entry[0]:  # resized (FSDP2's unsharded parameters)
                self.live[key] = (n, *entry[1:])
                self.by_tag[entry[1]] += n - entry[0]
                self.total += n - entry[0]
            return
        if key in self.ignore:
            return
        n = st.nbytes()
        if self.phase != "setup" and "mul.out" in (origin or "") and 0 < n <= self.hidden_left:
            # a bucket the reducer writes a gradient into (its only op on them): counted since the step began
            self.hidden_left -= n
            self.by_tag["ddp_buckets"] -= n
            self.total -= n
            tag = "ddp_buckets"
        self.live[key] = (n, tag, weakref.ref(st, lambda _, key=key: self._drop(key)), origin)
        self.by_tag[tag] = self.by_tag.get(tag, 0) + n
        self.total += n

    def _retag(self, key: int, tag: str) -> None:
        entry = self.live.get(key)
        if entry is not None and entry[1] != tag:
            self.live[key] = (entry[0], tag, *entry[2:])
            self.by_tag[entry[1]] -= entry[0]
            self.by_tag[tag] = self.by_tag.get(tag, 0) + entry[0]

    def _drop(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.by_tag[entry[1]] -= entry[0]
            self.total -= entry[0]

    def label(self) -> str:
        """The phase now: ``mb{k}.fwd`` / ``mb{k}.bwd`` inside the micro-batches (k: forward calls so far; backward:
        autograd graph tasks so far), else the driver's phase."""
        if self.phase != "train_step":
            return self.phase
        task = torch._C._current_graph_task_id()
        if task != -1:
            if task not in self.graph_tasks:
                self.graph_tasks.append(task)
            return f"mb{self.graph_tasks.index(task)}.bwd"
        return f"mb{max(self.mb_fwd, 0)}.fwd"

    def tag(self) -> str:
        label = self.label()
        if not label.startswith("mb"):
            return label
        if label.endswith(".fwd"):
            return "loss" if self.after_head else "fwd"
        if self.has_head and torch._C._current_graph_task_id() not in self.head_grad_tasks:
            return "loss_bwd"
        return "bwd"

    def _note(self, func) -> None:
        label = self.label()
        if self.total > self.phase_max.get(label, -1):
            self.phase_max[label] = self.total
        if self.total > self.peak:
            self.peak, self.rises = self.total, self.rises + 1
            self.at_peak = dict(self.live)
            self.peak_at = {"phase": label, "op": str(func), "module": self.where(), "bytes": self.breakdown()}

    def largest(self, n: int = 12) -> list:
        """The ``n`` largest storages alive at the peak: [MB, category, phase and op that made it]."""
        top = sorted(self.at_peak.values(), key=lambda e: -e[0])[:n]
        return [[round(e[0] / 1e6, 3), self.claimed.get(id(e[2]), e[1]), e[3]] for e in top]

    def breakdown(self) -> dict:
        """Bytes alive now by what they are: the sharded parameters and their gradients, optimizer states, FSDP2's
        gathered (unsharded) parameters and their gradients, then the rest by the tag it was created with."""
        out = dict(self.by_tag)
        seen = set()
        self.claimed = {}  # id(weakref) -> category, for ``largest``

        def claim(t, category):
            for st in storages(t):
                entry = self.live.get(id(st))
                if entry is None or id(st) in seen:
                    continue
                seen.add(id(st))
                self.claimed[id(entry[2])] = category
                out[entry[1]] -= entry[0]
                out[category] = out.get(category, 0) + entry[0]

        for p in self.params:
            claim(p, "params")
            if p.grad is not None:
                claim(p.grad, "grads")
        for t in self.opt_states:
            claim(t, "optimizer")
        for fp in self.fsdp_params:  # FSDP2: the unsharded parameter, its gradient, and the unsharded gradient
            unsharded = getattr(fp, "_unsharded_param", None)  # kept between micro-batches without sync
            if unsharded is not None:
                claim(unsharded, "gathered_params")
                if unsharded.grad is not None:
                    claim(unsharded.grad, "unsharded_grads")
            if getattr(fp, "unsharded_accumulated_grad", None) is not None:
                claim(fp.unsharded_accumulated_grad, "unsharded_grads")
        return {k: v for k, v in out.items() if v}

    # entering and leaving the measured step
    def __enter__(self):
        gc.collect()
        for t in self.params:
            for st in storages(t):
                self._add(st, "params")
            if t.grad is not None:
                for st in storages(t.grad):
                    self._add(st, "grads")
        for t in self.opt_states:
            for st in storages(t):
                self._add(st, "optimizer")
        # with a pipeline, ParallelModel.module is the model as it was given: its weights that no stage shares
        for t in self.pmodel.module.parameters():
            for st in storages(t):
                self._add(st, "unsplit_model")
        for obj in gc.get_objects():  # everything else any Python object holds: buffers, the batch, caches
            try:
                if isinstance(obj, torch.Tensor):
                    for st in storages(obj):
                        self._add(st, "baseline_other")
            except Exception:  # noqa: BLE001 - an object that refuses isinstance or storage queries
                continue
        for n in self.hidden:
            self.by_tag["ddp_buckets"] = self.by_tag.get("ddp_buckets", 0) + n
            self.total += n
        self.before = self.total
        self.peak = self.total
        self.peak_at = {"phase": "before", "op": "", "module": "", "bytes": self.breakdown()}
        self._orig_resize = torch.UntypedStorage.resize_
        ledger = self

        def resize_(st, size):
            ledger._orig_resize(st, size)
            if ledger.phase != "done":
                ledger._add(st, ledger.tag(), f"{ledger.label()} UntypedStorage.resize_")
                ledger._note("UntypedStorage.resize_")

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._orig_resize
        self.phase = "done"
        for h in self._hooks:
            h.remove()
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):  # let DTensor run its local ops, which come back through here
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        tag, origin = self.tag(), None
        for t in tree_flatten(out)[0]:
            for st in storages(t):
                if id(st) not in self.live:
                    origin = origin or f"{self.label()} {func} @{self.where()}"
                self._add(st, tag, origin)
        self._note(func)
        return out


# ---- counter 2: torch's MemTracker -------------------------------------------------------------------------------
class StepMemTracker(MemTracker):
    """MemTracker over a whole optimizer step: a root module called again (the next micro-batch of gradient
    accumulation or of a pipeline schedule) starts fresh per-module statistics instead of refusing; the phase is
    recorded whenever the peak rises."""

    def __init__(self, label):
        super().__init__()
        self.label, self.peak_at = label, "before"

    def _pre_fw_hook(self, module, inputs):
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:  # "multiple iterative calls": the root module's next micro-batch
            self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

    def _post_fw_hook(self, module, inputs, outputs):
        with contextlib.suppress(KeyError):  # a module whose statistics the reset dropped
            super()._post_fw_hook(module, inputs, outputs)

    def _pre_bw_hook(self, module, args):
        with contextlib.suppress(KeyError):
            super()._pre_bw_hook(module, args)

    def _post_bw_hook(self, module, args):
        with contextlib.suppress(KeyError):
            super()._post_bw_hook(module, args)

    def _update_peak_stats(self, peak_state):
        before = dict(self._peak_mem)
        super()._update_peak_stats(peak_state)
        if self._peak_mem != before:
            self.peak_at = self.label()

    def innermost(self) -> str:
        return max(self._mod_tracker.parents, key=lambda n: (n.count("."), n), default="")


# ---- resident memory -------------------------------------------------------------------------------------------
def proc_status(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


# ---- the step ------------------------------------------------------------------------------------------------
def optimizer_step(pmodel, opt, batch: dict, mbs: int, ledger=None, clip: bool = True) -> float:
    """One optimizer step over this rank's rows: micro-batches of ``mbs`` rows with the gradients synchronised
    after the last (train.accumulate_step's rule; a pipeline splits the rows itself), clip, AdamW step, zero_grad."""
    def phase(name):
        if ledger is not None:
            ledger.phase = name

    mine = rows(batch, pmodel.data_parallel_rank, pmodel.data_parallel_size)
    n = mine["input_ids"].shape[0]
    pipelined = pmodel.config.pp > 1
    chunks = [mine] if pipelined else [{k: v[i:i + mbs] for k, v in mine.items()} for i in range(0, n, mbs)]
    shares = pmodel.tokens.shares(chunks)
    if ledger is not None:  # the engine's gradient averaging after the last backward: a phase of its own
        def finish_backward(inner=pmodel.finish_backward):
            phase("finish_backward")
            inner()
            phase("train_step")

        pmodel.finish_backward = finish_backward  # an instance attribute over the method, for this step
    phase("train_step")
    loss = 0.0
    for i, chunk in enumerate(chunks):
        with (contextlib.nullcontext() if i == len(chunks) - 1 else pmodel.no_sync()):
            loss += shares[i] * float(pmodel.train_step(chunk, loss_scale=shares[i]))
    if ledger is not None:
        del pmodel.finish_backward
    phase("clip")
    if clip:
        pmodel.clip_grad_norm_(CLIP)
    phase("optimizer_step")
    if ledger is not None and type(getattr(opt, "optim", opt)).__module__.startswith("torchao"):
        # torchao's step is torch.compile'd, which dynamo refuses under a dispatch mode: it runs outside the two
        # counters (its states exist since the first step and are counted; its temporaries, one parameter's at a
        # time, are not)
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            opt.step()
    else:
        opt.step()
    phase("zero_grad")
    opt.zero_grad(set_to_none=True)
    phase("after")
    return loss


def ddp_buckets(pmodel) -> list[int]:
    """Bytes of each of DDP's gradient buckets as DDP reports them (its logging data); none without DDP. The
    reducer allocates them in C++ (no Python object holds them), so the ledger adds them to what was alive before
    the step until an op returns one (a storage of exactly that size)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = pmodel.forward_module
    if not isinstance(ddp, DistributedDataParallel):
        return []
    sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
    return [int(s) for s in str(sizes).replace(" ", "").split(",") if s]


def alive_storages() -> list:
    """Every untyped storage a Python-visible tensor holds now."""
    gc.collect()
    out = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor):
                out.update((id(st), st) for st in storages(obj))
        except Exception:  # noqa: BLE001 - an object that refuses isinstance or storage queries
            continue
    return list(out.values())


def predicted(pmodel, spec: dict, micro_batches: int) -> dict:
    """The package's per-rank estimate for this rank's mesh coordinates: the raw categories (bytes) and what
    ``planner.cost.peak_memory_gb`` makes of them (its allocator constants: fragmentation on activations, a fixed
    workspace), in bytes."""
    from ultrascale_plugins.interface.estimates import meta_model
    from ultrascale_plugins.planner.cost import GB, peak_memory_gb

    mesh = pmodel.dims.mesh
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())) if mesh is not None else {}
    model_config = pmodel.modules[0].config
    est = us.estimate(pmodel.config, model_config, world_size=dist.get_world_size(), seq_len=SEQ,
                      micro_batch=spec["mbs"], micro_batches=micro_batches, coords=coords,
                      model=meta_model(model_config), optimizer=spec.get("optimizer", "adamw"), check=False)
    raw = {k: int(v) for k, v in est.memory.items()}
    raw["total"] = int(est.total_memory)  # the backward's sum, or the optimizer step's memory if larger
    if est.on_host or est.host_bytes:  # offloaded: on a CPU the host is the device, the ledger holds both at once
        import dataclasses

        raw["host"] = int(est.host_memory)
        raw["device"] = raw["total"]
        raw["total"] = int(dataclasses.replace(est, on_host=set()).total_memory + est.host_bytes)
    with_constants = {k: int(v * GB) for k, v in peak_memory_gb([est]).items()}
    return {"coords": coords, "raw": raw, "peak_memory_gb": with_constants}


def measured_vs_estimate(ledger_bytes: dict, est: dict) -> dict:
    """The ledger's breakdown at the peak folded into the estimate's categories: sharded params; gradients of the
    sharded params; optimizer states; activations = tensors created in the micro-batches' forward and backward
    (the loss's included) that are neither gradients nor FSDP2's unsharded parameters and gradients; other = those,
    what clipping, the optimizer step and the gradient reduction created, and whatever was alive before the step."""
    b = ledger_bytes
    folded = {"params": b.get("params", 0), "grads": b.get("grads", 0), "optimizer": b.get("optimizer", 0),
              "activations": sum(b.get(k, 0) for k in ("fwd", "bwd", "logits", "loss", "loss_bwd"))}
    folded["other"] = sum(b.values()) - sum(folded.values())
    folded["total"] = sum(b.values())
    return {k: {"measured": folded[k], "estimate": est[k],
                "ratio": round(est[k] / folded[k], 3) if folded[k] else None} for k in folded}


def run_case(name: str, spec: dict) -> dict | None:
    world = dist.get_world_size()
    if spec["world"] != world:
        raise SystemExit(f"case {name} needs {spec['world']} processes, this launch has {world}")
    # MemTracker (torch 2.13) keeps some of a tracked model's tensors alive after it exits: the ledger leaves out
    # whatever earlier cases of this launch left behind
    earlier = alive_storages()
    batches = make_batches()
    pmodel = us.parallelize(make_model(), us.ParallelConfig(**spec["layout"]))
    if spec.get("optimizer", "adamw") != "adamw":  # torchao's low-bit AdamW, as the recipe's train.optimizer builds it
        from ultrascale_plugins.cli.loop import optimizer_class

        cls, flags = optimizer_class(spec["optimizer"], stochastic_round=False)
    else:
        cls, flags = torch.optim.AdamW, spec.get("adamw", ADAMW_DEFAULT)
    opt = pmodel.build_optimizer(cls, lr=LR, **flags)
    rows_here = GLOBAL_BATCH // pmodel.data_parallel_size
    micro_batches = pmodel.config.pp_microbatches if pmodel.config.pp > 1 else rows_here // spec["mbs"]
    times, losses = [], []
    for batch in batches[:-1]:
        start = time.perf_counter()
        losses.append(optimizer_step(pmodel, opt, batch, spec["mbs"], clip=spec.get("clip", True)))
        times.append(time.perf_counter() - start)
    # the measured step: the ledger (outer mode, its resize_ patch first) and MemTracker (inner) side by side
    ledger = LiveStorages(pmodel, opt, ignore=earlier, hidden=ddp_buckets(pmodel))
    gc.collect()
    rss_before = proc_status("VmRSS")
    rss_reset = reset_peak_rss()
    start = time.perf_counter()
    with ledger:
        tracker = StepMemTracker(ledger.label)
        ledger.where = tracker.innermost
        tracker.track_external(*pmodel.modules, getattr(opt, "optim", opt))
        tracked_before = tracker.get_tracker_snapshot()
        with tracker:
            losses.append(optimizer_step(pmodel, opt, batches[-1], spec["mbs"], ledger, clip=spec.get("clip", True)))
    del earlier
    measured_s = time.perf_counter() - start
    hwm = proc_status("VmHWM")
    dev = next(iter(tracker._peak_mem_snap), None)
    mt_peak = {str(k): v for k, v in tracker._peak_mem_snap.get(dev, {}).items()} if dev is not None else {}
    mt_before = {str(k): v for k, v in tracked_before.get(dev, {}).items()} if dev is not None else {}
    est = predicted(pmodel, spec, micro_batches)
    result = {
        "coords": est["coords"],
        "ledger": {"peak": ledger.peak, "before_step": ledger.before, "at_peak": ledger.peak_at,
                   "largest_at_peak": ledger.largest(), "phase_max": ledger.phase_max},
        "memtracker": {"peak": mt_peak.get("Total", 0), "before_step": mt_before.get("Total", 0),
                       "at_peak": tracker.peak_at, "bytes": {k: v for k, v in mt_peak.items() if k != "Total"}},
        "rss": {"before_step": rss_before, "peak_during_step": hwm if rss_reset else None},
        "ddp_bucket_bytes": sum(ddp_buckets(pmodel)),
        "estimate": est["raw"], "estimate_peak_memory_gb": est["peak_memory_gb"],
        "by_category": measured_vs_estimate(ledger.peak_at["bytes"], est["raw"]),
        "ratio_raw": round(est["raw"]["total"] / ledger.peak, 3),
        "ratio_with_constants": round(est["peak_memory_gb"]["total"] / ledger.peak, 3),
        "step_s": {"unmeasured": [round(t, 3) for t in times], "measured": round(measured_s, 3)},
        "losses": losses,  # the global-mean loss of each step
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if dist.get_rank() != 0:
        return None
    from torch.optim.optimizer import _default_to_fused_or_foreach

    probe = [torch.nn.Parameter(torch.zeros(1))]
    return {"world": world, "layout": spec["layout"], "micro_batch_rows": spec["mbs"], "micro_batches": micro_batches,
            "adamw": flags, "adamw_default_on_cpu(fused, foreach)": list(_default_to_fused_or_foreach(probe, False,
                                                                                                      False)),
            "ranks": gathered}


def main() -> None:
    out_path, names = sys.argv[1], sys.argv[2:]
    us.init_distributed(timeout=300)
    results = {}
    for name in names:
        print(f"[memory] case {name} (rank {dist.get_rank()})", file=sys.stderr, flush=True)
        results[name] = run_case(name, CASES[name] if name in CASES else EXTRA_CASES[name])
    if dist.get_rank() == 0:
        meta = {"model": MODEL, "seq_len": SEQ, "global_batch": GLOBAL_BATCH, "steps": STEPS, "lr": LR, "clip": CLIP,
                "torch": torch.__version__}
        with open(out_path, "w") as f:
            json.dump({"config": meta, "cases": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
