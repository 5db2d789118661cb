"""Parity of tiny models under parallel layouts, case after case, in one torchrun launch.

    python -m torch.distributed.run --standalone --nproc_per_node W benchmarks/compat/worker.py OUT.jsonl \
        MODEL_TYPE:LAYOUT ...

For each case every rank builds the same tiny model from the same seed, trains STEPS SGD steps on padded batches
with global gradient-norm clipping at CLIP (active at every step, so the norm itself is compared) and rank 0
compares loss, gradient norm and final weights with one process running the plain transformers model. Rank 0
appends one JSON line per case to OUT. A case that fails the same way on every rank (a ConfigError refusal, an
exception) is recorded and the launch goes on; a rank that dies or hangs ends the launch (the driver records the
case and relaunches with the rest).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

warnings.filterwarnings("ignore")
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

from compat.layouts import ALL  # noqa: E402
from compat.tiny import Untinyable, build_model  # noqa: E402

STEPS = 4
LR, MOMENTUM = 0.1, 0.9
CLIP = 0.05  # far below the tiny models' gradient norms: clipping is active at every step
SEQ, BATCH = 16, 8


def batches():
    from models import padded_batches

    return padded_batches(STEPS, global_batch=BATCH, seq_len=SEQ)


def rows(batch, rank, size):
    per = batch["input_ids"].shape[0] // size
    return {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}


_reference: dict = {}
_routing: dict = {}


def record_routing(model) -> list:
    """Record, per forward call of every router (a module whose output tuple holds an integer [tokens, k]
    tensor: the top-k expert indices), the sorted experts of each token, so that the parallel run's routing can
    be compared token by token with one process's: a tolerance never hides a flipped expert."""
    records: list = []

    def hook(module, args, out):
        if isinstance(out, tuple):
            for t in out:
                if torch.is_tensor(t) and not t.is_floating_point() and t.dim() == 2 and t.dtype != torch.bool:
                    records.append(t.detach().sort(-1).values.cpu())
                    return

    for _, module in model.named_modules():
        module.register_forward_hook(hook)
    return records


def with_adapters(model, peft: dict | None):
    """``model`` wrapped by PEFT's LoRA on every ``nn.Linear`` (or GPT-2's ``Conv1D``) inside its decoder layers (as
    PEFT's "all-linear" picks linear layers; mixture-of-experts weights that are not ``nn.Linear`` stay frozen),
    adapters drawn from a fixed seed; ``model`` itself when ``peft`` is None."""
    if peft is None:
        return model
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    layers = set(getattr(model, "_no_split_modules", None) or [])
    inside = [fqn for fqn, m in model.named_modules() if type(m).__name__ in layers]
    # full names: a leaf name alone would also match a fused expert parameter of that name (PEFT then wraps the
    # parameter, which is not a linear layer); linear layers exactly (a router subclassing nn.Linear that returns a
    # tuple is not one PEFT can adapt)
    names = [fqn for fqn, m in model.named_modules()
             if type(m) in (torch.nn.Linear, Conv1D) and any(fqn.startswith(layer + ".") for layer in inside)]
    if not names:
        raise Untinyable("no linear layer inside the decoder layers for LoRA to target")
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=peft["r"], lora_alpha=2 * peft["r"], lora_dropout=0.0,
                                            target_modules=names))


def reference(model_type: str, overrides: dict | None = None, peft: dict | None = None, clip: float = CLIP):
    """One process, the model's own loss, torch's clip_grad_norm_, plain SGD."""
    key = (model_type, json.dumps(overrides or {}, sort_keys=True), json.dumps(peft, sort_keys=True), clip)
    if key not in _reference:
        try:
            model = with_adapters(build_model(model_type, overrides=overrides), peft)
            routing = record_routing(model)
            trained = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.SGD(trained, lr=LR, momentum=MOMENTUM)
            losses, norms = [], []
            for batch in batches():
                loss = model(**batch, use_cache=False).loss
                loss.backward()
                norms.append(float(torch.nn.utils.clip_grad_norm_(trained, clip)))
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            _reference[key] = (losses, norms, weights, None)
            _routing[key] = routing
        except Exception as exc:  # noqa: BLE001
            _reference[key] = (None, None, None, f"{type(exc).__name__}: {_first_line(exc)}")
            _routing[key] = []
    return _reference[key]


