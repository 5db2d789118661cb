"""Run parity cases on every rank of a torchrun launch; rank 0 writes {case: result} as JSON.

Each case trains STEPS optimizer steps of a tiny model under one layout and, on rank 0, the same model in one
process (plain transformers forward with its own loss, plain SGD) from the same seed and global batches, then
records the largest loss and weight differences. Usage (see tests/test_parity.py):

    python -m torch.distributed.run --standalone --nproc_per_node 4 tests/parity_worker.py OUT.json CASE...
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import make_model, packed_batches, padded_batches, rows  # noqa: E402
from parity_cases import CASES, OUTSIDE_CASES  # noqa: E402

import ultrascale_plugins as us  # noqa: E402

STEPS = 5
LR, MOMENTUM = 0.1, 0.9
CLIP = 0.05  # below the tiny models' gradient norms at every step: clipping is active, the global norm compared
warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

_reference_cache: dict = {}


def count_routing(model) -> dict:
    """Per router with a selection bias (e_score_correction_bias): its (token, expert) assignments since the last
    update, counted by a forward hook (the same rule as the router_bias_update field, written out here)."""
    counts, seen = {}, {}
    model.model.register_forward_pre_hook(lambda m, a, k: seen.update(mask=k.get("attention_mask")), with_kwargs=True)
    for module in model.modules():
        if isinstance(getattr(module, "e_score_correction_bias", None), torch.Tensor):
            counts[module] = torch.zeros(module.e_score_correction_bias.numel(), dtype=torch.long)

            def hook(mod, args, output):
                if mod.training:
                    chosen = output[-1]
                    if seen.get("mask") is not None:  # padding left out
                        chosen = chosen[seen["mask"].reshape(-1).bool()]
                    counts[mod] += torch.bincount(chosen.reshape(-1), minlength=counts[mod].numel())

            module.register_forward_hook(hook)
    return counts


def update_biases(counts: dict, rate: float) -> None:
    for module, load in counts.items():
        with torch.no_grad():
            module.e_score_correction_bias += rate * torch.sign(load.float().mean() - load.float())
        load.zero_()


def reference(arch: str, batches, key=None, accumulate=None, bias_rate=0.0):
    """Single-process run: the model's own causal-LM loss over the whole global batch; with ``accumulate``
    (dp, micro-batches), over the global micro-batches a pipeline on dp replicas runs (micro-batch m: every
    replica's m-th chunk of its rows), each model loss weighted by its share of the valid tokens, as gradient
    accumulation weighs them (the router auxiliary loss is then each micro-batch's own)."""
    key = key or arch
    if key not in _reference_cache:
        model = make_model(arch)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        counts = count_routing(model) if bias_rate else {}
        losses, norms = [], []
        for batch in batches:
            if accumulate is None:
                loss = model(**batch, use_cache=False).loss  # as the engine: packed rows get document masks
            else:
                loss = sum(share * model(**mb, use_cache=False).loss for share, mb in micro_batches(batch, *accumulate))
            loss.backward()
            update_biases(counts, bias_rate)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            eval_loss = model(**batches[0], use_cache=False).loss.item()
        _reference_cache[key] = (losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()},
                                 eval_loss)
    return _reference_cache[key]


def micro_batches(batch: dict, dp: int, m: int) -> list[tuple[float, dict]]:
    """(share of the valid tokens, rows) of each global micro-batch of ``batch`` split over ``dp`` replicas, each
    replica's rows in ``m`` consecutive chunks."""
    per = batch["input_ids"].shape[0] // dp
    chunk = per // m
    parts = [{k: torch.cat([v[r * per + i * chunk:r * per + (i + 1) * chunk] for r in range(dp)]) for k, v in batch.items()}
             for i in range(m)]
    counts = [int((p["labels"][:, 1:] != -100).sum()) for p in parts]
    return [(c / sum(counts), p) for c, p in zip(counts, parts)]


def step(pmodel, batch: dict, spec: dict) -> torch.Tensor:
    """One optimizer step's forward and backward on this rank's rows. With ``accumulate`` (dp, m) outside a
    pipeline (whose schedule runs its own micro-batches): m micro-batches, each weighted by its share of the step's
    valid tokens, all but the last inside ``no_sync``, as every front end accumulates."""
    mine = rows(batch, pmodel.data_parallel_rank, pmodel.data_parallel_size)
    m = spec.get("accumulate", (1, 1))[1] if not spec["layout"].get("pp") else 1
    if m == 1:
        return pmodel.train_step(mine)
    size = mine["input_ids"].shape[0] // m
    chunks = [{k: v[i * size:(i + 1) * size] for k, v in mine.items()} for i in range(m)]
    shares = pmodel.tokens.shares(chunks)
    total = 0.0
    for i, chunk in enumerate(chunks):
        with (contextlib.nullcontext() if i == m - 1 else pmodel.no_sync()):
            total = total + shares[i] * pmodel.train_step(chunk, loss_scale=shares[i])
    return total


def make_batches(spec: dict) -> list[dict]:
    """Right-padded batches (16 tokens unless the case says ``seq``), or packed ones (``data: packed``)."""
    seq = spec.get("seq", 16)
    if spec.get("data") == "packed":
        return packed_batches(STEPS, seq_len=seq)
    return padded_batches(STEPS, seq_len=seq, positions=spec.get("positions", False))


def run_case(name: str, spec: dict) -> dict | None:
    arch, layout = spec["arch"], spec["layout"]
    positions = spec.get("positions", False)
    batches = make_batches(spec)
    graphs_before, breaks_before = compiled_graphs(), graph_breaks()
    pmodel = us.parallelize(make_model(arch), us.ParallelConfig(**layout))
    opt = pmodel.build_optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    counter = CollectiveCounter()
    for batch in batches:
        last = len(losses) == len(batches) - 1
        with (counter if last and spec.get("count_collectives") else contextlib.nullcontext()):
            loss = step(pmodel, batch, spec)
            norms.append(float(pmodel.clip_grad_norm_(CLIP)))
            opt.step()
        if last:  # gradients and optimizer states all exist now
            held = holdings(pmodel, opt)
        opt.zero_grad()
        losses.append(loss.item())
    # what this rank holds vs what the planner's estimate says it holds, exactly, for every rank
    bytes_held = [None] * dist.get_world_size()
    dist.all_gather_object(bytes_held, (held, predicted_holdings(pmodel, len(batches[0]["input_ids"]))))
    # every rank must report the same loss
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, losses)
    eval_loss = pmodel.eval_step(rows(batches[0], pmodel.data_parallel_rank, pmodel.data_parallel_size)).item()
    weights = pmodel.full_state_dict()
    # what the plugins report in checkpoints (scalars only): an outside plugin's counters
    plugin_state = {k: v for k, v in pmodel.state_dict()["plugins"].shared.items() if isinstance(v, (int, float, str))}
    roundtrip = None
    if spec.get("roundtrip"):  # this rank's sharded state loads into a fresh model of the same layout
        fresh = us.parallelize(make_model(arch, seed=5), us.ParallelConfig(**layout))
        fresh.load_state_dict(pmodel.state_dict())
        again = fresh.full_state_dict()
        roundtrip = all(torch.equal(again[k], weights[k]) for k in weights)
    graphs = compiled_graphs() - graphs_before  # compile: regional must really have compiled
    breaks = graph_breaks() - breaks_before  # ... the whole layer, not pieces of it
    # the optimizer implementations are independent of compilation: compiled cases skip them (compile time)
    adamw = adamw_implementations_agree(arch, spec, batches) if spec.get("adamw", True) else {}
    if dist.get_rank() != 0:
        return None
    accumulate = spec.get("accumulate")
    ref_losses, ref_norms, ref_weights, ref_eval = reference(
        arch, batches, key=(arch, positions, spec.get("data", "padded"), spec.get("seq", 16), accumulate,
                            layout.get("router_bias_update", 0.0)),
        accumulate=accumulate, bias_rate=layout.get("router_bias_update", 0.0))
    missing = sorted(set(ref_weights) ^ set(weights))
    weight_diff = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights if k in weights)
    return {"losses": losses, "ref_losses": ref_losses,
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "norm_rel_diff": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
            "clipped": all(n > CLIP for n in ref_norms),
            "weight_diff": weight_diff, "missing_keys": missing, "eval_diff": abs(eval_loss - ref_eval),
            "ranks_agree": all(g == gathered[0] for g in gathered), "roundtrip": roundtrip, "adamw": adamw,
            "bytes_held": bytes_held, "plugin_state": plugin_state,
            "router_bias": max((float(weights[k].abs().max()) for k in weights if k.endswith("e_score_correction_bias")),
                               default=None), "compiled_graphs": graphs, "graph_breaks": breaks, "prefetch": prefetch_targets(pmodel),
            "collectives": {**counter.calls, "fsdp_groups": fsdp_groups(pmodel)}}


