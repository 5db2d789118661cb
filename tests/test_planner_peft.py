"""``ultrascale plan --peft lora``: the planner prices LoRA on a model preset (no PEFT model, no peft import) with
the same parameter records a real PEFT model gives ``us.estimate`` at run time (tests/test_peft.py checks those
against the bytes the ranks really hold): trainable factors, a frozen base, weight-gradient FLOPs only for what
trains. Each check here compares with peft itself (models built on the meta device) or with a hand count."""
import json

import pytest
import torch

import ultrascale_plugins as us
from models import make_config
from ultrascale_plugins.cli.main import main as cli
from ultrascale_plugins.core.inventory import inventory
from ultrascale_plugins.interface.estimates import Adapters, meta_model
from ultrascale_plugins.planner.cost import CostModel, Layout, Workload
from ultrascale_plugins.planner.hardware import PRESETS
from ultrascale_plugins.planner.model_spec import ModelSpec, load_model_config

pytest.importorskip("peft")


def tiny(arch: str):
    from transformers import AutoConfig

    moe = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, tie_word_embeddings=False)
    if arch == "qwen3_moe":  # as tests/peft_worker.py builds it
        return AutoConfig.for_model("qwen3_moe", **moe, intermediate_size=96, moe_intermediate_size=32,
                                    num_experts=4, num_experts_per_tok=2, head_dim=16)
    if arch == "qwen2_moe":  # a shared expert beside the routed ones
        return AutoConfig.for_model("qwen2_moe", **moe, intermediate_size=96, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2)
    if arch == "mixtral":
        return AutoConfig.for_model("mixtral", **moe, intermediate_size=32, num_local_experts=4,
                                    num_experts_per_tok=2)
    return make_config(arch)


