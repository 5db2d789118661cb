"""PEFT models built on the meta device (``get_peft_model(base_on_meta, LoraConfig(...))``), as ``ultrascale train``
builds them: parallelized under ZeRO-3 on 2 ranks from a ``save_pretrained`` directory (or initialized from the
seed) they equal the same PEFT model built in one process from the loaded base with the engine's adapter draws
(tests/peft_meta_worker.py: one 2-process launch); the names, PEFT's initialization scheme and the seed, and what
is refused, in one process."""
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import torchrun
from models import make_config, make_model
import ultrascale_plugins as us

WORKER = Path(__file__).parent / "peft_meta_worker.py"
TOL = 1e-5  # fp32, as tests/test_peft.py


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from peft_worker import base_model

    out = tmp_path_factory.mktemp("peft_meta")
    make_model("llama", seed=0).save_pretrained(out / "tiny", safe_serialization=True)
    base_model("qwen3_moe").save_pretrained(out / "tiny_moe", safe_serialization=True)  # experts one by one
    proc = torchrun(2, WORKER, str(out / "results.json"), str(out / "tiny"), str(out / "tiny_moe"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pretrained_lora_head", "pretrained_dora_rslora", "scratch_embedding",
                                  "pretrained_moe_all_linear"])
def test_meta_built_peft_model_equals_the_one_process_model(results, name):
    r = results[name]
    assert r["keys_equal"], "state-dict keys differ from the one-process PEFT model"
    assert r["start_diff"] == 0.0, f"the initial state differs: {r['start_unequal']}"  # bit for bit, every entry
    assert r["b_zero"] and r["a_nonzero"], "LoRA B (and the embedding's A) start at zero, A (embedding's B) drawn"
    assert r["clipped"], "clipping was not active at every step: the global norm was not compared"
    assert r["loss_diff"] <= TOL, (r["losses"], r["ref_losses"])
    assert r["norm_rel_diff"] <= TOL
    assert r["final_diff"] <= TOL and r["trained"] > 0
    if name.startswith("pretrained"):  # the base, and both copies of a modules_to_save head, hold the file's values
        assert r["from_file"]["q_proj"] and r["from_file"]["head_copies"] and all(r["from_file"]["head_copies"])
        assert len(r["from_file"]["head_copies"]) == (2 if "head" in name else 1)
    if "moe" in name:  # the fused experts assembled from the per-expert tensors of the files
        assert r["from_file"]["experts"] and all(r["from_file"]["experts"])
    assert bool(r["magnitudes"]) == ("dora" in name)  # DoRA's magnitude: from the loaded base weight


def meta_peft(arch="llama", **fields):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(make_config(arch), attn_implementation="sdpa")
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, **fields))


def test_peft_names_map_to_the_plain_models_pretrained_names():
    from ultrascale_plugins.checkpoints.read_plan import plain_entries

    model = meta_peft(target_modules=["q_proj", "embed_tokens"], modules_to_save=["lm_head"], use_dora=True)
    plain, introduced, inner = plain_entries(list(model.state_dict()), us.get_plugin_manager().wrapper_of(model))
    assert inner is model.get_base_model()
    expect = {"base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight":
              "model.layers.0.self_attn.q_proj.weight",
              "base_model.model.model.layers.0.self_attn.k_proj.weight": "model.layers.0.self_attn.k_proj.weight",
              "base_model.model.model.embed_tokens.base_layer.weight": "model.embed_tokens.weight",
              "base_model.model.lm_head.original_module.weight": "lm_head.weight",
              "base_model.model.lm_head.modules_to_save.default.weight": "lm_head.weight",
              "base_model.model.model.norm.weight": "model.norm.weight"}
    assert {k: plain[k] for k in expect} == expect
    assert set(plain.values()) == set(make_model("llama").state_dict())  # every plain entry, nothing else
    layer = "base_model.model.model.layers.1.self_attn.q_proj."
    assert {layer + "lora_A.default.weight", layer + "lora_B.default.weight",
            layer + "lora_magnitude_vector.default.weight",
            "base_model.model.model.embed_tokens.lora_embedding_A.default"} <= set(introduced)
    assert all("lora_" in k for k in introduced) and len(introduced) == 2 * 3 + 3  # A, B, DoRA magnitude per layer
    # a plain model maps to itself, introduces nothing
    plain, introduced, _ = plain_entries(["model.norm.weight"],
                                         us.get_plugin_manager().wrapper_of(make_model("llama")))
    assert plain == {"model.norm.weight": "model.norm.weight"} and introduced == []


