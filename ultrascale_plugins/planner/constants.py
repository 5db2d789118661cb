"""The time and memory model's global constants: few, not fitted per row or per model, each stated in
docs/planner.md with how it was chosen. A calibrated hardware profile (``ultrascale calibrate``) overrides some of
them for the machine it measured (``hardware_profile``); a ``CostModel`` applies the overrides it is given."""
from __future__ import annotations

CONSTANTS = {
    "matmul_efficiency": 0.40,  # fraction of the dense bf16 peak a training step's kernels reach at large sizes
    "half_efficiency_gflop": 2.0,  # a matmul of this many GFLOP per rank runs at half of that (small shapes)
    "collective_latency_s": 100e-6,  # per call and tree level (log2 of the group size)
    "p2p_latency_s": 1e-3,  # per pipeline send/receive inside a node
    "p2p_latency_inter_node_s": 20e-3,  # per pipeline send/receive between nodes
    "dp_overlap": 0.0,  # share of gradient reduction hidden behind backward
    "gather_overlap": 0.8,  # share of ZeRO-3 weight gathers hidden behind compute (prefetch)
    "memory_overhead_gb": 0.25,  # allocator workspaces per GPU outside the categories
    "fragmentation": 1.15,  # allocator slack on activations
    # AdamW on the host (cpu_offload), elements per second of a node's CPU, shared by the node's ranks: PyTorch's
    # CPU Adam at about 1.4 s per billion parameters (ZeRO-Offload, Ren et al. 2021)
    "host_step_elements_s": 7e8,
    # a calibrated profile's kernels beyond the matmuls (``ultrascale calibrate``); 0: not priced apart, as on the
    # presets, whose matmul efficiency was chosen against whole GPU steps and so holds them
    "attention_efficiency": 0.0,  # attention's FLOPs (12 L a d s per token) run at this share of the bf16 peak
    "layer_call_s": 0.0,  # per decoder layer and micro-batch, beyond its kernels' work (launches, Python)
    "element_s": 0.0,  # per token and element of a layer's activations: the element-wise kernels (norms, SwiGLU)
    "optimizer_elements_s": 0.0,  # fused AdamW on the device: elements stepped per second
}