class CollectiveCounter(TorchDispatchMode):
    """Calls of the c10d all-gathers and reduce-scatters (FSDP2's) while active, whatever Python function issued
    them: {"all_gather": n, "reduce_scatter": n}."""

    def __init__(self):
        super().__init__()
        self.calls = {"all_gather": 0, "reduce_scatter": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("c10d::"):
            if "allgather" in name or "all_gather" in name:
                self.calls["all_gather"] += 1
            elif "reduce_scatter" in name:
                self.calls["reduce_scatter"] += 1
        return func(*args, **(kwargs or {}))


def fsdp_groups(pmodel) -> int:
    """How many FSDP2 groups (``fully_shard`` calls) this rank's modules hold."""
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for part in pmodel.modules for m in part.modules())


def prefetch_targets(pmodel) -> list[int]:
    """[forward, backward]: how many explicit FSDP2 prefetch targets this rank's layers were given."""
    from torch.distributed.fsdp import FSDPModule

    states = [m._get_fsdp_state() for part in pmodel.modules for m in part.modules() if isinstance(m, FSDPModule)]
    return [sum(len(s._states_to_forward_prefetch) for s in states),
            sum(len(s._states_to_backward_prefetch) for s in states)]


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


ADAMW = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
# Adam scales every update to about lr, so a last-bit difference in a gradient near eps (1e-8) moves a weight by a
# visible fraction of lr: at lr=1e-4 the implementations agree within 1e-6 in one process as in every layout
ADAMW_STEPS, ADAMW_LR = 2, 1e-4