def test_adapters_get_peft_scheme_seeded_by_their_names():
    """Kaiming-uniform A within 1/sqrt(fan_in), zero B; on the embedding zero A, normal B; rsLoRA is config. The
    seed picks the values; a base entry gets the plain model's value for the same seed."""
    import types

    from ultrascale_plugins.core.initialize import ModelInit

    def initialized(seed, **fields):
        model = meta_peft(**fields)
        ModelInit(model, seed=seed, pm=us.get_plugin_manager()).load(types.SimpleNamespace(modules=[model], device=torch.device("cpu")), {})
        return model.state_dict()

    fields = {"target_modules": ["q_proj", "down_proj", "embed_tokens"], "use_rslora": True}
    one, same, other = initialized(1, **fields), initialized(1, **fields), initialized(2, **fields)
    layer = "base_model.model.model.layers.0."
    a, b = one[layer + "mlp.down_proj.lora_A.default.weight"], one[layer + "mlp.down_proj.lora_B.default.weight"]
    fan_in = a.shape[1]  # 128: down_proj's input
    assert 0.9 / math.sqrt(fan_in) < a.abs().max() <= 1 / math.sqrt(fan_in) and b.abs().max() == 0
    emb_a, emb_b = (one[f"base_model.model.model.embed_tokens.lora_embedding_{x}.default"] for x in "AB")
    assert emb_a.abs().max() == 0 and 0.8 < emb_b.std() < 1.2
    assert all(torch.equal(one[k], same[k]) for k in one)
    assert not torch.equal(a, other[layer + "mlp.down_proj.lora_A.default.weight"])
    assert not torch.equal(a, one["base_model.model.model.layers.1.mlp.down_proj.lora_A.default.weight"])
    plain = make_model("llama")
    ModelInit(plain, seed=1, pm=us.get_plugin_manager()).fill([plain])
    assert torch.equal(one[layer + "mlp.down_proj.base_layer.weight"], plain.model.layers[0].mlp.down_proj.weight)


def test_a_peft_model_on_the_meta_device_validates_without_a_process_group():
    import torch.distributed as dist

    import ultrascale_plugins as us

    model = meta_peft(target_modules="all-linear", use_dora=True)
    assert us.validate(us.ParallelConfig(dp_shard=-1), model.config, 2, model=model).dp_shard == 2
    assert not dist.is_initialized()


@pytest.mark.parametrize("fields, words", [
    ({"init_lora_weights": "pissa"}, ["init_lora_weights='pissa'", "meta device", "from_pretrained"]),
    ({"init_lora_weights": "olora"}, ["init_lora_weights='olora'", "base weights"]),
])
def test_initializations_that_read_the_base_are_refused_on_the_meta_device(fields, words):
    import torch.distributed as dist

    import ultrascale_plugins as us

    with torch.device("meta"):  # PEFT itself would run the decomposition on the meta base and fail
        model = meta_peft(target_modules=["q_proj"], **fields)
    with pytest.raises(us.ConfigError) as err:
        us.validate(us.ParallelConfig(), model.config, 1, model=model)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert not dist.is_initialized()


# ---- the recipe's peft section (ultrascale train): checked before launch, no process group ---------------------
SMALL = ["nproc=2", "pp=1", "tp=1", "dp_shard=2"]  # the embedded default recipe's tiny Llama on 2 processes


