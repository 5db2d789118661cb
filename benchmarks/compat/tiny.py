"""Tiny configs for every causal-LM model type the installed transformers ships, built by rule, not by list.

``causal_lm_types()`` enumerates ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; ``tiny_config(model_type)`` builds the
type's config with every size field it has shrunk (hidden 64, 4 layers, 8 heads / 4 KV heads, 4 experts with
2 per token, vocabulary 256) and dropout off. A type that cannot be built tiny raises ``Untinyable`` with the
reason; nothing here names an architecture.
"""
from __future__ import annotations

import dataclasses
import warnings

VOCAB = 256

# Field name -> tiny value; set only when the config class has the field.
SIZES = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8, "rotary_dim": 8, "max_position_embeddings": 64,
    # mixture of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
    "num_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "decoder_sparse_step": 1,
    "interleave_moe_layer_step": 1, "mlp_only_layers": [], "router_jitter_noise": 0.0, "output_router_logits": False,
    # multi-head latent attention
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    # linear-attention / state-space hybrids
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "ssm_state_size": 16,
    # the reference (kernel-less) Mamba-2 scan pads the sequence to a whole chunk: at the default 256 a 16-token
    # row costs 16 times over (bamba's step 0.59 s -> 0.04 s on CPU, the same loss)
    "mamba_chunk_size": 16,
}
MAX_PARAMS = 4_000_000
TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


class Untinyable(Exception):
    """The type's config or model cannot be built small; the message says why."""


def causal_lm_types() -> dict[str, str]:
    """{model_type: causal-LM class name} of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {k: (v[0] if isinstance(v, (list, tuple)) else v) for k, v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}


def _fields(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    import inspect

    return set(inspect.signature(cls.__init__).parameters)


def plans(config) -> tuple[dict, dict]:
    """(TP plan, PP plan) a config carries, on itself or on its text sub-config."""
    for c in (config, text_sub_config(config)):
        if c is not None and (getattr(c, "base_model_tp_plan", None) or getattr(c, "base_model_pp_plan", None)):
            return dict(getattr(c, "base_model_tp_plan", None) or {}), dict(getattr(c, "base_model_pp_plan", None) or {})
    return {}, {}


def text_sub_config(config):
    for name in ("text_config", "language_config", "llm_config", "decoder"):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "model_type"):
            return sub
    return None


def default_config(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return CONFIG_MAPPING[model_type]()
    except Exception as exc:  # noqa: BLE001 - any failure is the reason reported
        raise Untinyable(f"default config fails: {type(exc).__name__}: {_line(exc)}") from exc


def _get(config, name):
    """A config attribute, or None where the config refuses a global read (per-layer attributes of
    heterogeneous configs: the tiny sizes set them for every layer)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001
        return None


def _line(exc) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:160]


def tiny_config(model_type: str):
    """The tiny config of ``model_type`` (the text config when the plans live there)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    default = default_config(model_type)
    target = default
    if not (getattr(default, "base_model_tp_plan", None) or getattr(default, "base_model_pp_plan", None)):
        sub = text_sub_config(default)
        if sub is not None and (getattr(sub, "base_model_tp_plan", None) or getattr(sub, "base_model_pp_plan", None)):
            target = sub
    cls = CONFIG_MAPPING[target.model_type] if target.model_type in CONFIG_MAPPING else type(target)
    names = _fields(cls)
    aliases = dict(getattr(cls, "attribute_map", None) or {})  # e.g. hidden_size -> n_embd
    kwargs = {}
    for key, value in SIZES.items():
        key = aliases.get(key, key)
        if key in names:
            kwargs[key] = value
    for name in names:  # per-layer or per-part sizes beside the main ones (e.g. intermediate_size_mlp)
        value = _get(target, name)
        if name not in kwargs and isinstance(value, int) and not isinstance(value, bool):
            if "expert" in name and value > SIZES["num_experts"]:
                per_token = any(t in name for t in ("per_tok", "top_k", "topk"))
                kwargs[name] = SIZES["num_experts_per_tok"] if per_token else SIZES["num_experts"]
            elif "vocab_size" in name and value > VOCAB:
                kwargs[name] = VOCAB
            elif "intermediate_size" in name and value > SIZES["intermediate_size"]:
                kwargs[name] = SIZES["moe_intermediate_size"] if "moe" in name or "expert" in name else \
                    SIZES["intermediate_size"]
            elif name.endswith("head_dim") and value > 2 * SIZES["head_dim"]:  # e.g. an indexer's or SWA's heads
                kwargs[name] = 2 * SIZES["head_dim"]
    if "qk_rope_head_dim" in kwargs and "head_dim" in kwargs:  # multi-head latent attention: rotary part
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    if "kv_lora_rank" in kwargs and "num_key_value_heads" in kwargs:  # latent attention has no grouped KV heads
        kwargs["num_key_value_heads"] = kwargs[aliases.get("num_attention_heads", "num_attention_heads")]
    for name in names:
        if "dropout" in name or "pdrop" in name:
            kwargs[name] = 0.0
    for name in TOKEN_FIELDS:
        value = _get(target, name)
        if name in names and isinstance(value, int) and value >= VOCAB:
            kwargs[name] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[name]
    if "layer_types" in names and _get(target, "layer_types"):
        pattern = list(target.layer_types)
        kwargs["layer_types"] = [pattern[i % len(pattern)] for i in range(SIZES["num_hidden_layers"])]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = cls(**kwargs)
        spec = target.__dict__.get("_heterogeneity_spec")
        if spec is not None:  # heterogeneous layers (per_layer_config): the tiny sizes in every override
            config.per_layer_config = {
                i: {f: (kwargs.get(aliases.get(f, f), v) if isinstance(v, int) and not isinstance(v, bool) else v)
                    for f, v in overrides.items()}
                for i, overrides in spec.per_layer_overrides.items() if int(i) < SIZES["num_hidden_layers"]}
    except Exception as exc:  # noqa: BLE001
        raise Untinyable(f"tiny config rejected: {type(exc).__name__}: {_line(exc)}") from exc
    return config


def build_model(model_type: str, seed: int = 0, overrides: dict | None = None):
    """A tiny causal LM of ``model_type`` with float32 weights from ``seed`` (``overrides`` set on its config)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    try:  # count on the meta device first: a size field these rules do not know would make it huge
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    except Exception as exc:  # noqa: BLE001
        raise Untinyable(f"model fails to build: {type(exc).__name__}: {_line(exc)}") from exc
    if n_params > MAX_PARAMS:
        raise Untinyable(f"still {n_params / 1e6:.1f} M parameters with the tiny sizes (a size field these rules "
                         "do not shrink)")
    torch.manual_seed(seed)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                     dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001
        raise Untinyable(f"model fails to build: {type(exc).__name__}: {_line(exc)}") from exc
    return model
