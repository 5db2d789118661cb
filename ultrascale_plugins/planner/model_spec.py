"""The model a plan is for: a Hugging Face ``config.json`` or a preset name, its parameters counted exactly on the
meta device (no weights, no download), and its training FLOPs per token."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

from ..data.model_section import config_from_fields, read_config_json
from ..interface.config import ConfigError
from ..interface.estimates import meta_model

# Architectures people plan for most often: the Hugging Face repository each preset is, whose config.json is
# shipped as ultrascale_plugins/resources/config-<preset>.json, as published (less its transformers_version, the
# writer's library, not the model). One source of truth: the planner and the recipe it prints (which a run with
# ``--init-from`` starts beside the real checkpoint) see the real model (tokens, rope scaling, context length), not a
# sketch of its sizes. tests/test_planner_presets.py pins the fields that change cost and behaviour against the
# published values.
PRESETS = {
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "llama-3.1-405b": "meta-llama/Llama-3.1-405B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "mistral-7b": "mistralai/Mistral-7B-v0.3",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
}


def preset_fields(name: str) -> dict:
    """The published ``config.json`` of preset ``name`` (a key of ``PRESETS``), as a dict."""
    from importlib import resources

    text = resources.files("ultrascale_plugins").joinpath(f"resources/config-{name}.json").read_text()
    return json.loads(text)


def load_model_config(spec):
    """A transformers config from a preset name, a path to a ``config.json`` (or its directory), or a config; from
    a ``config.json``, without the dtype its checkpoint is stored in (``without_storage_dtype``), so a model built
    from it holds fp32 weights, as this package trains them."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(spec, PretrainedConfig):
        return spec
    if isinstance(spec, dict):
        fields = dict(spec)
        return without_storage_dtype(AutoConfig.for_model(fields.pop("model_type"), **fields))
    key = str(spec).lower()
    if key in PRESETS:
        return load_model_config(preset_fields(key))
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"--model {spec!r}: neither a preset nor a config.json. Fix: give a path to a Hugging Face "
                          f"config.json, or one of: {', '.join(PRESETS)}")
    fields = read_config_json(path, f"--model {spec}")
    if "model_type" not in fields:
        raise ConfigError(f"--model {spec}: config.json has no model_type. Fix: use a transformers config.json")
    return without_storage_dtype(config_from_fields(fields, f"--model {spec}"))


def without_storage_dtype(model_config):
    """``model_config`` without the dtype its checkpoint is stored in (a copy, when it has one). The plan prices
    weights by its precision profile (this package holds them in fp32 and computes in bf16), and transformers builds
    a model in its config's dtype: in a published config's ``torch_dtype`` (bfloat16), with a few modules it keeps
    in fp32 (DeepSeek-V3's routers), the planner would read a model of mixed dtypes, whose bf16 parameters are held,
    with their gradients and optimizer states, in bf16."""
    if getattr(model_config, "dtype", None) is None:
        return model_config
    config = copy.deepcopy(model_config)
    config.dtype = None
    return config


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
    def of(cls, model_config, name: str = "", pm=None) -> "ModelSpec":
        from ..core.inventory import inventory
        from ..core.registry import given_or_default

        model_config = without_storage_dtype(model_config)
        model = meta_model(model_config)
        records = inventory(model, pm=given_or_default(pm))
        total = sum(r.numel for r in records)
        active = sum(r.numel * r.active for r in records)
        embed = model.get_input_embeddings()
        head = model.get_output_embeddings()
        lookup = 0 if embed is None or (head is not None and head.weight is embed.weight) else embed.weight.numel()
        return cls(model_config, total, int(active), lookup, name or model_config.model_type)

    def records(self, adapters=None, pm=None) -> list:
        """The model's parameter inventory (``core.inventory.inventory``), with ``adapters`` as PEFT would add
        them: the frozen base and the trainable factors."""
        from ..core.inventory import inventory
        from ..core.registry import given_or_default

        return inventory(meta_model(self.config), None, adapters, pm=given_or_default(pm))

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
