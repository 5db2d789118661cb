"""The planner's model presets are the published models: every field that changes cost or behaviour (sizes,
heads, vocabulary, tied embeddings, experts and routing, rope and its scaling, context length, special tokens,
norm epsilon) is what the model's Hugging Face config.json says, as transformers loads it, so the plan, the recipe
it prints and a run started from that recipe train the real architecture."""
import json
from pathlib import Path

import pytest

from ultrascale_plugins.planner.model_spec import PRESETS, ModelSpec, load_model_config

ROOT = Path(__file__).resolve().parent.parent


def _llama3(hidden, ffn, layers, heads, factor, tied, head_dim=128):
    return dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=8, head_dim=head_dim, vocab_size=128256, tie_word_embeddings=tied,
                max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001, rms_norm_eps=1e-5,
                rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


# Each repository's config.json, written out by hand from the published file (the presets' JSON files must agree
# with this table, not the other way round). Llama: the base models (the -Instruct ones end on three eos ids).
PUBLISHED = {
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, 32.0, True, head_dim=64),
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, 32.0, True),
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32, 8.0, False),
    "llama-3.1-70b": _llama3(8192, 28672, 80, 64, 8.0, False),
    "llama-3.1-405b": _llama3(16384, 53248, 126, 128, 8.0, False),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                       max_position_embeddings=131072, bos_token_id=151643, eos_token_id=151643, rms_norm_eps=1e-6,
                       use_sliding_window=False, rope={"rope_type": "default", "rope_theta": 1000000.0}),
    "mistral-7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=32768, tie_word_embeddings=False,
                       max_position_embeddings=32768, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
                       sliding_window=None, rope={"rope_type": "default", "rope_theta": 1000000.0}),
    "mixtral-8x7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False,
                         max_position_embeddings=32768, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
                         sliding_window=None, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                         rope={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                          max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
                          rms_norm_eps=1e-6, use_sliding_window=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          router_aux_loss_coef=0.001, rope={"rope_type": "default", "rope_theta": 1000000.0}),
    "deepseek-v3": dict(hidden_size=7168, intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, vocab_size=129280, tie_word_embeddings=False,
                        max_position_embeddings=163840, bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-6,
                        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048,
                        first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                        norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128,
                        rope={"rope_type": "yarn", "rope_theta": 10000, "factor": 40, "beta_fast": 32, "beta_slow": 1,
                              "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}),
}
# parameters as the published weights count them (safetensors metadata; DeepSeek-V3 without its multi-token
# prediction module, which transformers does not build)
PARAMETERS = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
              "llama-3.1-70b": 70_553_706_496, "llama-3.1-405b": 405_853_388_800, "qwen2.5-7b": 7_615_616_512,
              "mistral-7b": 7_248_023_552, "mixtral-8x7b": 46_702_792_704, "qwen3-30b-a3b": 30_532_122_624}


def view(config, fields) -> dict:
    """``config``'s values of ``fields`` (``rope``: its rope parameters, as many keys as ``fields['rope']`` has)."""
    out = {k: getattr(config, k, "<missing>") for k in fields if k != "rope"}
    if "rope" in fields:
        rope = getattr(config, "rope_parameters", None) or {}
        out["rope"] = {k: rope.get(k, "<missing>") for k in fields["rope"]}
    return out


def test_every_preset_is_in_the_table():
    assert set(PRESETS) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_preset_loads_as_its_published_config(name):
    config = load_model_config(name)
    assert view(config, PUBLISHED[name]) == PUBLISHED[name]
    if name in PARAMETERS:
        assert ModelSpec.of(config).total_params == PARAMETERS[name]


def test_the_recipes_planning_configs_are_the_presets_models():
    """recipes/sft/configs/*.json (the -Instruct checkpoints the SFT recipes start from) and the presets are the
    same architectures: Qwen3-30B-A3B's file is the preset's; the Llama-3.1 -Instruct ones differ in their eos ids."""
    from ultrascale_plugins.planner.model_spec import preset_fields

    def read(path):
        return {k: v for k, v in json.loads(Path(path).read_text()).items() if k != "transformers_version"}

    configs = ROOT / "recipes" / "sft" / "configs"
    assert read(configs / "qwen3-30b-a3b.json") == preset_fields("qwen3-30b-a3b")
    for name in ("llama-3.1-8b", "llama-3.1-70b"):
        instruct, base = read(configs / f"{name}.json"), preset_fields(name)
        assert instruct.pop("eos_token_id") == [128001, 128008, 128009] and base.pop("eos_token_id") == 128001
        assert instruct == base, name


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_printed_recipe_trains_the_published_model(name):
    """The model: section `ultrascale plan` prints (ultrascale_plugins.planner.command.build), through YAML and the
    recipe's loader, is the published model; DeepSeek-V3's remote-code names and fp8 storage are left out."""
    import argparse

    import yaml

    from ultrascale_plugins.planner.command import add_arguments, build
    from ultrascale_plugins.data.recipe import model_config_of

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    _, fields = build(parser.parse_args(["--model", name, "--gpus", "8", "--gpu", "h100-sxm-80gb"]))
    assert not {"auto_map", "quantization_config", "architectures", "transformers_version"} & set(fields)
    config = model_config_of(yaml.safe_load(yaml.safe_dump({"model": fields}, sort_keys=False))["model"])
    assert view(config, PUBLISHED[name]) == PUBLISHED[name]


def test_the_checkpoints_dtype_does_not_change_what_the_plan_prices():
    """A published config.json says its weights are stored in bfloat16; transformers keeps DeepSeek-V3's routers in
    fp32 beside them. The plan prices every weight by its precision profile (fp32 held, bf16 compute) all the same,
    not as a model of mixed dtypes whose bf16 weights keep bf16 gradients and optimizer states."""
    spec = ModelSpec.of(load_model_config("deepseek-v3"))
    assert not [r.name for r in spec.records() if r.held_bytes] and spec.config.dtype is None
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # a model built from a preset (the GPU suite's) holds fp32 weights, as trained here
        model = AutoModelForCausalLM.from_config(load_model_config("llama-3.2-1b"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