def real_peft(mc, r: int, target):
    """The PEFT model peft itself builds, on the meta device, on a bf16 base (as the recipes hold it: the planner's
    ``Adapters.base_bytes``); peft keeps the adapters fp32."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(mc, dtype=torch.bfloat16)
        return get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                               target_modules=target if isinstance(target, str) else list(target)))


def record_key(r):
    return (r.part, r.layer, r.shape, r.trainable, r.adapter, r.rank, r.merged, r.active, r.lookup)


LAYOUTS = [  # (layout, profile): ZeRO-3 (FSDP2's dim-0 shards), ZeRO-2 with HSDP, ZeRO-1's partition, DDP
    (Layout(dp_shard=2, zero_stage=3, activation_checkpointing="full", mixed_precision="bf16"), "ultrascale"),
    (Layout(dp_replicate=2, dp_shard=2, zero_stage=2, mixed_precision="bf16"), "ultrascale"),
    (Layout(dp_shard=4, zero_stage=1, activation_checkpointing="selective", mixed_precision="bf16"), "ultrascale"),
    (Layout(dp_shard=2, zero_stage=1, mixed_precision="bf16"), "nanotron"),
    (Layout(dp_shard=2, zero_stage=0, mixed_precision="bf16"), "ultrascale"),
]


@pytest.mark.parametrize("arch, target", [
    ("llama", "all-linear"), ("qwen3_moe", "all-linear"), ("qwen2_moe", "all-linear"), ("mixtral", "all-linear"),
    ("gpt2", "all-linear"), ("qwen2", ("q_proj", "v_proj")), ("llama", ("embed_tokens", "q_proj", "down_proj")),
    ("qwen3_moe", ("q_proj", "k_proj", "v_proj", "o_proj")),
])
def test_the_planners_lora_is_the_real_peft_models(arch, target):
    """Parameter, gradient and optimizer bytes (and every other figure) of the planner's LoRA on the plain model
    equal ``us.estimate`` of the PEFT model peft builds, exactly, in every data-parallel layout; the trainable
    count is the real model's (for a mixture of experts too: peft's 'all-linear' adapts the fused experts)."""
    r, adapters = 4, Adapters(r=4, target=target)
    mc = tiny(arch)
    real = real_peft(mc, r, target)
    trainable = [p for p in real.parameters() if p.requires_grad]
    spec = ModelSpec.of(mc)
    assert spec.trainable_params(adapters) == sum(p.numel() for p in trainable) > 0
    assert sorted(map(record_key, inventory(meta_model(mc), None, adapters, pm=us.get_plugin_manager()))) == \
        sorted(map(record_key, inventory(real, pm=us.get_plugin_manager())))
    for lay, profile in LAYOUTS:
        cost = CostModel(spec, PRESETS["h100-sxm-80gb"], Workload(64, lay.dp, profile, "adamw", "bf16", adapters))
        planned = cost.estimates(lay)
        assert len(planned) == 1
        run_time = us.estimate(lay.config(), real.config, world_size=lay.world, seq_len=64, model=real,
                               profile=profile, optimizer="adamw", check=False, micro_batch=1,
                               micro_batches=lay.grad_accum, dp_overlap=cost.c["dp_overlap"],
                               gather_overlap=cost.c["gather_overlap"])
        assert planned[0].memory == run_time.memory, (lay.label(), planned[0].memory, run_time.memory)
        assert planned[0].comm == run_time.comm and planned[0].factors == run_time.factors
    # the closed form of one whole replica (DDP, the bf16 frozen base, fp32 adapters and their gradients, AdamW's two
    # states and step counter per trained tensor)
    ddp = CostModel(spec, PRESETS["h100-sxm-80gb"], Workload(64, 2, "ultrascale", "adamw", "bf16", adapters))
    (est,) = ddp.estimates(Layout(dp_shard=2, zero_stage=0, mixed_precision="bf16"))
    n_train = sum(p.numel() for p in trainable)
    assert est.memory["params"] == 2 * sum(p.numel() for p in real.parameters() if not p.requires_grad) + 4 * n_train
    assert est.memory["grads"] == 4 * n_train
    assert est.memory["optimizer"] == 8 * n_train + 4 * len(trainable)


def test_lora_flops_count_weight_gradients_only_for_the_adapters():
    """Llama-3.1-8B, LoRA r=16 on all-linear, by hand: r·(in + out) per linear layer; a frozen weight costs 4 FLOPs
    per token (forward, its input's gradient), an adapter's 6, attention 12·L·a·d·s as for full fine-tuning."""
    mc = load_model_config("llama-3.1-8b")
    spec = ModelSpec.of(mc)
    h, f, L, r, s = mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers, 16, 4096
    d = h // mc.num_attention_heads
    q, kv = mc.num_attention_heads * d, mc.num_key_value_heads * d
    lora = L * r * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h))
    adapters = Adapters(r=r)
    assert spec.trainable_params(adapters) == lora == 41_943_040
    matmul = spec.total_params - spec.embedding_params  # the untied embedding is a lookup
    attention = 12 * L * q * s
    assert spec.flops_per_token(s) == 6 * matmul + attention
    assert spec.flops_per_token(s, adapters) == pytest.approx(4 * matmul + 6 * lora + attention, rel=1e-12)
    # recomputing the forward costs a larger share of LoRA's cheaper step; exactly 4/3 training everything
    cost = CostModel(spec, PRESETS["h100-sxm-80gb"], Workload(s, 8, adapters=adapters))
    full = CostModel(spec, PRESETS["h100-sxm-80gb"], Workload(s, 8))
    lay = Layout(dp_shard=8, zero_stage=3, activation_checkpointing="full", mixed_precision="bf16")
    assert full.estimates(lay)[0].factors["recompute_flops"] == 4 / 3
    forward = 2 * matmul + 2 * lora + attention / 3
    assert cost.estimates(lay)[0].factors["recompute_flops"] == pytest.approx(
        1 + forward / (4 * matmul + 6 * lora + attention), rel=1e-9)
    # MFU: tokens/s x the FLOPs the method needs per token / peak (docs/planner.md)
    result = cost.evaluate(lay)
    assert result.mfu == pytest.approx(result.tokens_per_s_per_gpu * spec.flops_per_token(s, adapters)
                                       / (cost.hw.tflops * 1e12), rel=1e-12)
    assert result.tokens_per_s_per_gpu > full.evaluate(lay).tokens_per_s_per_gpu  # no weight gradients of the base


def test_lora_fits_a_70b_model_on_one_node_where_full_fine_tuning_needs_offload(capsys):
    """The example of docs/planner.md: Llama-3.1-70B on 8 x 80 GB, sequence 4096, global batch 256. Full fine-tuning
    fits only with its states in host memory (16 bytes per parameter, 176 GB of host memory per GPU): no layout
    fits without a memory saver."""
    base = ["plan", "--model", "llama-3.1-70b", "--gpus", "8", "--gpu", "h100-sxm-80gb", "--json", "--top", "3"]
    code = cli(base)
    full = json.loads(capsys.readouterr().out)
    chosen = full["candidates"][0]
    assert code == 0 and full["fits"] and chosen["cpu_offload"] is True and chosen["memory_gb"]["total"] <= 80
    assert 16 * 70 / 8 < chosen["memory_gb"]["host"] <= 256 and chosen["bytes_per_param"] == 16
    code = cli([*base, "--peft", "lora", "--lora-r", "16"])
    lora = json.loads(capsys.readouterr().out)
    best = lora["candidates"][0]
    assert code == 0 and lora["fits"] and best["fits"] and best["memory_gb"]["total"] <= 80
    assert "cpu_offload" not in best and best["tokens_per_s_per_gpu"] > 2 * chosen["tokens_per_s_per_gpu"]
    assert lora["peft"] == {"method": "lora", "r": 16, "target": "all-linear"}
    assert lora["trainable_params"] == 80 * 16 * (2 * 8192 + 2 * (8192 + 1024) + 2 * 8192 + 3 * (8192 + 28672))
    # the bf16 base (70B x 2 bytes) held across the node, gradients and Adam's states for the adapters only
    assert best["memory_gb"]["params"] > 70 * 2 / (best["dp_shard"] * best["dp_replicate"] * best["tp"] * best["pp"])
    assert best["memory_gb"]["grads"] + best["memory_gb"]["optimizer"] < 1
    # a layout without tensor or pipeline parallel fits too (the PEFT plugin's oldest layouts)
    code = cli([*base, "--peft", "lora", "--layout", "dp=8,tp=1,pp=1,cp=1,zero=3,mbs=1,ga=32,recompute=full"])
    (plain,) = json.loads(capsys.readouterr().out)["candidates"]
    assert code == 0 and plain["fits"] and plain["runnable"]


def test_under_tensor_parallel_each_adapter_follows_its_base_layer():
    """B (out, r) is cut on its output features after a column-parallel base, A (r, in) on its input features before
    a row-parallel one (o_proj, down_proj); the other factor stays whole on every TP rank."""
    mc = make_config("llama")
    h, f, r, t = mc.hidden_size, mc.intermediate_size, 4, 2
    d = h // mc.num_attention_heads
    q, kv = mc.num_attention_heads * d, mc.num_key_value_heads * d
    column = [(h, q), (h, kv), (h, kv), (h, f), (h, f)]  # (in, out): q, k, v, gate, up
    row = [(q, h), (f, h)]  # o, down
    per_layer = sum(r * n_in + n_out * r // t for n_in, n_out in column) + \
        sum(r * n_in // t + n_out * r for n_in, n_out in row)
    est = us.estimate(us.ParallelConfig(tp=t, dp_shard=1), mc, world_size=t, coords={"tp": 0}, model=meta_model(mc),
                      adapters=Adapters(r=r), check=False)
    assert est.memory["grads"] == 4 * mc.num_hidden_layers * per_layer


def test_lora_activations_match_what_autograd_saves_on_this_machine():
    """As tests/test_estimates.py for full fine-tuning: a small Llama with LoRA on all-linear, fp32, no
    recomputation; frozen norms and a frozen head keep less, the adapters' r-wide outputs a little more."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    mc = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(mc, attn_implementation="sdpa"),
                           LoraConfig(r=8, target_modules="all-linear"))
    ids = torch.randint(0, 256, (2, 512))
    measured = _saved_bytes(model, lambda: model(input_ids=ids, labels=ids, use_cache=False))
    predicted = us.estimate(us.ParallelConfig(dp_shard=1), mc, world_size=1, seq_len=512, micro_batch=2,
                            model=meta_model(mc), adapters=Adapters(r=8)).memory["activations"]
    full = us.estimate(us.ParallelConfig(dp_shard=1), mc, world_size=1, seq_len=512,
                       micro_batch=2).memory["activations"]
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)
    assert predicted < full


