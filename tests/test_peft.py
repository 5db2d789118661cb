"""PEFT (LoRA) models handed to ``parallelize``: every supported layout against the same PEFT model in one
process (tests/peft_worker.py: one 2-process launch), and the layouts not supported yet refused before any
process group."""
import json
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "peft_worker.py"
TOL = 1e-5  # fp32, as tests/test_parity.py


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from conftest import torchrun
    from peft_worker import CASES

    from peft_worker import FOUR

    out = tmp_path_factory.mktemp("peft") / "results.json"
    proc = torchrun(2, WORKER, str(out), *(c for c in CASES if c not in FOUR), "resume")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    out4 = out.parent / "four" / "results.json"
    out4.parent.mkdir()
    proc = torchrun(4, WORKER, str(out4), *FOUR)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return {**json.loads(out.read_text()), **json.loads(out4.read_text()), "dir": str(out.parent)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3_llama", "zero2_qwen2", "zero1_llama_head", "ddp_qwen3_moe",
                                  "zero3_qwen3_moe_ac", "cp2_ring_llama", "cp2_ulysses_qwen2", "zero3_dora_llama", "ddp_dora_llama",
                                  "zero3_embedding_rslora_llama",
                                  "zero3_bf16_base_llama", "zero3_bf16_mixed_trainable_llama", "zero3_chunked_bf16_base_llama",
                                  "zero3_task_causal_lm_llama", "cp2_ring_task_causal_lm_qwen2", "tp2_llama", "tp2_sp_qwen2_head", "tp2_sp_qwen3_moe", "tp2_sp_pretrained_llama",
                                  "zero3_tp2_sp_llama", "hsdp_qwen2", "cp2_tp2_sp_qwen2"])
