"""The planner searches the layout fields plugins declare (``ultrascale_cost_search``), with expert parallelism
as the built-in case: its degrees are tried for every candidate, its all-to-all is priced on the links an ep group
spans, and ``ultrascale plan`` offers EP layouts for Qwen3-30B-A3B and DeepSeek-V3."""
import json
import re
import textwrap

import pytest

import ultrascale_plugins as us
from models import make_config
from ultrascale_plugins import hookimpl
from ultrascale_plugins.cli.main import main as cli
from ultrascale_plugins.interface.search_offer import SearchOffer
from ultrascale_plugins.planner.cost import CostModel, Layout, Workload, layout_from_string
from ultrascale_plugins.planner.hardware import PRESETS
from ultrascale_plugins.planner.model_spec import ModelSpec, load_model_config
from ultrascale_plugins.planner.search import search


@pytest.fixture(autouse=True)
def _fresh_announcements(monkeypatch):
    from ultrascale_plugins.planner import auto

    monkeypatch.delenv("ULTRASCALE_AUTO_LAYOUT", raising=False)
    monkeypatch.setattr(auto, "_ANNOUNCED", set())


class AcmeKernel:
    """A third-party field the planner knows nothing of: 'slow' costs a terabyte on its own link."""

    @hookimpl
    def ultrascale_declare_fields(self, fields):
        fields.add("acme_gemm", str, "slow", "test plugin: a kernel choice", choices=("slow", "fast"))

    @hookimpl
    def ultrascale_cost_search(self, config, model_config, world_size):
        return SearchOffer(choices={"acme_gemm": ["slow", "fast"]})

    @hookimpl
    def ultrascale_cost_estimate(self, config, model_config, shape, estimate):
        if config.acme_gemm == "slow":
            estimate.add_comm("acme", 1e12, "p2p")


@pytest.fixture
def acme():
    us.register(AcmeKernel(), name="acme_kernel")
    try:
        yield
    finally:
        us.unregister(name="acme_kernel")


def _cost(model, world_batch=8, seq=64):
    mc = load_model_config(model) if isinstance(model, str) else model
    return CostModel(ModelSpec.of(mc), PRESETS["h100-sxm-80gb"], Workload(seq, world_batch))


def test_the_search_tries_the_values_a_plugin_offers_and_auto_keeps_them(acme):
    cost = _cost(make_config("llama"))
    results = search(cost, 2)
    values = {r.layout.extra.get("acme_gemm", "slow") for r in results}
    assert values == {"slow", "fast"} and cost.searched == {"acme_gemm"}  # everything fits: no memory saver
    best = results[0].layout
    assert best.extra == {"acme_gemm": "fast"} and best.fields()["acme_gemm"] == "fast"
    assert "acme_gemm=fast" in best.label() and results[0].to_json()["acme_gemm"] == "fast"
    # a plugin field at its default is no field at all: the same layout as one that never had it
    assert Layout(dp_shard=2, acme_gemm="slow") == Layout(dp_shard=2)
    # layout: auto takes the planner's value over the user's, as it does for every field the planner picks
    chosen = us.validate(us.ParallelConfig(layout="auto", acme_gemm="slow", auto_seq_len=64, auto_global_batch=8),
                         make_config("llama"), 2)
    assert chosen.acme_gemm == "fast" and chosen.layout == "manual"
    from ultrascale_plugins.planner import render

    assert "acme_gemm='fast'" in render.lightning_call(results[0], 2, 2)
    assert render.parallel_fields(results[0])["acme_gemm"] == "fast"


class AcmeWidth:
    """A third party's field only its own registry has: acme_x=1 costs a terabyte on its own link, 2 nothing."""

    @hookimpl
    def ultrascale_declare_fields(self, fields):
        fields.add("acme_x", int, 1, "test plugin: a width", minimum=1)

    @hookimpl
    def ultrascale_cost_search(self, config, model_config, world_size):
        return SearchOffer(choices={"acme_x": [1, 2]})

    @hookimpl
    def ultrascale_cost_estimate(self, config, model_config, shape, estimate):
        if config.acme_x == 1:
            estimate.add_comm("acme", 1e12, "p2p")