@pytest.mark.parametrize("sets, words", [
    (["peft.method=ia3"], ["peft.method='ia3'", "only lora", "Fix: method: lora"]),
    (["peft.r=0"], ["peft.r=0", "positive integer", "Fix: e.g. r: 16"]),
    (["peft.alpha=-2"], ["peft.alpha=-2", "positive", "Fix"]),
    (["peft.dropout=1.5"], ["peft.dropout=1.5", "below 1", "Fix"]),
    (["peft.target_modules=[]"], ["peft.target_modules=[]", "module names", "Fix"]),
    (["peft.modules_to_save=lm_head"], ["peft.modules_to_save='lm_head'", "list of module names", "Fix"]),
    (["peft.use_dora=maybe"], ["peft.use_dora='maybe'", "true or false", "Fix"]),
    (["peft.rank=8"], ["unknown key 'peft.rank'"]),
    (["peft=lora"], ["peft is a str ('lora')", "mapping of fields", "Fix: write it as a mapping"]),
])
def test_bad_peft_values_are_refused_naming_field_value_and_fix(sets, words):
    from ultrascale_plugins.data.recipe import load_recipe

    import ultrascale_plugins as us

    with pytest.raises(us.ConfigError) as err:
        load_recipe(None, [*SMALL, *sets])
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("sets, words", [
    (["peft.target_modules=[qq_proj,v_proj]"], ["peft.target_modules=['qq_proj', 'v_proj']", "'qq_proj' names no "
                                                "module of this llama model", "did you mean 'q_proj'?", "Fix"]),
    (["peft.target_modules=.*nothing.*"], ["peft.target_modules='.*nothing.*'", "regular expression", "Fix"]),
    (["peft.modules_to_save=[lm_heads]"], ["'lm_heads' names no module", "did you mean 'lm_head'?"]),
])
def test_peft_names_matching_nothing_are_refused_on_the_meta_model_before_launch(sets, words, monkeypatch):
    import torch.distributed as dist

    import ultrascale_plugins as us
    from ultrascale_plugins.cli.main import check_recipe
    from ultrascale_plugins.data.recipe import load_recipe

    monkeypatch.setenv("ULTRASCALE_SKIP_MEMORY_CHECK", "1")
    recipe = load_recipe(None, [*SMALL, *sets])  # the values are well formed: the model decides
    with pytest.raises(us.ConfigError) as err:
        check_recipe(recipe)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert not dist.is_initialized()


def test_a_peft_section_checks_and_costs_the_peft_model(tmp_path, monkeypatch):
    """Absent or null: no PEFT. Set from the command line: the PEFT model passes the pre-launch checks, its memory
    estimate counts gradients and optimizer states for the adapters only, and the section survives to_dict."""
    import yaml

    from ultrascale_plugins.cli.main import check_recipe
    from ultrascale_plugins.data.recipe import load_recipe

    assert load_recipe(None, SMALL).section("peft") is None and "peft" not in load_recipe(None, SMALL).to_dict()
    assert load_recipe(None, [*SMALL, "peft=null"]).section("peft") is None
    recipe = load_recipe(None, [*SMALL, "peft.method=lora", "peft.r=16", "peft.alpha=16", "peft.dropout=0.1",
                                "peft.target_modules=[q_proj,v_proj]", "peft.use_rslora=true",
                                "peft.modules_to_save=[lm_head]"])
    spec = recipe.section("peft")
    assert (spec.r, spec.alpha, spec.dropout, spec.target_modules, spec.use_rslora, spec.modules_to_save) == \
        (16, 16, 0.1, ["q_proj", "v_proj"], True, ["lm_head"])
    config = spec.lora_config()
    assert (config.r, config.lora_alpha, config.lora_dropout, set(config.target_modules)) == (16, 16, 0.1,
                                                                                             {"q_proj", "v_proj"})
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(recipe.to_dict()))
    assert load_recipe(again).section("peft") == spec
    monkeypatch.setenv("ULTRASCALE_SKIP_MEMORY_CHECK", "1")
    assert check_recipe(recipe)  # the fingerprint of the checks that passed on the PEFT model
    seen = {}

    def check_memory(resolved, model_config, model, *args, **kwargs):
        seen["model"] = model

    monkeypatch.setattr("ultrascale_plugins.cli.main.check_memory", check_memory)
    check_recipe(recipe)
    from ultrascale_plugins.features.peft.adapters import is_peft_model

    assert is_peft_model(seen["model"]) and all(p.is_meta for p in seen["model"].parameters())


