"""The model a plan is for: a Hugging Face ``config.json`` or a preset name, its parameters counted exactly on the
meta device (no weights, no download), and its training FLOPs per token."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..interface.config import ConfigError
from ..interface.estimates import meta_model

# Architectures people plan for most often, as their published config.json fields (the ones that size the model).
_LLAMA3 = dict(model_type="llama", vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu",
               max_position_embeddings=131072)
PRESETS = {
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama-3.2-3b": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "llama-3.1-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "llama-3.1-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    "llama-3.1-405b": dict(_LLAMA3, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                           num_attention_heads=128, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_act="silu",
                       tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                       tie_word_embeddings=False, sliding_window=None),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                         num_experts_per_tok=2, hidden_act="silu", tie_word_embeddings=False),
    # Qwen/Qwen3-30B-A3B's config.json: 128 experts of width 768 in every layer, 8 per token
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu",
                          rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                          tie_word_embeddings=False),
    # deepseek-ai/DeepSeek-V3: transformers' DeepseekV3Config defaults are the real model's (61 layers, the first 3
    # dense; 256 routed experts of width 2048, 8 per token, and one shared; multi-head latent attention)
    "deepseek-v3": dict(model_type="deepseek_v3"),
}

def load_model_config(spec):
    """A transformers config from a preset name, a path to a ``config.json`` (or its directory), or a config."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(spec, PretrainedConfig):
        return spec
    if isinstance(spec, dict):
        fields = dict(spec)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    key = str(spec).lower()
    if key in PRESETS:
        return load_model_config(PRESETS[key])
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"--model {spec!r}: neither a preset nor a config.json. Fix: give a path to a Hugging Face "
                          f"config.json, or one of: {', '.join(PRESETS)}")
    fields = json.loads(path.read_text())
    if "model_type" not in fields:
        raise ConfigError(f"--model {spec}: config.json has no model_type. Fix: use a transformers config.json")
    try:
        return load_model_config(fields)
    except ValueError as exc:
        raise ConfigError(f"--model {spec}: {exc}") from None


@dataclasses.dataclass
class ModelSpec:
    """What the planner needs to know of a model beyond its config: parameter counts (total, what one token uses,
    the embedding lookup's) and the training FLOPs per token at a sequence length, with or without adapters."""

    config: object
    total_params: int
    active_params: int  # per token: experts at top-k / experts
    embedding_params: int  # a lookup, not a matmul (unless the head ties it)
    name: str = ""

    @classmethod
    def of(cls, model_config, name: str = "") -> "ModelSpec":
        from ..interface.estimates import inventory

        model = meta_model(model_config)
        records = inventory(model)
        total = sum(r.numel for r in records)
        active = sum(r.numel * r.active for r in records)
        embed = model.get_input_embeddings()
        head = model.get_output_embeddings()
        lookup = 0 if embed is None or (head is not None and head.weight is embed.weight) else embed.weight.numel()
        return cls(model_config, total, int(active), lookup, name or model_config.model_type)

    def records(self, adapters=None) -> list:
        """The model's parameter inventory (``interface.estimates.inventory``), with ``adapters`` as PEFT would add
        them: the frozen base and the trainable factors."""
        from ..interface.estimates import inventory

        return inventory(meta_model(self.config), None, adapters)

    def trainable_params(self, adapters=None) -> int:
        """Parameters that get gradients and optimizer states: all of them, or the adapters' factors."""
        if adapters is None:
            return self.total_params
        return sum(r.numel for r in self.records(adapters) if r.trainable)

    def flops_per_token(self, seq_len: int, adapters=None) -> float:
        """Training FLOPs per token: 6 per matmul parameter (forward + backward) plus attention, 12 * L * d_attn
        * s (PaLM appendix B, no causal discount). With ``adapters`` (LoRA), a frozen weight costs 4 (its forward
        and its input's gradient, no gradient of its own) and the adapters' factors 6 each
        (``interface.estimates.flops_per_token``); PEFT's merging of adapters into fused expert weights is not
        model work (``merge_flops``: the cost model adds its time)."""
        mc = self.config
        if adapters is not None:
            from ..interface.estimates import flops_per_token

            return sum(flops_per_token(self.records(adapters), mc, seq_len))
        heads = mc.num_attention_heads
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // heads
        return 6 * (self.active_params - self.embedding_params) + 12 * mc.num_hidden_layers * heads * head_dim * seq_len