def test_a_cost_model_searches_the_fields_of_the_registry_it_was_handed():
    registry = us.make_registry()
    registry.register(AcmeWidth(), name="acme_width")
    cost = CostModel(ModelSpec.of(make_config("llama")), PRESETS["h100-sxm-80gb"], Workload(64, 8), pm=registry)
    results = search(cost, 2)
    assert {r.layout.acme_x for r in results} == {1, 2} and cost.searched == {"acme_x"}
    best = results[0].layout
    assert best.extra == {"acme_x": 2} and best.registry is registry and best.config().acme_x == 2
    assert best.config().registry is registry and best.replace(tp=1).registry is registry
    assert best.without("acme_x").acme_x == 1 and results[0].to_json()["acme_x"] == 2
    # a layout made by hand under that registry, or from a layout string, is priced too: acme_x=1 pays its link
    slow = cost.evaluate(Layout(dp_shard=2, micro_batch_size=4, registry=registry))
    fast = cost.evaluate(layout_from_string("dp=2,mbs=4,acme_x=2", 2, registry))
    assert slow.times_s["comm_acme"] > 0 and "comm_acme" not in fast.times_s and fast.step_s < slow.step_s
    # the registry is no part of a layout's identity
    assert Layout(dp_shard=2, registry=registry) == Layout(dp_shard=2)
    assert hash(Layout(tp=2, registry=registry)) == hash(Layout(tp=2))
    # the process's registry has no acme_x: refused, naming the field
    with pytest.raises(us.ConfigError, match="no plugin declares a layout field 'acme_x'"):
        Layout(acme_x=1)
    with pytest.raises(us.ConfigError, match="a plugin's layout field"):
        layout_from_string("dp=2,acme_x=2", 2)


@pytest.mark.parametrize("answer, message", [
    ({"acme_nope": [1]}, "no plugin declares a layout field 'acme_nope'"),
    ({"tp": [1, 2]}, "a field the planner's search sets itself"),
    ({"ep": 4}, "not a non-empty list"),
    ({"ep": [0]}, "must be at least 1"),
])
def test_a_wrong_offer_names_the_field_the_value_and_the_fix(answer, message):
    class Wrong:
        @hookimpl
        def ultrascale_cost_search(self, config, model_config, world_size):
            return SearchOffer(choices=answer)

    us.register(Wrong(), name="wrong_offer")
    try:
        with pytest.raises(us.ConfigError, match=re.escape(message)) as info:
            search(_cost(make_config("llama")), 2)
        assert "Fix" in str(info.value) and next(iter(answer)) in str(info.value)
    finally:
        us.unregister(name="wrong_offer")


def test_an_answer_that_is_no_search_offer_names_the_fix():
    class Bare:
        @hookimpl
        def ultrascale_cost_search(self, config, model_config, world_size):
            return {"ep": [1, 2]}

    us.register(Bare(), name="bare_offer")
    try:
        with pytest.raises(us.ConfigError, match="not a SearchOffer. Fix: return SearchOffer"):
            search(_cost(make_config("llama")), 2)
    finally:
        us.unregister(name="bare_offer")


def test_expert_parallel_offers_its_degrees_under_zero_2_and_3_only():
    cost = _cost(make_config("qwen3_moe"))  # 8 experts
    def ep(lay, cost=cost):  # the ep degrees offered (beside the chunked loss's two values)
        return sorted({c.get("ep", 1) for c in cost.plugin_choices(lay, 4)})

    assert ep(Layout(dp_shard=4, zero_stage=3, mixed_precision="bf16")) == [1, 2, 4]
    assert ep(Layout(dp_shard=2, tp=2, zero_stage=2, sequence_parallel=True, mixed_precision="bf16")) == [1, 2, 4]
    assert ep(Layout(dp_shard=4, zero_stage=1, mixed_precision="bf16")) == [1]  # experts need FSDP2 groups
    assert "ep" not in cost.plugin_choices(Layout(dp_shard=4, zero_stage=1, mixed_precision="bf16"), 4)[0]
    llama = _cost(make_config("llama"))
    assert all("ep" not in c for c in llama.plugin_choices(Layout(dp_shard=4, zero_stage=3, mixed_precision="bf16"),
                                                           4))  # no experts


