"""A ledger of every collective this rank issues while it is open: which operation, on which mesh axis, the bytes
handed to it (payload), the bytes a ring algorithm sends for it (wire) and how many calls. ``ParallelModel.
profile_step`` opens one around an optimizer step; ``comm_report`` puts every rank's ledger beside the estimate.

How it sees every collective. Every collective of the layouts reaches torch's dispatcher as one of two op families:

- ``c10d::*`` (``allreduce_``, ``_allgather_base_``, ``send``, ...): the ``torch.distributed`` Python API, which
  FSDP2, ``ZeroRedundancyOptimizer``, pipelining's send/recv, the ring attention, the loss's token counts and the
  gradient norm call; and DDP's C++ reducer too, whose bucket all-reduces go through ``ProcessGroup::allreduce``,
  which dispatches ``c10d::allreduce_``;
- ``_c10d_functional::*``: DTensor's redistributions, the functional collectives, expert parallel's all-to-all (and
  DTensor's own ``_dtensor::shard_dim_alltoall``).

A ``TorchDispatchMode`` sees both, on the thread that runs the step and in the backward (autograd carries the mode
stack with its thread-local state). Torch's own instruments were read first:

- ``torch.distributed.tensor.debug.CommDebugMode`` is such a mode, and its one trick is reused here: answering
  ``NotImplemented`` when a tensor subclass is involved, so that DTensor turns the op into its collectives first and
  the mode then sees those. It is not used as is because it counts calls per op only (no process group, no bytes),
  its list of c10d ops leaves out point-to-point ``send`` / ``recv_`` (a pipeline's and the ring attention's
  traffic), and its module tracker installs global module hooks for the whole time it is open.
- the flight recorder (``TORCH_FR_BUFFER_SIZE``, or ``TORCH_NCCL_TRACE_BUFFER_SIZE`` on NCCL) records every
  collective at the process-group level in C++, Python or not; but it must be switched on before the process group
  exists, and on gloo it leaves out point-to-point ops. It is the independent count instead: when it is on,
  ``flight_recorder_check`` compares its entries for the same window with the ledger's (the tests and the benchmark
  switch it on).

Nothing here changes what runs: the mode calls each op as it was called, and records sizes from its arguments.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# Below this payload a collective is a scalar exchange (token counts, the loss value, a norm, split sizes): its cost
# is its latency, and the table lists such calls in rows of their own
SMALL_BYTES = 1024

ROOTED = ("broadcast", "reduce", "gather", "scatter")


@dataclasses.dataclass
class CommRecord:
    """One collective call on this rank. ``payload``: bytes of the whole tensor the collective is about (see
    ``payload_of``); ``wire``: bytes this rank sends for it (``wire_bytes``); ``size``: ranks in its group."""

    op: str
    axis: str
    size: int
    payload: int
    wire: float

    @property
    def small(self) -> bool:
        return self.payload < SMALL_BYTES


def wire_bytes(op: str, payload: float, size: int, own: float | None = None) -> float:
    """Bytes one rank sends for a collective of ``payload`` bytes over ``size`` ranks, in the ring algorithms NCCL
    and gloo use for large tensors (nccl-tests' ``PERFORMANCE.md`` gives the same factors as "bus bandwidth"):

    - all-reduce: a reduce-scatter then an all-gather round the ring, 2(n-1)/n of the tensor;
    - all-gather, reduce-scatter: (n-1)/n of the whole (gathered, or not yet reduced) tensor;
    - all-to-all: everything but the rank's own chunk (``own``; 1/n of it when the split is even);
    - broadcast, reduce, gather, scatter: a chain from or to the root; (n-1)/n of the tensor, the average over ranks;
    - send: the tensor; recv: nothing (the peer's send counts it); barrier: nothing."""
    if size <= 1 and op != "send":
        return 0.0
    if op == "all_reduce":
        return 2 * (size - 1) / size * payload
    if op in ("all_gather", "reduce_scatter") or op in ROOTED:
        return (size - 1) / size * payload
    if op == "all_to_all":
        return payload - (own if own is not None else payload / size)
    if op == "send":
        return float(payload)
    return 0.0


# ---- the ops: (kind, the argument holding the tensor(s) of the payload, how many times over) ---------------------
# "times": "n" when the argument is one rank's part of the payload (a functional all-gather's input)
_C10D = {
    "allreduce_": ("all_reduce", "tensors"), "allreduce_coalesced_": ("all_reduce", "tensors"),
    "allgather_": ("all_gather", "output_tensors"), "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_coalesced_": ("all_gather", "output_lists"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"), "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "alltoall_": ("all_to_all", "input_tensors"), "alltoall_base_": ("all_to_all", "input"),
    "broadcast_": ("broadcast", "tensors"), "reduce_": ("reduce", "tensors"),
    "gather_": ("gather", "input_tensors", "n"), "scatter_": ("scatter", "output_tensors", "n"),
    "send": ("send", "tensors"), "recv_": ("recv", "tensors"), "recv_any_source_": ("recv", "tensors"),
    "barrier": ("barrier", None), "monitored_barrier_": ("barrier", None),
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", "input"), "all_reduce_": ("all_reduce", "input"),
    "all_reduce_coalesced": ("all_reduce", "inputs"), "all_reduce_coalesced_": ("all_reduce", "inputs"),
    "all_gather_into_tensor": ("all_gather", "input", "n"), "all_gather_into_tensor_out": ("all_gather", "input", "n"),
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs", "n"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"), "reduce_scatter_tensor_out": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "all_to_all_single": ("all_to_all", "input"), "broadcast": ("broadcast", "input"),
    "broadcast_": ("broadcast", "input"), "isend": ("send", "tensor"), "irecv": ("recv", "tensor"),
}
OPS = {**{f"c10d.{k}": v for k, v in _C10D.items()},
       **{f"_c10d_functional.{k}": v for k, v in _FUNCTIONAL.items()},
       # the autograd-aware variants run the plain ones below autograd (seen there); listed in case one is not
       **{f"_c10d_functional_autograd.{k}": _FUNCTIONAL[k]
          for k in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")},
       "_dtensor.shard_dim_alltoall": ("all_to_all", "input")}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group_of(bound: dict):
    """The process group of a call: c10d ops take the group itself (boxed as a TorchScript object), functional
    ones its name."""
    group = bound.get("process_group", bound.get("group_name"))
    if isinstance(group, torch.ScriptObject):
        return dist.ProcessGroup.unbox(group)
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
    return group


def _own_chunk(bound: dict, group, payload: int) -> float | None:
    """Bytes of an all-to-all's input that stay on this rank (its own chunk)."""
    rank = group.rank()
    if isinstance(bound.get("input_tensors"), (list, tuple)):
        return float(_nbytes(bound["input_tensors"][rank]))
    splits = bound.get("input_split_sizes")
    tensor = bound.get("input")
    if splits and isinstance(tensor, torch.Tensor) and tensor.shape[0]:
        return payload * int(splits[rank]) / tensor.shape[0]
    return None


def records_of(name: str, bound: dict, label: Callable[[Any], str]) -> list[CommRecord]:
    """The records of one dispatched op ``name`` ("namespace.op") with arguments ``bound`` (by schema name); []
    when it is not a collective. ``label`` names a process group's mesh axis."""
    if name == "_c10d_functional.batch_p2p_ops":
        group = _group_of(bound)
        return [CommRecord("send" if kind == "isend" else "recv", label(group), group.size(), _nbytes(t),
                           wire_bytes("send" if kind == "isend" else "recv", _nbytes(t), group.size()))
                for kind, t in zip(bound["op_list"], bound["tensors"])]
    spec = OPS.get(name)
    if spec is None:
        return []
    kind, arg = spec[0], spec[1]
    group = _group_of(bound)
    size = group.size()
    payload = _nbytes(bound.get(arg)) if arg else 0
    if len(spec) > 2:  # one rank's part: the whole is n of them
        payload *= size
    own = _own_chunk(bound, group, payload) if kind == "all_to_all" else None
    return [CommRecord(kind, label(group), size, payload, wire_bytes(kind, payload, size, own))]


# ---- naming a process group by its mesh axis ---------------------------------------------------------------------
WORLD = "world"


def axis_labels(meshes) -> dict[str, str]:
    """{process group name: axis name} for every named dimension of ``meshes`` (DeviceMeshes, None skipped) and
    every flattened one made from them so far ("dp_shard+cp"); the default group is "world" unless an axis is it
    (a one-dimensional mesh over every rank uses the default group). A group two meshes share gets both names,
    joined by "|"."""
    labels: dict[str, str] = {}
    if dist.is_initialized():
        labels[dist.group.WORLD.group_name] = WORLD
    named: dict[str, list[str]] = {}
    for mesh in meshes:
        if mesh is None or not mesh.mesh_dim_names:
            continue
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        dims = [(name, mesh.get_group(name)) for name in mesh.mesh_dim_names]
        dims += [(name, flat.get_group()) for name, flat in getattr(root, "_flatten_mapping", {}).items()]
        for name, group in dims:
            names = named.setdefault(group.group_name, [])
            if name not in names:
                names.append(name)
    labels.update({group: "|".join(names) for group, names in named.items()})
    return labels


class GroupLabels:
    """Names process groups by mesh axis, rebuilding its table when it meets a group it does not know yet (a
    flattened axis made during the step). A group of no mesh takes the name of a mesh axis over the same ranks (a
    plugin's own group over the tensor-parallel ranks is "tp"), else it is named by its ranks."""

    def __init__(self, meshes: Callable[[], list] | None = None):
        self.meshes = meshes or (lambda: [])
        self.table = axis_labels(self.meshes())

    def __call__(self, group) -> str:
        name = group.group_name
        if name not in self.table:
            self.table = axis_labels(self.meshes())
        if name not in self.table:
            self.table[name] = self._by_ranks(dist.get_process_group_ranks(group))
        return self.table[name]

    def _by_ranks(self, ranks: list[int]) -> str:
        from torch.distributed.distributed_c10d import _resolve_process_group

        for known, label in list(self.table.items()):
            if label != WORLD and not label.startswith("ranks ") and \
                    dist.get_process_group_ranks(_resolve_process_group(known)) == ranks:
                return label
        return "ranks " + ",".join(map(str, ranks))


# ---- the recorder ----------------------------------------------------------------------------------------------
class CommLedger(TorchDispatchMode):
    """Open it (``with CommLedger(labels) as ledger:``) around the work to record; ``ledger.records`` then holds
    one ``CommRecord`` per collective call this rank issued inside, in order."""

    def __init__(self, labels: Callable[[Any], str] | None = None):
        super().__init__()
        self.labels = labels or GroupLabels()
        self.records: list[CommRecord] = []
        self._names: dict = {}  # op overload -> its "namespace.op" and argument names, or None (not a collective)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(_dispatches(t) for t in types):
            return NotImplemented  # a tensor subclass (DTensor) first turns the op into its collectives (seen next)
        known = self._names.get(func, False)
        if known is False:
            known = self._names[func] = _describe(func)
        if known is not None:
            name, arg_names = known
            bound = dict(zip(arg_names, args))
            bound.update(kwargs)
            self.records.extend(records_of(name, bound, self.labels))
        return func(*args, **kwargs)


def _dispatches(cls) -> bool:
    """Whether tensors of ``cls`` have a ``__torch_dispatch__`` of their own (DTensor; not ``nn.Parameter``, whose
    dispatch is the plain tensor's, nor a dry run's ``FakeTensor``: plain tensors without storage, whose dispatch
    runs the op itself and would refuse a mode that answered ``NotImplemented``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return cls.__torch_dispatch__ is not torch._C._disabled_torch_dispatch_impl and not issubclass(cls, FakeTensor)


def _describe(func):
    """("namespace.op", its argument names) when ``func`` may be a collective, else None."""
    packet = getattr(func, "_overloadpacket", None)
    schema = getattr(func, "_schema", None)
    if packet is None or schema is None:
        return None
    name = f"{func.namespace}.{packet.__name__}"
    if name not in OPS and name != "_c10d_functional.batch_p2p_ops":
        return None
    return name, [a.name for a in schema.arguments]


# ---- summaries -------------------------------------------------------------------------------------------------
def summarise(records: list[CommRecord]) -> list[dict]:
    """One row per (axis, op, small or not): calls, payload and wire bytes, the group's size."""
    rows: dict[tuple, dict] = {}
    for r in records:
        key = (r.axis, r.op, r.small)
        row = rows.setdefault(key, {"axis": r.axis, "op": r.op, "small": r.small, "size": r.size, "calls": 0,
                                    "payload": 0, "wire": 0.0})
        row["calls"] += 1
        row["payload"] += r.payload
        row["wire"] += r.wire
    return list(rows.values())


# ---- the independent count: torch's flight recorder --------------------------------------------------------------
FR_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def flight_recorder_on() -> bool:
    return any(os.environ.get(name, "0").strip() not in ("", "0") for name in FR_ENV)


def flight_recorder_entries() -> list[dict]:
    """The flight recorder's entries on this rank (all process groups), oldest first; [] when it is off."""
    if not flight_recorder_on():
        return []
    import pickle

    from torch._C._distributed_c10d import _dump_fr_trace

    return list(pickle.loads(_dump_fr_trace()).get("entries", []))


def last_record_id() -> int:
    entries = flight_recorder_entries()
    return max((e["record_id"] for e in entries), default=-1)


def fr_op(profiling_name: str) -> str:
    """The ledger's op name for a flight-recorder entry ("gloo:all_reduce", "nccl:_reduce_scatter_base", ...)."""
    name = profiling_name.split(":", 1)[-1].lower().replace("allreduce", "all_reduce").replace(
        "allgather", "all_gather").replace("alltoall", "all_to_all")
    for op in ("reduce_scatter", "all_reduce", "all_gather", "all_to_all", "broadcast", "barrier", "scatter",
               "gather", "reduce", "send", "recv"):
        if op in name:
            return op
    return name


def flight_recorder_check(records: list[CommRecord], after: int, labels: Callable[[Any], str]) -> dict:
    """Compare the ledger with the flight recorder's entries newer than record id ``after``: calls per (axis, op)
    of each side, and the keys where they differ. Point-to-point ops count only where the recorder keeps them (not
    on gloo). ``{"on": False}`` when the recorder is off."""
    if not flight_recorder_on():
        return {"on": False}
    from torch.distributed.distributed_c10d import _resolve_process_group

    entries = [e for e in flight_recorder_entries() if e["record_id"] > after]
    if entries and after >= 0 and entries[0]["record_id"] > after + 1:  # the ring buffer dropped the step's first
        return {"on": True, "error": f"the flight recorder kept only the last {len(entries)} entries of the step. "
                                     f"Fix: raise {FR_ENV[0]}"}
    theirs: dict[str, int] = {}
    for e in entries:
        name = e["process_group"][0]
        try:
            axis = labels(_resolve_process_group(name))
        except (KeyError, ValueError, RuntimeError):
            axis = f"group {name}"
        key = f"{axis} {fr_op(e['profiling_name'])}"
        theirs[key] = theirs.get(key, 0) + 1
    p2p_seen = any(e.get("is_p2p") for e in entries)
    gloo = any(e["profiling_name"].startswith("gloo:") for e in entries)
    ours: dict[str, int] = {}
    for r in records:
        if r.op in ("send", "recv") and not p2p_seen:
            continue
        # gloo has no reduce-scatter of its own: torch runs one as an all-reduce of the whole tensor, and records it
        # under that name
        key = f"{r.axis} {'all_reduce' if gloo and r.op == 'reduce_scatter' else r.op}"
        ours[key] = ours.get(key, 0) + 1
    differ = {k: [ours.get(k, 0), theirs.get(k, 0)] for k in sorted(set(ours) | set(theirs))
              if ours.get(k, 0) != theirs.get(k, 0)}
    return {"on": True, "ledger": ours, "flight_recorder": theirs, "differ": differ, "p2p_recorded": p2p_seen}
