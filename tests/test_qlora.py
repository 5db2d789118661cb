"""A quantized frozen base (QLoRA: ``quantize_base(peft_model, "nf4")``, torchao's NF4Tensor) under the package's
layouts: every layout against the same quantized PEFT model in one process (tests/qlora_worker.py: one 2-process
launch), what ``quantize_base`` does to the model, and what is refused before any process group."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchao")
pytest.importorskip("peft")

WORKER = Path(__file__).parent / "qlora_worker.py"
TOL = 1e-5  # fp32 base dequantized to fp32 (as tests/test_peft.py)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from conftest import retry_native_crash, torchrun
    from qlora_worker import CASES

    outs = []

    def launch():  # a fresh directory each time: the worker saves a checkpoint beside its results
        outs.append(tmp_path_factory.mktemp("qlora") / "results.json")
        return torchrun(2, WORKER, str(outs[-1]), *CASES, "resume", "meta_build")

    proc = retry_native_crash(launch, "test_qlora")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return json.loads(outs[-1].read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3_llama", "zero2_qwen2", "zero1_llama", "ddp_llama", "zero3_ac_qwen2",
                                  "cp2_ring_llama", "zero3_bf16_llama", "ddp_bf16_llama"])
def test_qlora_matches_one_process(results, name):
    from qlora_worker import CASES

    r = results[name]
    tol = CASES[name][2].get("tol", TOL)
    assert r["keys_equal"], "state-dict keys differ from the quantized PEFT model's"
    assert r["clipped"], "clipping was not active at every step: the global norm was not compared"
    # DDP without the NF4 weights on its ignore list re-quantizes rank 0's broadcast base: loss_diff 1.1e-4 at step 1
    assert r["loss_diff"] <= tol, (r["losses"], r["ref_losses"])
    assert r["norm_rel_diff"] <= tol
    assert r["adapter_diff"] <= tol and r["adapters"] == r["trainable"] > 0
    assert not r["frozen_with_state"], f"frozen parameters with gradients or optimizer state: {r['frozen_with_state']}"
    dtype = "torch.bfloat16" if CASES[name][2].get("base_dtype") == "bf16" else "torch.float32"
    for rank, (held, still_nf4, count, base_unchanged) in enumerate(r["per_rank"]):
        assert still_nf4 and count == 14, f"rank {rank}: the base is no longer NF4 on every linear layer ({count})"
        assert base_unchanged, f"rank {rank}: the gathered NF4 base is not the one it started from"
        assert held["dtypes"] == [dtype], held
        # each rank holds only its shard of the packed 4-bit data (two weights a byte), and with the block scales
        # about a quarter of the same weights in bf16 (0.5 + 1/64 bytes a weight, + 4 bytes per 64 x 256 block)
        assert held["packed_data_bytes"] * 2 * held["shards"] == held["numel"], held
        assert held["nf4_bytes"] < 0.27 * held["bf16_bytes"], held
    if r["reloaded"] is not None:  # save_pretrained wrote PEFT's files: they reload the run's adapters exactly
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(r["reloaded"]["files"]), r["reloaded"]
        assert r["reloaded"]["max_diff"] == 0.0


@pytest.mark.slow
def test_a_base_quantized_on_the_meta_device_is_each_weights_whole_quantization(results):
    """The command line's QLoRA build (peft.quantize_base in a recipe): the base quantized on the meta device, each
    weight read (or drawn) whole, quantized whole, and only this rank's part kept. The gathered NF4 base is, bit for
    bit, what loading the same bf16 files whole and quantizing them in one process gives (the scales' mean is the
    whole weight's, not a shard's), and so is the first loss; from the seed, the quantization of the same layout's
    unquantized weights."""
    r = results["meta_build"]
    assert "error" not in r, r.get("error")
    assert r["nf4"] == 14 and r["equal"], r
    assert abs(r["first_loss"] - r["ref_first_loss"]) <= 1e-3, r
    assert r["seeded_nf4"] == 14 and r["seeded_equal"], r


@pytest.mark.slow
def test_a_quantized_models_checkpoint_resumes_bit_for_bit_and_only_on_its_base(results):
    """The checkpoint holds the adapters; the NF4 base comes from the model built to resume, checked against the
    checkpoint's fingerprint of the base (features/peft/checkpoints), which must read NF4 shards."""
    r = results["resume"]
    assert "error" not in r, r.get("error")
    assert r["resumed"] == r["uninterrupted"][2:]
    # the base differed only in the first layer's q_proj, an NF4 weight: its fingerprint must see it
    assert r["other_base"] is not None and "another frozen base: 'base_model.model.model.layers.0.self_attn.q_proj" \
        ".base_layer.weight' holds other values" in r["other_base"], r["other_base"]


