"""The machine a plan is for: memory and dense bf16 peak of one GPU, link bandwidths inside and between nodes.

Figures are the vendors' data sheets (per GPU, one direction). How collective bandwidth falls as a collective
spans more nodes is taken from the one published measurement at hand: the bus bandwidth of NCCL collectives on
the Ultra-Scale Playbook's H100 cluster (8 GPUs and 8 x 400 Gb/s per node, 256 MB messages, 1 to 64 nodes; the
reference notes' README). That curve is scaled to each preset's own figures: inside a node by its NVLink bandwidth
(450 GB/s on that cluster), between nodes by its per-node network bandwidth (400 GB/s there). A profile that
``ultrascale calibrate`` wrote (``hardware_profile``) carries this machine's own curve inside a node instead, by group
size, and its fitted time-model constants.
"""
from __future__ import annotations

import dataclasses
import math

from ..interface.config import ConfigError

# The Playbook cluster's measured bus bandwidth (GB/s) by node count: the shape of multi-node scaling.
MEASURED_NODES = (1, 2, 4, 8, 16, 32, 64)
MEASURED_BUSBW = {
    "all_reduce": (436, 362, 160, 100, 85, 65, 33),
    "all_gather": (250, 185, 119, 69, 55, 28, 11),
    "reduce_scatter": (250, 182, 116, 69, 55, 28, 11),
}
_MEASURED_INTRA, _MEASURED_NODE_NET = 450.0, 400.0


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    memory_gb: float
    tflops: float  # dense bf16 peak per GPU
    intra_node_gbps: float  # per GPU, one direction (NVLink / xGMI / PCIe)
    inter_node_gbps: float  # per GPU, one direction (the GPU's share of the node's network)
    gpus_per_node: int = 8
    host_link_gbps: float = 32.0  # GPU <-> host per GPU, one direction (PCIe: Gen4 x16 32, Gen5 x16 64)
    host_memory_gb: float = 256.0  # host memory per GPU for offloaded states (a DGX H100: 2 TB for 8 GPUs)
    # a calibrated profile's: overrides of constants.CONSTANTS, as (name, value) pairs, which a CostModel applies
    constants: tuple = ()
    # a calibrated profile's bus bandwidth inside a node: (collective, ((group size, GB/s), ...)) pairs
    measured_busbw: tuple = ()

    def describe(self) -> str:
        measured = ", collectives as measured inside a node" if self.measured_busbw else ""
        return (f"{self.name}: {self.memory_gb:g} GB, {self.tflops:g} TFLOP/s bf16, {self.intra_node_gbps:g} GB/s "
                f"intra-node, {self.inter_node_gbps:g} GB/s inter-node per GPU, {self.gpus_per_node} GPUs/node, "
                f"{self.host_link_gbps:g} GB/s and {self.host_memory_gb:g} GB of host memory per GPU{measured}")

    def bus_bandwidth(self, collective: str, nodes: int, group: int | None = None) -> float:
        """Bus bandwidth in bytes/s of a collective (or point-to-point transfer) whose ranks span ``nodes``; inside a
        node, a calibrated profile's measured curve at ``group`` ranks (None: its largest group) when it has one for
        the collective."""
        curve = dict(self.measured_busbw).get(collective)
        if nodes <= 1 and curve:
            return 1e9 * _by_group(curve, group)
        if collective == "p2p":
            return 1e9 * (self.intra_node_gbps if nodes <= 1 else self.inter_node_gbps)
        curve = MEASURED_BUSBW["all_gather" if collective == "all_to_all" else collective]
        measured = _interpolate(curve, nodes)
        if nodes <= 1:
            return 1e9 * measured * self.intra_node_gbps / _MEASURED_INTRA
        net = self.inter_node_gbps * self.gpus_per_node
        return 1e9 * min(measured * net / _MEASURED_NODE_NET, curve[0] * self.intra_node_gbps / _MEASURED_INTRA)


def bus_share(collective: str, group: int) -> float:
    """The share of a collective's bytes that leaves each of ``group`` ranks (ring algorithms; NCCL's bus factor):
    what a term's bytes are multiplied by before the bus bandwidth divides them."""
    return {"all_reduce": 2 * (group - 1) / group, "all_gather": (group - 1) / group,
            "reduce_scatter": (group - 1) / group, "all_to_all": (group - 1) / group}.get(collective, 1.0)


def _by_group(curve, group: int | None) -> float:
    """A measured curve ((group size, GB/s), ...) at ``group`` ranks: log-linear in the group size between measured
    sizes, the nearest measured size's figure outside them."""
    points = sorted(curve)
    x = math.log2(points[-1][0] if group is None else max(group, 1))
    xs = [math.log2(g) for g, _ in points]
    if x <= xs[0] or len(points) == 1:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    return _log_linear(xs, [v for _, v in points], x)


