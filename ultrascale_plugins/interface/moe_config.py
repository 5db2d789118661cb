"""A mixture of experts' facts as transformers' configs spell them: how many routed experts a layer holds and how
many a token goes to. One place for the config keys, which architectures name differently (``num_experts``,
``n_routed_experts``, ...): the checks, the estimates and the minimum read them from here."""
from __future__ import annotations

# first present key wins; a multimodal config's text part is asked (``get_text_config``)
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k", "num_selected_experts")


def text_config(model_config):
    """The part of ``model_config`` that describes the language model (itself for a text-only model)."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def _first(config, keys) -> int | None:
    return next((getattr(config, k) for k in keys
                 if isinstance(getattr(config, k, None), int) and getattr(config, k) > 0), None)


def routed_experts(model_config) -> int | None:
    """Routed experts per MoE layer, or None for a dense model (one "expert" is no mixture)."""
    count = _first(text_config(model_config), EXPERT_COUNT_KEYS)
    return count if count and count > 1 else None


def experts_per_token(model_config) -> int:
    """How many experts each token is routed to (1 when the config does not say)."""
    return _first(text_config(model_config), TOP_K_KEYS) or 1


def expert_share(model_config) -> float:
    """The share of an expert layer's weights one token uses: top-k / experts (1 for a dense model)."""
    count = routed_experts(model_config)
    top_k = _first(text_config(model_config), TOP_K_KEYS)
    return min(1.0, top_k / count) if count and top_k else 1.0
