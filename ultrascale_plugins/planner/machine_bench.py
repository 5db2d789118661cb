"""``ultrascale calibrate``'s measurements in one process: matmul throughput by kernel size and dtype, memory
bandwidth (a large copy), the host link (pinned host <-> device copies on a GPU; on a CPU the host is the device,
so the link is the memory copy itself), the machine's memory, and a training step's kernels beyond the matmuls:
causal attention, one decoder layer's forward and backward under bf16 autocast, fused AdamW's step. Each point is
the median of its repeats, each repeat long enough for the timer (a loop of kernels), after a warm-up.
"""
from __future__ import annotations

import os
import statistics
import time

import torch


def device() -> torch.device:
    """The device a step runs on here: the first GPU when one is visible, else the CPU (and with
    ``ULTRASCALE_DEVICE=cpu``, as the workers read it: ``distributed.launch.device_for_rank``)."""
    if torch.cuda.is_available() and os.environ.get("ULTRASCALE_DEVICE", "") != "cpu":
        return torch.device("cuda", 0)
    return torch.device("cpu")


def sync(dev: torch.device) -> None:
    """Wait for the device's queued kernels (a GPU's; a CPU runs them as they are called)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, repeats: int, min_s: float) -> float:
    """Seconds of one ``fn()``: the median of ``repeats`` timings, each of enough calls to last ``min_s``."""
    fn()
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    calls = max(1, int(min_s / max(time.perf_counter() - t0, 1e-9)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(dev)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def matmul_point(n: int, dtype: torch.dtype, dev: torch.device, repeats: int, min_s: float) -> tuple[float, float]:
    """(GFLOP, seconds) of an n x n by n x n matmul in ``dtype``."""
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    return 2 * n ** 3 / 1e9, timed(lambda: torch.mm(a, b), dev, repeats, min_s)


def copy_gbps(nbytes: int, dev: torch.device, repeats: int, min_s: float) -> float:
    """GB/s of a large copy on ``dev``, counting the bytes read and written (STREAM's copy)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), dev, repeats, min_s) / 1e9


def host_link_gbps(nbytes: int, dev: torch.device, repeats: int, min_s: float) -> dict:
    """GB/s of pinned host-to-device and device-to-host copies of ``nbytes`` (one direction each)."""
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    to_device = timed(lambda: on_device.copy_(host, non_blocking=True), dev, repeats, min_s)
    to_host = timed(lambda: host.copy_(on_device, non_blocking=True), dev, repeats, min_s)
    return {"to_device_gbps": nbytes / to_device / 1e9, "to_host_gbps": nbytes / to_host / 1e9}


def host_memory_gb() -> float:
    """This machine's memory in GB (16 when the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 16.0


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return "cpu"


def device_memory_gb(dev: torch.device) -> float:
    return torch.cuda.get_device_properties(dev).total_memory / 1e9


# A decoder layer measured for the step's kernels beyond the matmuls: Llama-shaped, and not any model the planner is
# checked against here (hidden 384, gated MLP 1,024, 6 heads of 64, 2 key/value heads)
LAYER_SHAPE = dict(hidden_size=384, intermediate_size=1024, num_attention_heads=6, num_key_value_heads=2,
                   head_dim=64, vocab_size=256, max_position_embeddings=4096)
LAYER_ROWS = (1, 4)  # rows of the layer's sequence (``calibrate.Settings.layer_seq``): two token counts


def autocast(dev: torch.device):
    """bf16 autocast on ``dev``, as a step with ``mixed_precision: bf16`` computes."""
    return torch.autocast(dev.type, dtype=torch.bfloat16)


def attention_point(dev: torch.device, seq: int, repeats: int, min_s: float) -> tuple[float, float]:
    """(GFLOP as the planner counts attention, 12 x heads x head_dim x s per token, seconds) of a causal
    ``scaled_dot_product_attention`` forward and backward in bf16 at the layer's shape."""
    import torch.nn.functional as F

    heads, dim = LAYER_SHAPE["num_attention_heads"], LAYER_SHAPE["head_dim"]
    rows = LAYER_ROWS[-1]
    q, k, v = (torch.randn(rows, heads, seq, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return 12 * heads * dim * seq * rows * seq / 1e9, timed(run, dev, repeats, min_s)


def layer_points(dev: torch.device, seq: int, repeats: int, min_s: float) -> list[tuple[int, float]]:
    """[(tokens, seconds)] of one decoder layer's forward and backward under bf16 autocast at ``LAYER_ROWS`` rows
    of ``seq``: a 2-layer model's time less a 1-layer model's (the embedding, head and loss cancel)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = []
    for rows in LAYER_ROWS:
        ids = torch.randint(0, LAYER_SHAPE["vocab_size"], (rows, seq), device=dev)
        seconds = []
        for layers in (1, 2):
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(**LAYER_SHAPE, num_hidden_layers=layers)).to(dev)

            def run():
                with autocast(dev):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()

            seconds.append(timed(run, dev, repeats, min_s))
        out.append((rows * seq, max(seconds[1] - seconds[0], 1e-9)))
    return out


def layer_matmul_gflop(tokens: int) -> tuple[float, float]:
    """(GFLOP, GFLOP of one MLP matmul) of the measured layer's matmuls over ``tokens``, forward and backward."""
    s = LAYER_SHAPE
    h, f, q = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"] * s["head_dim"]
    kv = s["num_key_value_heads"] * s["head_dim"]
    weights = h * (2 * q + 2 * kv) + 3 * h * f
    return 6 * weights * tokens / 1e9, 2 * tokens * h * f / 1e9


def adamw_point(dev: torch.device, numel: int, repeats: int, min_s: float) -> tuple[int, float]:
    """(elements, seconds) of torch's fused AdamW step (the training command's) over ``numel`` fp32 elements in
    eight tensors."""
    params = [torch.zeros(numel // 8, device=dev, requires_grad=True) for _ in range(8)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    return numel // 8 * 8, timed(opt.step, dev, repeats, min_s)