def _model(arch="llama", **lora):
    import warnings

    from peft import LoraConfig, get_peft_model

    from qlora_worker import base_model

    warnings.filterwarnings("ignore")
    return get_peft_model(base_model(arch), LoraConfig(r=4, lora_dropout=0.0, **{"target_modules": "all-linear",
                                                                                  **lora}))


def test_quantize_base_keeps_names_and_computes_with_the_nf4_weights():
    import torch

    from ultrascale_plugins.features.peft.quantized_base import quantize_base, quantized_weights

    model = _model()
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        unquantized = model(input_ids=batch).logits
    assert quantize_base(model, "nf4") is model
    weights = quantized_weights(model)
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    assert len(weights) == 14 and all(n.endswith(".base_layer.weight") and not w.requires_grad
                                      for n, w in weights.items())
    assert all(isinstance(w, torch.nn.Parameter) for w in weights.values())
    assert sorted(model._ddp_params_and_buffers_to_ignore) == sorted(weights)  # DDP must not re-quantize them
    assert quantize_base(model, "nf4") is model and quantized_weights(model) == weights  # idempotent
    with torch.no_grad():
        quantized = model(input_ids=batch).logits
        for name, w in weights.items():  # the same model with the dequantized weights as plain tensors
            module = model.get_submodule(name.rsplit(".", 1)[0])
            module.weight = torch.nn.Parameter(w.get_original_weight(), requires_grad=False)
        dequantized = model(input_ids=batch).logits
    assert (quantized - dequantized).abs().max() <= 1e-5
    assert (quantized - unquantized).abs().max() > 1e-3  # it really ran on 4-bit weights


@pytest.mark.parametrize("fields, world, words", [
    ({"tp": 2, "dp_shard": 1}, 2, ["tp=2", "quantized (NF4) base", "tp: 1"]),
    ({"pp": 2, "dp_shard": 1}, 2, ["pp=2", "quantized (NF4) base", "pp: 1"]),
    ({"float8": "tensorwise", "dp_shard": 2}, 2, ["float8='tensorwise'", "NF4", "float8: none"]),
    # k_proj (128 x 256) holds 2 scale blocks of 64 x 256 values: 4 shards would split one
    ({"dp_shard": 4}, 4, ["dp_shard=4", "k_proj", "2 NF4 scale blocks", "whole blocks"]),
])
def test_layouts_a_quantized_base_cannot_run_are_refused_before_any_process_group(fields, world, words):
    import torch.distributed as dist

    import ultrascale_plugins as us
    from ultrascale_plugins.features.peft.quantized_base import quantize_base

    model = quantize_base(_model(), "nf4")
    with pytest.raises(us.ConfigError) as err:
        us.validate(us.ParallelConfig(**fields), model.config, world, model=model)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert not dist.is_initialized()


def test_four_ranks_without_sharding_the_base_are_accepted():
    """DDP (ZeRO-1 / plain) keeps the whole NF4 base on each rank: no block can be split."""
    import ultrascale_plugins as us
    from ultrascale_plugins.features.peft.quantized_base import quantize_base

    model = quantize_base(_model(), "nf4")
    for stage in (0, 1):
        us.validate(us.ParallelConfig(dp_shard=4, zero_stage=stage), model.config, 4, model=model)