def _log_linear(xs, ys, x: float) -> float:
    """``ys`` at ``x``, between the two of ``xs`` (ascending) around it: linear in x, geometric in y."""
    i = max(k for k in range(len(xs) - 1) if xs[k] <= x)
    t = (x - xs[i]) / (xs[i + 1] - xs[i])
    return math.exp(math.log(ys[i]) * (1 - t) + math.log(ys[i + 1]) * t)


def _interpolate(curve, nodes: float) -> float:
    """Log-linear in the node count between measured points; beyond 64 nodes the last halving's slope goes on."""
    xs = [math.log2(n) for n in MEASURED_NODES]
    x = math.log2(max(1.0, nodes))
    if x >= xs[-1]:
        slope = math.log(curve[-1] / curve[-2])
        return curve[-1] * math.exp(slope * (x - xs[-1]))
    return _log_linear(xs, curve, x)


PRESETS = {
    "h100-sxm-80gb": Hardware("h100-sxm-80gb", 80, 989, 450, 50, host_link_gbps=64),
    "h100-pcie-80gb": Hardware("h100-pcie-80gb", 80, 756, 64, 50, host_link_gbps=64),
    "h200-141gb": Hardware("h200-141gb", 141, 989, 450, 50, host_link_gbps=64),
    "b200-180gb": Hardware("b200-180gb", 180, 2250, 900, 50, host_link_gbps=64),
    "a100-80gb": Hardware("a100-80gb", 80, 312, 300, 25, host_link_gbps=32),
    "a100-40gb": Hardware("a100-40gb", 40, 312, 300, 25, host_link_gbps=32),
    "l40s-48gb": Hardware("l40s-48gb", 48, 362, 32, 25, host_link_gbps=32),
    # a 24 GB workstation card (no NVLink: PCIe Gen4 between GPUs and to the host)
    "rtx4090-24gb": Hardware("rtx4090-24gb", 24, 165, 32, 12.5, host_link_gbps=32, host_memory_gb=128),
    # one MI250X die (graphics compute die) as the software sees it: Frontier's nodes hold 8 of them, linked to
    # the CPU by Infinity Fabric (36 GB/s per die)
    "mi250x-gcd-64gb": Hardware("mi250x-gcd-64gb", 64, 191.5, 50, 12.5, host_link_gbps=36),
}


def hardware_from_args(gpu: str | None = None, *, memory_gb=None, tflops=None, intra_node_gbps=None,
                       inter_node_gbps=None, gpus_per_node: int | None = None) -> Hardware:
    """A preset or a calibrated profile's file (``gpu``) with any figure overridden, or custom figures (all four
    then required). ``gpus_per_node``: the preset's 8 or the profile's measured count unless given."""
    custom = {"memory_gb": memory_gb, "tflops": tflops, "intra_node_gbps": intra_node_gbps,
              "inter_node_gbps": inter_node_gbps}
    flag = {"memory_gb": "--gpu-memory-gb", "tflops": "--gpu-tflops", "intra_node_gbps": "--intra-node-gbps",
            "inter_node_gbps": "--inter-node-gbps"}
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node {gpus_per_node}: must be at least 1. Fix: e.g. --gpus-per-node 8")
    node = {} if gpus_per_node is None else {"gpus_per_node": gpus_per_node}
    if gpu is None:
        missing = [k for k, v in custom.items() if v is None]
        if missing:
            flags = ", ".join(flag[k] for k in missing)
            raise ConfigError(f"no --gpu preset and no {flags}. Fix: pass --gpu with one of {', '.join(PRESETS)} "
                              "or a profile from ultrascale calibrate, or all four custom figures")
        for k, v in custom.items():
            if v <= 0:
                raise ConfigError(f"{flag[k]} {v}: must be positive. Fix: give the data-sheet figure")
        return Hardware("custom", **custom, **node)
    key = gpu.lower()
    if key in PRESETS:
        base = PRESETS[key]
    elif is_profile_path(gpu):
        from .hardware_profile import read_profile

        base = Hardware(**read_profile(gpu))
    else:
        raise ConfigError(f"--gpu {gpu!r}: unknown preset. Fix: one of {', '.join(PRESETS)}, a profile file written "
                          "by ultrascale calibrate, or give --gpu-memory-gb --gpu-tflops --intra-node-gbps "
                          "--inter-node-gbps instead")
    overrides = {k: v for k, v in custom.items() if v is not None}
    if "intra_node_gbps" in overrides:  # the figure given replaces a profile's measured curve inside a node
        overrides["measured_busbw"] = ()
    return dataclasses.replace(base, **node, **overrides)


def is_profile_path(gpu: str) -> bool:
    """Whether ``--gpu`` names a file rather than a preset: one that exists, or a name with a folder or a
    ``.json`` suffix (a missing profile is then refused as a file, not as an unknown preset)."""
    import os

    return os.path.exists(gpu) or os.sep in gpu or gpu.lower().endswith(".json")