def test_layout_strings_take_plugin_fields():
    lay = layout_from_string("dp=16,zero=3,ep=8,mbs=1,ga=16", 16)
    assert lay.extra == {"ep": 8} and lay.config().ep == 8 and "ep=8" in lay.label()
    with pytest.raises(us.ConfigError, match="ep='x' must be int. Fix"):
        layout_from_string("dp=8,ep=x")
    with pytest.raises(us.ConfigError, match="ep.*at least 1"):
        layout_from_string("dp=8,ep=0")
    with pytest.raises(us.ConfigError, match="a plugin's layout field .*ep"):
        layout_from_string("dp=8,epp=2")


def test_a_view_axis_spans_the_innermost_ranks_of_its_source():
    """ep re-splits dp_shard x cp x tp innermost first: ep=8 stays in a node of 8, efsdp crosses nodes; ep=16
    spans two nodes."""
    cost = _cost("qwen3-30b-a3b", 32)
    nodes = cost.axis_nodes(Layout(dp_shard=32, zero_stage=3, ep=8, mixed_precision="bf16"))
    assert nodes["ep"] == (8, 1) and nodes["efsdp"] == (4, 4) and nodes["dp_shard"] == (32, 4)
    nodes = cost.axis_nodes(Layout(dp_shard=16, tp=2, zero_stage=3, ep=16, sequence_parallel=True,
                                   mixed_precision="bf16"))
    assert nodes["ep"] == (16, 2) and nodes["efsdp"] == (2, 2)
    nodes = cost.axis_nodes(Layout(dp_shard=4, tp=2, zero_stage=3, ep=2, sequence_parallel=True,
                                   mixed_precision="bf16"))
    assert nodes["ep"] == (2, 1) and nodes["tp"] == (2, 1)


def _plan(capsys, *args):
    code = cli(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _rows(out: str) -> list[str]:
    return [line.split()[1] for line in out.splitlines() if line[:5].strip().isdigit()]


# (64 GPUs: top 4, since dp x tp x pp at ZeRO-1 runs and ranks beside its ZeRO-2/3 twins, #3)
# Qwen3-30B-A3B on 64 GPUs and DeepSeek-V3 on 256 (the search over its 671B parameters takes 40 s on 2 cores):
# benchmarks/sweep_tests.py
@pytest.mark.parametrize("model, gpus, top", [("qwen3-30b-a3b", 8, 3),
                                              pytest.param("qwen3-30b-a3b", 64, 4, marks=pytest.mark.sweep),
                                              pytest.param("deepseek-v3", 256, 1, marks=pytest.mark.sweep)])
def test_the_plan_offers_expert_parallel_layouts_for_real_mixtures_of_experts(capsys, model, gpus, top):
    """Sequence 4096, 256 sequences per step, AdamW, H100 80 GB: an EP layout is among the ``top`` best that fit
    (on 8 GPUs for Qwen3-30B-A3B the third, behind TP and data parallel with 8 and 16 rows per micro-batch, which
    the chunked loss makes room for; the best on 256 for DeepSeek-V3, which needs ~10.7 TB of fp32 weights,
    gradients and AdamW states: 64 H100 do not hold it), and that layout, printed, passes the pre-launch checks."""
    code, out, _ = _plan(capsys, "--model", model, "--gpus", str(gpus), "--gpu", "h100-sxm-80gb", "--top", "10")
    assert code == 0, out
    rows = _rows(out)
    with_ep = [row for row in rows[:top] if any(int(m) > 1 for m in re.findall(r"\bep=(\d+)", row))]
    assert with_ep, out
    if gpus > 8:
        return
    if "ep=" not in out.split("Chosen: ", 1)[1].splitlines()[0]:  # the EP layout itself, printed
        code, out, _ = _plan(capsys, "--model", model, "--gpus", str(gpus), "--gpu", "h100-sxm-80gb",
                             "--layout", with_ep[0])
        assert code == 0, out
    assert "ep=" in out.split("Chosen: ", 1)[1].splitlines()[0]
    recipe = textwrap.dedent(out.split("Recipe (ultrascale train FILE):\n", 1)[1])
    import yaml

    parallel = yaml.safe_load(recipe.split("\n", 2)[2])["parallel"]
    assert parallel["ep"] > 1
    import torch
    from transformers import AutoModelForCausalLM

    mc = load_model_config(model)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(mc)
    resolved = us.validate(us.ParallelConfig(**parallel), mc, gpus, model=meta)  # EP's checks on the model too
    assert resolved.ep == parallel["ep"] and "ep=" in out.split("Lightning:\n", 1)[1].split("\n\n", 1)[0]


def test_json_candidates_carry_the_plugin_fields(capsys):
    code, out, _ = _plan(capsys, "--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu", "h100-sxm-80gb", "--json",
                         "--layout", "dp=8,zero=3,ep=4,mbs=1,ga=32,recompute=full")
    assert code == 0
    (only,) = json.loads(out)["candidates"]
    assert only["ep"] == 4 and only["comm_gb_per_step"]["ep"] > 0 and only["runnable"]


def test_a_plan_of_exact_names_expands_as_the_wildcards_did():
    """An edited plan names every expert module exactly (DeepSeek-V3: tens of thousands of entries); expanding it
    looks the exact names up instead of matching each against every entry (the planner spent most of a 256-GPU
    DeepSeek-V3 plan there), with the same answer: the last entry that names a module, exactly or by a wildcard."""
    import fnmatch

    from ultrascale_plugins.models.plan import _expand

    def naive(plan, names):
        return {n: s for n in names for p, s in plan.items() if n == p or fnmatch.fnmatchcase(n, p)}

    names = [f"model.layers.{i}.{part}" for i in range(12) for part in
             ("self_attn.q_proj", "self_attn.o_proj", "mlp.experts", "mlp.gate", "mlp.shared.up_proj")]
    plan = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.3.self_attn.q_proj": "rowwise",
            "model.layers.1?.mlp.*": "local", "model.layers.10.mlp.gate": "replicated",
            "model.layers.[0-4].mlp.experts": "experts", "model.layers.2.mlp.experts": None,
            "*.o_proj": "rowwise", "model.layers.5.self_attn.o_proj": "colwise"}
    assert _expand(plan, names) == naive(plan, names)
    assert _expand(plan, names)["model.layers.3.self_attn.q_proj"] == "rowwise"  # exact, after the wildcard
    assert _expand(plan, names)["model.layers.10.mlp.gate"] == "replicated"
    assert _expand(plan, names)["model.layers.2.mlp.experts"] is None