def test_what_quantize_base_refuses():
    import ultrascale_plugins as us
    from peft_worker import peft_model  # hidden 64: q_proj is 64 x 64, less than one 64 x 256 block
    from qlora_worker import base_model
    from ultrascale_plugins.features.peft.quantized_base import quantize_base, quantized_weights

    with pytest.raises(TypeError, match="expects a PEFT model.*LlamaForCausalLM"):
        quantize_base(base_model("llama"), "nf4")
    with pytest.raises(us.ConfigError, match=r"scheme='int4' is not available.*\['nf4'\]"):
        quantize_base(_model(), "int4")
    with pytest.raises(us.ConfigError, match="DoRA.*use_dora=False"):
        quantize_base(_model(use_dora=True), "nf4")
    with pytest.raises(us.ConfigError, match=r"layers.0.self_attn.q_proj.base_layer.weight \(64, 64\) \(4096 "
                                             r"values\).*block_size x scaler_block_size = 64 x 256.*smaller block"):
        quantize_base(peft_model("llama", {}), "nf4")
    small = quantize_base(peft_model("llama", {}), "nf4", block_size=32, scaler_block_size=8)  # they fit
    assert len(quantized_weights(small)) == 14


def test_without_torchao_quantize_base_says_what_to_install(monkeypatch):
    import ultrascale_plugins as us
    from ultrascale_plugins.features.peft import quantized_base

    model = _model()
    for name in quantized_base._NF4_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(us.ConfigError, match="needs torchao's NF4Tensor.*pip install \"torchao>="):
        quantized_base.quantize_base(model, "nf4")


def test_the_planner_prices_the_4bit_base_as_the_model_holds_it(capsys):
    """``ultrascale plan --peft qlora``: every adapted base weight at NF4's bytes (4 bits, an int8 scale per 64
    values, an fp32 factor per 256 scales), the rest as held; the same bytes as a quantized PEFT model's weights
    hold. Only data-parallel layouts run it; 70B QLoRA fits 2 x 24 GB with its states offloaded."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    import ultrascale_plugins as us
    from ultrascale_plugins.cli.main import main as cli
    from ultrascale_plugins.core.inventory import adapted_inventory, inventory
    from ultrascale_plugins.features.peft.quantized_base import quantize_base, quantized_weights
    from ultrascale_plugins.interface.estimates import QUANTIZED_BYTES, Adapters

    model = _model()
    quantize_base(model, "nf4")
    weights = quantized_weights(model).values()
    held = sum(t.numel() * t.element_size() for w in weights
               for t in (w.quantized_data, w.quantized_scalers, w.quantization_factor))
    numel = sum(w.numel() for w in weights)
    assert abs(held / numel - QUANTIZED_BYTES["nf4"]) < 0.01 * QUANTIZED_BYTES["nf4"], held / numel
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(model.get_base_model().config)
    pm = us.get_plugin_manager()
    records = adapted_inventory(inventory(plain, pm=pm), plain, Adapters(r=4, quantized="nf4"), pm)  # as the estimate prices
    priced = sum(r.numel * r.held_bytes for r in records if 0 < r.held_bytes < 1)
    assert abs(priced - held) < 0.01 * held, (priced, held)
    base = ["plan", "--model", "llama-3.1-70b", "--gpus", "2", "--gpu", "rtx4090-24gb", "--peft", "qlora",
            "--global-batch-size", "16", "--json", "--top", "60"]
    code = cli(base)
    plan = json.loads(capsys.readouterr().out)
    best = plan["candidates"][0]
    assert code == 0 and plan["fits"] and plan["peft"]["quantized"] == "nf4" and best["bytes_per_param"] < 1
    assert all(c["tp"] == c["pp"] == 1 for c in plan["candidates"] if c["runnable"])
    code = cli([*base, "--layout", "dp=1,tp=2,pp=1,cp=1,zero=3,mbs=1,ga=16,recompute=full"])
    (tp,) = json.loads(capsys.readouterr().out)["candidates"]
    assert not tp["runnable"] and "NF4 base (QLoRA)" in tp["not_runnable_because"]