def test_a_peft_section_without_peft_installed_says_how_to_install_it(monkeypatch):
    import importlib.util

    import ultrascale_plugins as us
    from ultrascale_plugins.data.recipe import load_recipe

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    with pytest.raises(us.ConfigError, match=r'needs the peft package.*pip install "peft>='):
        load_recipe(None, [*SMALL, "peft.r=8"])
    assert load_recipe(None, SMALL).section("peft") is None  # no section, no peft needed


def test_resuming_with_other_adapters_is_refused_before_launch(tmp_path):
    """The checkpoint's ultrascale.json keeps the recipe (extra.recipe) with its peft section."""
    import ultrascale_plugins as us
    from ultrascale_plugins.data.recipe import load_recipe

    saved = load_recipe(None, [*SMALL, "peft.r=8", "peft.target_modules=[q_proj]"])
    step = tmp_path / "ckpt" / "step-00000010"
    step.mkdir(parents=True)
    model_config = json.loads(saved.model_config().to_json_string(use_diff=False))
    meta = {"format": 1, "step": 10, "world_size": 1, "files": {}, "model_config": model_config,
            "extra": {"recipe": saved.to_dict(), "init_from": ""}}
    (step / "ultrascale.json").write_text(json.dumps(meta))
    assert load_recipe(None, [*SMALL, "peft.r=8", "peft.target_modules=[q_proj]", "peft.alpha=8"],
                       resume_from=str(step)).section("peft").alpha == 8  # the scaling may change, not the parameters
    for sets, words in ((["peft.r=4", "peft.target_modules=[q_proj]"], ["peft.r=4 (checkpoint: 8)"]),
                        (["peft.r=8"], ["peft.target_modules='all-linear' (checkpoint: ['q_proj'])"]),
                        ([], ["trained with adapters", "the recipe has none", "--set peft.r=8"])):
        with pytest.raises(us.ConfigError) as err:
            load_recipe(None, [*SMALL, *sets], resume_from=str(tmp_path / "ckpt"))
        assert all(w in str(err.value) for w in words), str(err.value)


def test_resuming_a_peft_run_reads_its_base_from_the_recorded_directory(tmp_path):
    """Adapter-only checkpoints hold no base: without --init-from, the worker reads it again from the run's
    --init-from, which the checkpoint records (extra.init_from); a directory that is not there is refused before
    launch, naming the fix."""
    import ultrascale_plugins as us
    from ultrascale_plugins.data.recipe import load_recipe, recorded_init_from

    saved = load_recipe(None, [*SMALL, "peft.r=8"])
    step = tmp_path / "ckpt" / "step-00000010"
    step.mkdir(parents=True)
    model_config = json.loads(saved.model_config().to_json_string(use_diff=False))
    for base, refused in ((tmp_path / "moved", True), (tmp_path / "base", False)):
        meta = {"format": 1, "step": 10, "world_size": 1, "files": {}, "model_config": model_config,
                "extra": {"recipe": saved.to_dict(), "init_from": str(base)}}
        (step / "ultrascale.json").write_text(json.dumps(meta))
        if not refused:
            make_model("llama").config.save_pretrained(base)
        assert recorded_init_from(str(tmp_path / "ckpt")) == str(base)
        if refused:
            with pytest.raises(us.ConfigError, match=f"'{base}'.*--init-from DIR"):
                load_recipe(None, [*SMALL, "peft.r=8"], resume_from=str(step))
            assert load_recipe(None, [*SMALL, "peft.r=8"], resume_from=str(step), init_from=str(tmp_path))
        else:
            assert load_recipe(None, [*SMALL, "peft.r=8"], resume_from=str(step)).section("peft").r == 8