def test_peft_keeps_each_mixture_of_experts_layers_merged_weights():
    """PEFT's 'all-linear' on a mixture of experts folds B·A into the fused expert weights and the router on every
    forward (its ParamWrapper): an MoE block keeps what it keeps under full fine-tuning plus the merged weights,
    which the planner counts (the merged records' bytes), per layer and micro-batch."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    mc = tiny("qwen3_moe")
    ids = torch.randint(0, 256, (2, 128))
    kept = {}
    for name, wrap in (("full", False), ("lora", True)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(mc, attn_implementation="sdpa")
        if wrap:
            model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
        block = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp"))
        kept[name] = _saved_bytes(model, lambda: model(input_ids=ids, labels=ids, use_cache=False), block)
    records = inventory(meta_model(mc), None, Adapters(r=4), pm=us.get_plugin_manager())
    merged = {r.adapter_of for r in records if r.merged and r.layer == 0}
    assert merged  # the experts' gate_up_proj and down_proj, the router's weight
    assert kept["lora"] - kept["full"] == 4 * sum(r.numel for r in records if r.name in merged)


def _saved_bytes(model, run, module=None) -> int:
    """Bytes of the tensors autograd keeps for the backward (parameters excluded), of ``module``'s forward only
    when given."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if module is None:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    else:
        forward = module.forward

        def hooked(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return forward(*args, **kwargs)

        module.forward = hooked
        run()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in saved.items() if ptr not in weights)


