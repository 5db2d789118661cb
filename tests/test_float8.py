"""float8 training through torchao (``float8: tensorwise | rowwise``).

Refusals come from ``validate`` before any process group. On CPU torch runs float8 matmuls (``torch._scaled_mm``),
so one 2-process gloo launch (this file is also the worker: ``python -m torch.distributed.run ... test_float8.py
OUT.json``) trains a tiny Llama a few steps with float8 and with bf16 alone in six layouts and compares the
losses at a tolerance that means something at 8 bits.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ultrascale_plugins as us  # noqa: E402
from ultrascale_plugins.features.float8 import plugin as f8  # noqa: E402

# the `test` extra installs torchao; without it only the refusal of a missing torchao can run
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")

# AdamW over the same two batches in turn: the tiny model memorizes them, so the loss falls well within the steps
# (random tokens give nothing else to learn) and float8's error has the steps to accumulate
STEPS, LR = 6, 3e-3
# Every case runs float8 against the same layout with float8: none (bf16 compute), same seed, same batches.
# The tiny Llama's projections are 64x64, 64x32 (k/v: 2 KV heads x 16) and 64x128: all multiples of 16, so every
# decoder-layer Linear converts.
CASES = {
    # ZeRO-3 over 2 ranks, the model built on the meta device (materialized by name after the conversion)
    "zero3_meta": {"layout": {"dp_shard": 2, "zero_stage": 3}, "recipe": "tensorwise", "meta": True},
    # 2 pipeline stages (one layer each) with full recomputation
    "pp2_ac_full": {"layout": {"pp": 2, "activation_checkpointing": "full"}, "recipe": "tensorwise"},
    # DDP (bf16 through autocast, not FSDP's cast) with selective recomputation, and the rowwise recipe
    "ddp_ac_selective": {"layout": {"dp_shard": 2, "zero_stage": 0, "activation_checkpointing": "selective"},
                         "recipe": "rowwise"},
    "zero1": {"layout": {"dp_shard": 2, "zero_stage": 1}, "recipe": "tensorwise"},
    "zero2": {"layout": {"dp_shard": 2, "zero_stage": 2}, "recipe": "rowwise"},
    "cp2_ring": {"layout": {"cp": 2}, "recipe": "tensorwise"},
}
# Measured on this CPU build (torch 2.13, torchao 0.18 and 0.13 alike; deterministic, the same in every run), the
# largest |float8 loss - bf16 loss| over the 6 steps: 0.0087 zero3_meta, 0.0154 pp2_ac_full, 0.0086 ddp_ac_selective
# (rowwise), 0.0154 zero1, 0.0056 zero2 (rowwise), 0.0077 cp2_ring, on losses falling from 5.57 to 4.7; bf16 alone
# vs fp32 differs by 0.002-0.003 in the same runs. float8 (e4m3) keeps 3 mantissa bits against bf16's 7, so a few
# times bf16's own error is what a correct run shows. The tolerance is about 3x the largest measured and well below
# what a broken conversion moves: the loss falls 0.8 within these steps, so wrong scales or a step that does not
# train miss it by far.
LOSS_TOL = 0.05


# ---- refusals, before any process group -------------------------------------------------------------------
def _refused(config: dict, world: int = 1, model_config=None, model=None) -> str:
    import torch.distributed as dist

    with pytest.raises(us.ConfigError) as err:
        us.validate(us.ParallelConfig(**config), model_config, world, model=model)
    assert not dist.is_initialized()
    message = str(err.value)
    assert "\n" not in message and message.startswith("float8=") and "Fix:" in message, message
    return message


def test_without_torchao_float8_is_refused_with_the_extra_to_install(monkeypatch):
    # an entry of None in sys.modules makes `import torchao...` raise ImportError, as when it is not installed
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    message = _refused({"float8": "tensorwise"})
    # the extra's own requirement, which installs wherever the package came from (a clone has no index entry)
    assert "torchao is not installed" in message and 'pip install "torchao>=' in message, message
    us.validate(us.ParallelConfig(), None, 1)  # float8: none needs no torchao


@needs_torchao
def test_float8_with_tensor_parallel_is_refused():
    message = _refused({"float8": "tensorwise", "tp": 2}, world=2)
    assert "tp=2" in message and "use tp: 1" in message


@needs_torchao
def test_a_gpu_without_float8_matmul_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("ULTRASCALE_DEVICE", "")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    message = _refused({"float8": "rowwise"})
    assert "compute capability 8.0" in message and "8.9" in message
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # an H100 passes
    us.validate(us.ParallelConfig(float8="rowwise"), None, 1)
    # a CPU run on a machine with a GPU (ULTRASCALE_DEVICE=cpu) is judged by the CPU's float8 matmul instead
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setenv("ULTRASCALE_DEVICE", "cpu")
    us.validate(us.ParallelConfig(float8="rowwise"), None, 1)


@needs_torchao
def test_a_cpu_torch_without_float8_matmul_is_refused(monkeypatch):
    def no_float8(*args, **kwargs):
        raise RuntimeError('"_scaled_mm" not implemented for \'Float8_e4m3fn\'')

    monkeypatch.setattr(torch, "_scaled_mm", no_float8)
    f8._cpu_float8_problem.cache_clear()  # the probe's answer is cached per process
    try:
        message = _refused({"float8": "tensorwise"})
        assert "runs no tensorwise float8 matmul on the CPU" in message and "not implemented" in message
    finally:
        monkeypatch.undo()
        f8._cpu_float8_problem.cache_clear()  # the real answer again for the other tests
    assert f8._cpu_float8_problem("tensorwise") is None and f8._cpu_float8_problem("rowwise") is None


@needs_torchao
def test_a_model_with_no_convertible_linear_is_refused():
    from test_init import meta_model

    from models import make_config

    # GPT-2's projections are Conv1D modules, not nn.Linear: float8 would change nothing
    message = _refused({"float8": "tensorwise"}, model_config=make_config("gpt2"), model=meta_model("gpt2"))
    assert "no nn.Linear" in message
    us.validate(us.ParallelConfig(float8="tensorwise"), make_config("llama"), 1, model=meta_model("llama"))


def test_only_linears_with_dimensions_divisible_by_16_convert():
    assert f8.convertible(torch.nn.Linear(64, 32))
    assert not f8.convertible(torch.nn.Linear(64, 24))  # out_features: the input gradient's inner dimension
    assert not f8.convertible(torch.nn.Linear(40, 64))  # in_features: the forward's inner dimension
    assert not f8.convertible(torch.nn.Conv1d(64, 64, 1))


# ---- float8 vs bf16 in a 2-process launch --------------------------------------------------------------------
@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    from conftest import torchrun

    out = tmp_path_factory.mktemp("float8") / "results.json"
    proc = torchrun(2, __file__, str(out), timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@needs_torchao
@pytest.mark.parametrize("case", list(CASES))
def test_float8_trains_like_bf16(launch, case):
    r = launch[case]
    # the conversion really happened, on every rank, and only inside the decoder layers
    for rank in r["ranks"]:
        assert rank["float8_linears"] > 0 and rank["high_precision_linears_in_layers"] == 0, rank
        assert rank["float8_outside_layers"] == [], rank
        assert not rank["float8_in_reference"] and rank["same_state_keys"], rank
    assert sum(rank["holds_head"] for rank in r["ranks"]) >= 1
    # 2 layers x 7 projections, split over the stages of a pipeline
    assert sum(rank["float8_linears"] for rank in r["ranks"]) == (14 if "pp" in r["layout"] else 28)
    diffs = [abs(a - b) for a, b in zip(r["float8"], r["bf16"])]
    assert max(diffs) < LOSS_TOL, (r["float8"], r["bf16"])
    assert max(diffs) > 0, "float8 gave bf16's losses exactly: its matmuls did not run"
    assert r["float8"][-1] < r["float8"][0] - 0.1, r["float8"]  # it trains


# ---- the worker -------------------------------------------------------------------------------------------
def _model(meta: bool):
    from models import make_config, make_model

    if not meta:
        return make_model("llama"), None
    from transformers import AutoModelForCausalLM

    from ultrascale_plugins.core.initialize import ModelInit

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config("llama"), attn_implementation="sdpa")
    return model, ModelInit(model, seed=0, pm=us.get_plugin_manager())


def _train(spec: dict, recipe: str, batches) -> tuple[list[float], dict]:
    from torchao.float8.float8_linear import Float8Linear

    from models import rows

    model, init = _model(spec.get("meta", False))
    layout = {**spec["layout"], "mixed_precision": "bf16", "float8": recipe}
    pmodel = us.parallelize(model, us.ParallelConfig(**layout), init_weights=init)
    opt = pmodel.build_optimizer(torch.optim.AdamW, lr=LR)
    losses = []
    for batch in batches:
        losses.append(pmodel.train_step(rows(batch, pmodel.data_parallel_rank, pmodel.data_parallel_size)).item())
        opt.step()
        opt.zero_grad()
    layers = pmodel.ctx.plan.layers  # by name: FSDP changes the layers' classes

    def in_layer(name: str) -> bool:
        return any(name.startswith(fqn + ".") for fqn in layers)

    found = {"float8_linears": 0, "high_precision_linears_in_layers": 0, "float8_outside_layers": [],
             "holds_head": False}
    for part in pmodel.modules:
        for name, m in part.named_modules():
            if isinstance(m, Float8Linear) and in_layer(name):
                found["float8_linears"] += 1
            elif isinstance(m, Float8Linear):
                found["float8_outside_layers"].append(name)
            elif isinstance(m, torch.nn.Linear):
                found["high_precision_linears_in_layers"] += in_layer(name)
                found["holds_head"] |= name.endswith("lm_head")
    found["state_keys"] = sorted(pmodel.state_dict())  # what a checkpoint holds
    return losses, found


def worker(out: str) -> None:
    import torch.distributed as dist

    from models import padded_batches

    batches = padded_batches(2) * (STEPS // 2)
    results = {}
    for name, spec in CASES.items():
        bf16, reference = _train(spec, "none", batches)
        float8, found = _train(spec, spec["recipe"], batches)
        found["float8_in_reference"] = reference["float8_linears"] > 0  # float8: none must convert nothing
        found["same_state_keys"] = found.pop("state_keys") == reference["state_keys"]  # checkpoints interchange
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, found)
        results[name] = {"layout": spec["layout"], "recipe": spec["recipe"], "float8": float8, "bf16": bf16,
                         "ranks": ranks}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))
        for name, r in results.items():
            print(name, "max |float8 - bf16| loss:", max(abs(a - b) for a, b in zip(r["float8"], r["bf16"])))


if __name__ == "__main__":
    worker(sys.argv[1])