def test_memory_savers_are_searched_only_when_nothing_fits():
    """The chunked loss saves memory at the price of one more head matmul, offload at the host link's, bf16 states
    at a price in precision: the planner tries the first two (a second pass, ``ultrascale_cost_search``'s savers) only
    when no layout fits without them, the third only when none fits with the first two either."""
    import dataclasses

    mc = make_config("llama")
    mc.vocab_size = 200_000  # the logits dominate: 512 tokens x 200k x fp32
    roomy = CostModel(ModelSpec.of(mc), PRESETS["h100-sxm-80gb"], Workload(512, 1))
    results = search(roomy, 1)
    assert results[0].fits and "chunked_loss" not in roomy.searched
    assert not any("chunked_loss" in r.layout.extra for r in results)
    need = min(r.memory_gb["total"] for r in results if r.runnable)
    chunked = roomy.evaluate(results[0].layout.replace(chunked_loss=1024))
    assert chunked.memory_gb["total"] < need - 0.1
    tight = dataclasses.replace(PRESETS["h100-sxm-80gb"], memory_gb=(need + chunked.memory_gb["total"]) / 2)
    cost = CostModel(ModelSpec.of(mc), tight, Workload(512, 1))
    best = search(cost, 1)[0]
    assert best.fits and best.layout.extra and set(best.layout.extra) <= cost.savers
    assert cost.savers == {"chunked_loss", "cpu_offload"}  # lossless ones fit: bf16 states never tried
    # the device too small for the fp32 states, the host for offloaded ones (about 0.4 GB): bf16 states
    small = dataclasses.replace(tight, memory_gb=chunked.memory_gb["total"] - 0.1, host_memory_gb=0.1)
    cost = CostModel(ModelSpec.of(mc), small, Workload(512, 1))
    best = search(cost, 1)[0]
    assert best.fits and best.layout.extra.get("param_dtype") == "bf16" and "param_dtype" in cost.savers