def _first_line(exc) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def _where(exc) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if "ultrascale_plugins" in f.filename] or frames
    f = own[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"


def run_parallel(model_type: str, layout: dict, overrides: dict, peft: dict | None = None,
                 clip: float = CLIP) -> dict:
    import ultrascale_plugins as us

    model = with_adapters(build_model(model_type, overrides=overrides), peft)
    routing = record_routing(model)
    pmodel = us.parallelize(model, us.ParallelConfig(**layout))
    opt = pmodel.build_optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for batch in batches():
        loss = pmodel.train_step(rows(batch, pmodel.data_parallel_rank, pmodel.data_parallel_size))
        norms.append(float(pmodel.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    gathered = [None] * dist.get_world_size()  # routing of this rank's tokens, in data-parallel order
    cp = layout.get("cp", 1)
    cp_rank = pmodel.dims.coordinate(dist.get_rank(), ("cp",)) if cp > 1 else 0
    dist.all_gather_object(gathered, (pmodel.data_parallel_rank, cp_rank,
                                      routing if layout.get("pp", 1) == 1 else None))
    shards = {}  # (data-parallel rank, context-parallel rank) -> records; TP/PP peers hold the same tokens
    for dp_rank, rank_in_cp, recs in gathered:
        shards.setdefault((dp_rank, rank_in_cp), recs)
    by_dp = {}
    for (dp_rank, _), recs in sorted(shards.items(), key=lambda item: item[0]):
        by_dp.setdefault(dp_rank, []).append(recs)
    by_dp = {k: _unsplit_sequence(v, BATCH // pmodel.data_parallel_size) for k, v in by_dp.items()}
    merged = None
    if all(r is not None for r in by_dp.values()):
        ordered = [by_dp[k] for k in sorted(by_dp)]
        merged = [torch.cat([recs[i] for recs in ordered]) for i in range(min(len(r) for r in ordered))]
    return {"losses": losses, "norms": norms, "weights": pmodel.full_state_dict(), "routing": merged}


def _unsplit_sequence(per_cp_rank: list, rows: int):
    """One data-parallel rank's routing records in token order, from its context-parallel ranks' records (each
    holds its head-tail shard of every row; one record per router call, (rows x shard tokens, k))."""
    if len(per_cp_rank) == 1 or any(r is None for r in per_cp_rank):
        return per_cp_rank[0]
    from ultrascale_plugins.dims.context.layout import layout_index

    cp, out = len(per_cp_rank), []
    for calls in zip(*per_cp_rank):
        parts = [c.reshape(rows, -1, c.shape[-1]) for c in calls]
        in_rank_order = torch.cat(parts, dim=1)
        index = layout_index(in_rank_order.shape[1], cp)
        ordered = torch.empty_like(in_rank_order)
        ordered[:, index] = in_rank_order
        out.append(ordered.reshape(-1, ordered.shape[-1]))
    return out


def routing_result(ref: list, got: list | None, real_tokens_only: bool = False) -> dict:
    """{} for a model without routers; else whether every token went to the same experts (None: not compared,
    e.g. under a pipeline, where routers run per micro-batch on other ranks). ``real_tokens_only``: padding
    tokens are left out (context parallel hides padding by causality, so a padding token attends to the padding
    before it, which transformers' key mask hides: its own hidden state, and so its experts, differ, while no
    real token, loss or gradient depends on it)."""
    if not ref:
        return {}
    if got is None:
        return {"routed_tokens": 0}
    masks = [b["attention_mask"].reshape(-1).bool() for b in batches()]
    per_step = max(1, len(ref) // len(masks))

    def keep(i, t):
        return t[masks[i // per_step]] if real_tokens_only and t.shape[0] == masks[0].numel() else t

    same = len(got) == len(ref) and all(a.shape == b.shape and torch.equal(keep(i, a), keep(i, b))
                                        for i, (a, b) in enumerate(zip(got, ref)))
    return {"routing_match": same, "routed_tokens": sum(int(keep(i, r).shape[0]) for i, r in enumerate(ref))}


def run_case(case: str) -> dict:
    from ultrascale_plugins import ConfigError

    model_type, layout_name = case.split(":")
    layout = dict(ALL[layout_name][1])
    overrides = layout.pop("model", {})
    peft = layout.pop("peft", None)
    clip = layout.pop("clip", CLIP)
    start = time.perf_counter()
    try:
        got = run_parallel(model_type, layout, overrides, peft, clip)
        status = {"state": "ran"}
    except Untinyable as exc:
        got, status = None, {"state": "untinyable", "reason": str(exc)}
    except ConfigError as exc:
        got, status = None, {"state": "refused", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - recorded per case
        got, status = None, {"state": "error", "reason": f"{type(exc).__name__}: {_first_line(exc)}",
                             "where": _where(exc)}
        # printed now: if the other ranks are stuck in a collective this case never reaches the agreement below
        print(f"[compat] error on rank {dist.get_rank()}: {status['reason']} ({status['where']})", file=sys.stderr,
              flush=True)
    statuses = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, status)  # every rank must agree the case ended, and how
    if dist.get_rank() != 0:
        return {}
    out = {"case": case, "model_type": model_type, "layout": layout_name, "seconds": 0.0}
    bad = [s for s in statuses if s["state"] != "ran"]
    if bad and bad[0]["state"] == "error" and reference(model_type, overrides, peft, clip)[3]:
        out.update(state="untinyable",
                   reason=f"the tiny model fails in one process: {reference(model_type, overrides, peft, clip)[3]}")
    elif bad:
        out.update(bad[0])
    else:
        ref_losses, ref_norms, ref_weights, ref_error = reference(model_type, overrides, peft, clip)
        if ref_error:
            out.update(state="untinyable", reason=f"the tiny model fails in one process: {ref_error}")
        else:
            weights = got["weights"]
            missing = sorted(set(ref_weights) ^ set(weights))
            common = [k for k in ref_weights if k in weights and ref_weights[k].is_floating_point()]
            out.update(
                state="ran",
                loss_diff=max(abs(a - b) for a, b in zip(got["losses"], ref_losses)),
                norm_rel_diff=max(abs(a - b) / max(b, 1e-12) for a, b in zip(got["norms"], ref_norms)),
                # absolute below 1, relative above (a few architectures keep parameters of magnitude ~10)
                weight_diff=max(((weights[k].float() - ref_weights[k].float()).abs().max()
                                 / ref_weights[k].float().abs().max().clamp_min(1.0)).item() for k in common),
                clipped=all(n > clip for n in ref_norms), missing_keys=missing[:5],
                **routing_result(_routing.get((model_type, json.dumps(overrides, sort_keys=True),
                                               json.dumps(peft, sort_keys=True), clip)) or [],
                                 got["routing"], real_tokens_only=layout.get("cp", 1) > 1),
                losses=got["losses"], ref_losses=ref_losses)
    out["seconds"] = round(time.perf_counter() - start, 2)
    return out


def main() -> None:
    import ultrascale_plugins as us

    out_path, cases = sys.argv[1], sys.argv[2:]
    us.init_distributed(timeout=float(os.environ.get("COMPAT_COLLECTIVE_TIMEOUT_S", "90")))
    for case in cases:
        if dist.get_rank() == 0:
            print(f"[compat] start {case}", file=sys.stderr, flush=True)
        result = run_case(case)
        if dist.get_rank() == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps(result) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