def adamw_implementations_agree(arch: str, spec: dict, batches) -> dict:
    """The same layout trained with torch's AdamW as a for-loop, foreach (the CUDA default) and fused (the
    Trainer's default): {implementation: (max |loss - for-loop loss|, max |weight - for-loop weight|)}. All
    three must run: foreach and fused refuse a mix of DTensor and plain parameters."""
    runs = {}
    for kind, flags in ADAMW.items():
        pmodel = us.parallelize(make_model(arch), us.ParallelConfig(**spec["layout"]))
        opt = pmodel.build_optimizer(torch.optim.AdamW, lr=ADAMW_LR, **flags)
        losses = []
        for batch in batches[:ADAMW_STEPS]:
            losses.append(step(pmodel, batch, spec).item())
            pmodel.clip_grad_norm_(CLIP)
            opt.step()
            opt.zero_grad()
        runs[kind] = (losses, pmodel.full_state_dict())
    base_losses, base_weights = runs["for_loop"]
    return {kind: (max(abs(a - b) for a, b in zip(losses, base_losses)),
                   max((weights[k] - base_weights[k]).abs().max().item() for k in base_weights))
            for kind, (losses, weights) in runs.items() if kind != "for_loop"}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def holdings(pmodel, opt) -> dict:
    """Bytes of this rank's parameters, gradients and optimizer state tensors (each tensor once)."""
    params = {id(p): p for p in pmodel.parameters()}.values()
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its partition's states in .optim
    states = [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t)]

    def size(tensors):
        return sum(_local(t).numel() * _local(t).element_size() for t in tensors)

    return {"params": size(params), "grads": size(p.grad for p in params if p.grad is not None),
            "optimizer": size(states)}


def predicted_holdings(pmodel, global_rows: int) -> dict:
    """The planner's per-rank prediction (``ultrascale_cost_estimate``) for this rank's mesh coordinates."""
    from ultrascale_plugins.interface.estimates import meta_model

    mesh = pmodel.dims.mesh
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())) if mesh is not None else {}
    model_config = pmodel.modules[0].config
    est = us.estimate(pmodel.config, model_config, world_size=dist.get_world_size(), coords=coords,
                      model=meta_model(model_config), optimizer="sgd_momentum", check=False,
                      micro_batches=max(1, pmodel.config.pp_microbatches))
    return {k: int(est.memory[k]) for k in ("params", "grads", "optimizer")}


def main() -> None:
    out_path, names = sys.argv[1], sys.argv[2:]
    us.init_distributed(timeout=120)
    results = {}
    for name in names:
        print(f"[parity] case {name} (rank {dist.get_rank()})", file=sys.stderr, flush=True)
        start = time.perf_counter()
        results[name] = run_case(name, CASES[name] if name in CASES else OUTSIDE_CASES[name])
        if results[name] is not None:  # the wall time of the case on this machine (the summary prints it)
            results[name]["seconds"] = round(time.perf_counter() - start, 1)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