def test_lora_matches_one_process(results, name):
    from peft_worker import CASES

    r = results[name]
    tol = CASES[name][2].get("tol", TOL)
    assert r["keys_equal"], "state-dict keys differ from the one-process PEFT model"
    assert r["clipped"], "clipping was not active at every step: the global norm was not compared"
    assert r["loss_diff"] <= tol, (r["losses"], r["ref_losses"])
    assert r["norm_rel_diff"] <= tol
    assert r["adapter_diff"] <= tol and r["adapters"] == r["trainable"] > 0
    assert r["base_unchanged"], "the frozen base changed"
    assert not r["frozen_with_state"], f"frozen parameters with gradients or optimizer state: {r['frozen_with_state']}"
    # gradient and optimizer bytes are the estimate's for the trainable parameters only, exactly, on every rank;
    # parameter bytes too, unless the base is bf16 (the estimate prices parameters by mixed_precision)
    for rank, (held, predicted) in enumerate(r["bytes_held"]):
        kinds = ("grads", "optimizer") if "base_dtype" in CASES[name][2] else ("params", "grads", "optimizer")
        assert {k: held[k] for k in kinds} == {k: predicted[k] for k in kinds}, (rank, held, predicted)
    if r["reloaded"] is not None:  # save_pretrained wrote PEFT's files: they reload the run's adapters exactly
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(r["reloaded"]["files"]), r["reloaded"]
        assert r["reloaded"]["max_diff"] == 0.0
    if "tol" in CASES[name][2]:  # the bf16 base really ran in bf16
        assert r["loss_diff"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2_llama", "zero3_tp2_sp_llama"])
def test_adapters_are_sharded_like_their_base_layers(results, name):
    """Column-wise q_proj: B sharded by its output rows, A whole; row-wise o_proj: A sharded by its input columns,
    B whole (over the TP mesh axis; ZeRO-3 shards over its own axis besides)."""
    tp = {k.split("self_attn.", 1)[1]: v.get("tp", "R") for k, v in results[name]["placements"].items()}
    assert tp == {"q_proj.lora_A.default.weight": "R", "q_proj.lora_B.default.weight": "S(0)",
                  "o_proj.lora_A.default.weight": "S(1)", "o_proj.lora_B.default.weight": "R",
                  **{k: tp[k] for k in tp if not k.startswith(("q_proj", "o_proj"))}}, tp
    assert tp["k_proj.lora_B.default.weight"] == tp["v_proj.lora_B.default.weight"] == "S(0)"


@pytest.mark.slow
def test_a_peft_models_checkpoint_resumes_bit_for_bit(results):
    """The frozen base has no optimizer state: the load must not expect any (it did: 'Missing key ... step')."""
    r = results["resume"]
    assert r["resumed"] == r["uninterrupted"][2:]


@pytest.mark.slow
def test_exporting_a_peft_models_checkpoint_is_refused(results, tmp_path):
    """Its names are the wrapper's (base_model.model....) plus adapters: transformers would load random weights."""
    from ultrascale_plugins.checkpoints.export import export_hf
    from ultrascale_plugins.checkpoints.errors import CheckpointError

    with pytest.raises(CheckpointError, match="not parameters of a llama model.*save_pretrained"):
        export_hf(Path(results["dir"]) / "ckpt" / "step-00000002", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch, extra, fields, words", [
    ("llama", {"use_dora": True}, {"tp": 2}, ["tp=2", "DoRA", "q_proj", "use_dora=False"]),
    ("qwen3_moe", {}, {"tp": 2}, ["tp=2", "target_parameters", "mlp.experts", "target_modules"]),
    ("llama", {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, {"tp": 2, "loss_parallel": True},
     ["loss_parallel=True", "lm_head", "loss_parallel: false"]),
    ("tied_llama", {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, {"tp": 2},
     ["tp=2", "lm_head", "tied", "embed_tokens", "modules_to_save"]),
])
def test_what_tensor_parallel_cannot_shard_is_refused_before_any_process_group(arch, extra, fields, words):
    import torch.distributed as dist

    import ultrascale_plugins as us
    from peft_worker import peft_model

    model = peft_model(arch, extra)
    with pytest.raises(us.ConfigError) as err:
        us.validate(us.ParallelConfig(dp_shard=1, **fields), model.config, 2, model=model)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert not dist.is_initialized()


def test_a_module_holding_trainable_parameters_of_two_dtypes_is_refused_under_fsdp():
    """FSDP2 needs one trainable dtype per group; a module that holds two directly cannot get a group of its own."""
    import torch
    import torch.distributed as dist

    import ultrascale_plugins as us
    from peft_worker import base_model

    model = base_model("qwen2")
    proj = model.model.layers[0].self_attn.q_proj
    proj.bias = torch.nn.Parameter(proj.bias.detach().to(torch.bfloat16))
    with pytest.raises(us.ConfigError, match="q_proj.*dtype.*one dtype per group"):
        us.validate(us.ParallelConfig(dp_shard=2), model.config, 2, model=model)
    us.validate(us.ParallelConfig(dp_shard=2, zero_stage=1), model.config, 2, model=model)  # DDP: no groups
    assert not dist.is_initialized()


def test_adapters_take_their_base_layers_plan_entries_and_regions_stay_the_blocks():
    """The plan hook (ultrascale_declare_plan_edit) moves q_proj's style onto its base layer and shards B like it; the
    sequence-parallel regions are still the attention and MLP blocks, not the LoRA wrappers."""
    import ultrascale_plugins as us
    from peft_worker import peft_model
    from ultrascale_plugins.core.engine import model_plan

    plan = model_plan(peft_model("llama", {}), us.ParallelConfig(tp=2, dp_shard=1))
    attn = "base_model.model.model.layers.0.self_attn"
    assert {k: v for k, v in plan.tp_plan.items() if k.startswith(attn)} == {
        f"{attn}.{p}.{part}": style for p, style in (("q_proj", "colwise"), ("k_proj", "colwise"),
                                                     ("v_proj", "colwise"), ("o_proj", "rowwise"))
        for part in ("base_layer", "lora_B.default" if style == "colwise" else "lora_A.default")}
    assert plan.regions[:2] == ["base_model.model.model.layers.0.mlp", attn]


def test_the_plan_is_found_through_the_wrapper():
    """ZeRO-3 gives each decoder layer its own group only if the layers are found inside the PEFT wrapper."""
    import ultrascale_plugins as us
    from peft_worker import peft_model
    from ultrascale_plugins.core.engine import model_plan

    model = peft_model("llama", {})
    plan = model_plan(model, us.ParallelConfig())
    assert plan.layers == ["base_model.model.model.layers.0", "base_model.model.model.layers.1"]
    assert plan.lm_head == "base_model.model.lm_head" and plan.root == "base_model.model"
    assert plan.causal_lm(model) is model.get_base_model()


def test_adapters_on_experts_are_refused_under_expert_parallelism():
    """LoRA on the fused expert weights (PEFT's target_parameters, which its all-linear adds on MoE models) would
    not be split with the experts: refused before any process group; adapters kept off the experts are fine."""
    import torch.distributed as dist

    import ultrascale_plugins as us
    from peft_worker import peft_model

    model = peft_model("qwen3_moe", {})
    with pytest.raises(us.ConfigError) as err:
        us.validate(us.ParallelConfig(dp_shard=2, ep=2), model.config, 2, model=model)
    assert all(w in str(err.value) for w in ("ep=2", "mlp.experts", "adapters", "ep: 1")), str(err.value)
    kept_off = peft_model("qwen3_moe", {"target_modules": ["q_proj", "v_proj"]})
    assert us.validate(us.ParallelConfig(dp_shard=2, ep=2), kept_off.config, 2, model=kept_off).ep == 2
    assert not dist.is_initialized()