@pytest.mark.parametrize("args, message", [
    (["--lora-r", "8"], "without --peft lora"),
    (["--lora-alpha", "32"], "without --peft lora"),
    (["--peft", "lora", "--lora-r", "0"], "LoRA rank 0"),
    (["--peft", "lora", "--lora-target", "no_such_proj"], "match no layer"),
    (["--peft", "lora", "--lora-target", "mlp"], "is a LlamaMLP"),
])
def test_bad_peft_input_names_the_flag_and_the_fix(capsys, args, message):
    code = cli(["plan", "--model", "llama-3.2-1b", "--gpus", "8", "--gpu", "h100-sxm-80gb", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Fix" in err


def test_the_printed_plan_says_what_trains_and_how_to_wrap_the_model(capsys):
    code = cli(["plan", "--model", "llama-3.2-1b", "--gpus", "8", "--gpu", "h100-sxm-80gb", "--peft", "lora",
                "--lora-r", "8", "--lora-target", "q_proj,v_proj", "--lora-alpha", "16", "--top", "2"])
    out = capsys.readouterr().out
    trainable = 16 * 8 * ((2048 + 2048) + (2048 + 512))  # q: 2048 -> 2048, v: 2048 -> 512, 16 layers
    assert code == 0 and f"LoRA r=8 on q_proj,v_proj: {trainable / 1e6:,.1f}M trainable" in out
    assert "get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=['q_proj', 'v_proj']))" in out


def test_pricing_lora_without_peft_installed_says_how_to_install_it(monkeypatch):
    """The planner asks the installed peft which layers LoRA adapts (which it changes from release to release):
    without peft, one line that says so and how to install it."""
    import sys

    from ultrascale_plugins.features.peft.pricing import priced_factors
    from ultrascale_plugins.interface.fields import ConfigError

    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ConfigError) as err:
        priced_factors(meta_model(make_config("llama")), Adapters(r=4))
    assert "peft is not installed" in str(err.value) and "Fix: pip install" in str(err.value)
    assert "\n" not in str(err.value)
