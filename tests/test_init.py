"""A model built on the meta device from a config is initialized shard by shard with its own scheme: the same seed
gives the same weights in every layout, no rank allocates another stage's or another rank's weights, and the
front ends (the CLI worker, Lightning's ``empty_init``) take this path."""
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import torchrun
from models import make_config, make_model
import ultrascale_plugins as us

TESTS = Path(__file__).parent
SEED = 1234


def meta_model(arch: str):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(make_config(arch), attn_implementation="sdpa")


def init_in_process(arch: str, seed: int):
    """What the engine does in one process (``ctx.modules == [model]``), without a process group. The meta
    build's empty buffers are not handed over: the initializer computes them itself."""
    from ultrascale_plugins.core.initialize import ModelInit

    model = meta_model(arch)
    init = ModelInit(model, seed=seed, pm=us.get_plugin_manager())
    init.load(types.SimpleNamespace(modules=[model], device=torch.device("cpu")), {})
    return model


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """One launch of 1 process and one of 4: {layout: {"state", "eval_loss", "tied"}}."""
    out = tmp_path_factory.mktemp("init")
    results = {}
    for nproc in (1, 4):
        path = out / f"init{nproc}.pt"
        proc = torchrun(nproc, TESTS / "init_worker.py", str(path), str(SEED))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
        results.update(torch.load(path))
    return results


def test_same_seed_same_weights_in_every_layout(layouts):
    from init_worker import LAYOUTS_4

    ref = layouts["single"]
    assert ref["tied"] is True
    assert set(layouts) == {"single", *LAYOUTS_4}
    for name, got in layouts.items():
        assert set(got["state"]) == set(ref["state"]), name
        for key, value in ref["state"].items():
            assert torch.equal(got["state"][key], value), (name, key)
        assert abs(got["eval_loss"] - ref["eval_loss"]) < 1e-5, (name, got["eval_loss"], ref["eval_loss"])
        if got["tied"] is not None:  # one module tree holds both: still one parameter
            assert got["tied"], name


def test_the_layouts_follow_the_models_scheme(layouts):
    state = layouts["single"]["state"]
    std = make_config("llama8_tied").initializer_range
    for key, value in state.items():
        if key.endswith("proj.weight") or key.endswith("embed_tokens.weight"):
            assert abs(value.std().item() - std) < 0.1 * std, key
            assert abs(value.mean().item()) < 0.1 * std, key
        elif "norm" in key:
            assert torch.equal(value, torch.ones_like(value)), key
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])  # tied


def test_gpt2_scheme_biases_and_the_residual_rescaling():
    """The model's own _init_weights, including what a parent module does to its children (GPT-2's attention and
    MLP blocks rescale their c_proj by 1/sqrt(2 n_layer) after the Conv1D's own init)."""
    model = init_in_process("gpt2", seed=SEED)
    cfg = model.config
    std = cfg.initializer_range
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert torch.count_nonzero(p) == 0, name
        elif "ln_" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("c_proj.weight"):
            assert abs(p.std().item() - std / (2 * cfg.n_layer) ** 0.5) < 0.1 * std / 2, name
        else:
            assert abs(p.std().item() - std) < 0.1 * std, name
    assert model.lm_head.weight is model.transformer.wte.weight
    llama = init_in_process("llama", seed=SEED)
    assert torch.equal(llama.model.rotary_emb.inv_freq, make_model("llama").model.rotary_emb.inv_freq)


def test_seed_picks_the_weights_and_units_are_independent():
    from ultrascale_plugins.core.initialize import ModelInit

    a, b = init_in_process("llama", seed=1), init_in_process("llama", seed=1)
    c = init_in_process("llama", seed=2)
    for (name, x), y, z in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(x, y), name
        if x.std() > 0:
            assert not torch.equal(x, z), name
    # a unit's values depend on the seed and its name only, not on which units were drawn before
    init = ModelInit(meta_model("llama"), seed=1, pm=us.get_plugin_manager())
    late = init.unit_values("model.layers.1.mlp.down_proj")["weight"]
    init.unit_values("model.embed_tokens")
    assert torch.equal(init.unit_values("model.layers.1.mlp.down_proj")["weight"], late)
    assert torch.equal(late, a.model.layers[1].mlp.down_proj.weight)
    torch.manual_seed(77)
    assert ModelInit(meta_model("llama"), pm=us.get_plugin_manager()).seed == 77  # the seed defaults to torch.initial_seed()


def test_weights_for_picks_the_initializer_only_when_no_weights_exist(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from ultrascale_plugins.core.initialize import ModelInit
    from ultrascale_plugins.checkpoints.load import weights_for
    from ultrascale_plugins.checkpoints.pretrained import PretrainedWeights

    assert weights_for(make_model("llama"), None) is None  # a real model keeps its weights
    model = meta_model("llama")
    assert model.model.rotary_emb.inv_freq.is_meta
    assert isinstance(weights_for(model, None), ModelInit)
    assert not model.model.rotary_emb.inv_freq.is_meta  # computed by the model's own _init_weights
    assert torch.equal(model.model.rotary_emb.inv_freq, make_model("llama").model.rotary_emb.inv_freq)
    make_model("llama").save_pretrained(tmp_path / "m")
    with torch.device("meta"):
        from_dir = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "m"))
    assert isinstance(weights_for(from_dir, None), PretrainedWeights)  # the config's directory has weights


def test_meta_buffers_are_computed_without_accelerate_or_lightning():
    """The core needs neither: with both made unimportable (as if not installed), a config builds empty with its
    buffers computed and is initialized."""
    code = ("import sys, torch, types\n"
            "sys.modules['accelerate'] = sys.modules['lightning'] = sys.modules['pytorch_lightning'] = None\n"
            "sys.path.insert(0, 'tests')\n"
            "from models import make_config, make_model\n"
            "from ultrascale_plugins.checkpoints.load import weights_for\n"
            "from ultrascale_plugins.core.meta_build import computed_buffers, empty_model\n"
            "m = empty_model(make_config('llama_tied'))\n"
            "assert all(p.is_meta for p in m.parameters()) and m.lm_head.weight is m.model.embed_tokens.weight\n"
            "ref = dict(make_model('llama_tied').named_buffers())\n"
            "assert all(torch.equal(b, ref[n]) for n, b in computed_buffers(make_config('llama_tied')).items())\n"
            "m.config._name_or_path = ''\n"
            "weights_for(m, None).load(types.SimpleNamespace(modules=[m], device=torch.device('cpu')), {})\n"
            "assert not any(p.is_meta for p in m.parameters())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=TESTS.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_pipeline_stages_copy_no_other_stages_weights():
    from ultrascale_plugins.dims.pipeline.split import Absent, ZeroEmbedding, build_stage

    model = make_model("llama8_tied")
    storage = {p.data_ptr() for p in model.parameters()}
    first, last = build_stage(model, 0, 2, range(0, 4)), build_stage(model, 1, 2, range(4, 8))
    # every parameter of a stage is its own object over the unsplit model's storage, except the tied head on
    # the last stage, which is a separate copy of the embedding
    for stage in (first, last):
        for name, p in stage.named_parameters():
            assert p is not model.get_parameter(name), name
            assert (p.data_ptr() in storage) == (stage is first or name != "lm_head.weight"), name
            assert torch.equal(p, model.get_parameter(name)), name
    assert isinstance(first.model.layers[4], Absent) and isinstance(first.lm_head, Absent)
    assert isinstance(last.model.embed_tokens, ZeroEmbedding) and isinstance(last.model.layers[3], Absent)
    assert [n for n, _ in last.named_parameters()][0] == "model.layers.4.self_attn.q_proj.weight"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the model itself is untouched
    assert first.model.rotary_emb is not last.model.rotary_emb  # each stage is its own module tree
    meta = build_stage(meta_model("llama8_tied"), 1, 2, range(4, 8))
    assert all(p.is_meta for p in meta.parameters())


def test_lightning_empty_init_is_initialized_shard_by_shard(tmp_path):
    """``configure_model`` under ``trainer.init_module(empty_init=True)`` with a config naming no weights: the
    ZeRO-3 strategy initializes it with the model's scheme, as one process would from the same seed."""
    out = tmp_path / "lightning.pt"
    proc = torchrun(2, TESTS / "init_lightning_worker.py", str(out), str(SEED), "llama_tied")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    got = torch.load(out)
    ref = init_in_process("llama_tied", seed=SEED).state_dict()
    assert set(got["state"]) == set(ref)
    for key, value in ref.items():
        assert torch.equal(got["state"][key], value), key
    assert len(got["losses"]) == 2 and all(loss == loss for loss in got["losses"])

