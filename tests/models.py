"""Tiny Hugging Face models and padded batches shared by the tests (no downloads: built from configs)."""
from __future__ import annotations

import torch

VOCAB = 256


def make_config(arch: str):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "llama8":  # deep enough for 4 pipeline ranks with 2 stages each
        return LlamaConfig(**{**common, "num_hidden_layers": 8}, tie_word_embeddings=False)
    if arch == "llama8_tied":
        return LlamaConfig(**{**common, "num_hidden_layers": 8}, tie_word_embeddings=True)
    if arch == "llama_tied":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if arch == "qwen3":  # per-head q_norm / k_norm: replicated over TP, gradients summed over TP
        from transformers import Qwen3Config

        return Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False)
    if arch == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    if arch == "gpt_neox":  # other module names in its pipeline plan: embed_in / emb_dropout / final_layer_norm
        from transformers import GPTNeoXConfig

        return GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, max_position_embeddings=64, hidden_dropout=0.0,
                             attention_dropout=0.0, tie_word_embeddings=False)
    if arch in ("qwen3_moe", "qwen3_moe_aux"):  # 8 experts, top-2: expert parallelism at ep=2 and ep=4
        from transformers import Qwen3MoeConfig

        aux = {"output_router_logits": True, "router_aux_loss_coef": 0.1} if arch.endswith("_aux") else {}
        layers = {"num_hidden_layers": 4} if aux else {}  # V-shaped schedules: 2 stages per pipeline rank
        return Qwen3MoeConfig(**{**common, **layers}, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                              tie_word_embeddings=False, **aux)
    if arch == "qwen2_moe":  # a shared expert beside the routed ones, gated by sigmoid(shared_expert_gate(x))
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(**common, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
                              num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                              tie_word_embeddings=False)
    if arch == "qwen3_next":  # a gated delta-net (linear attention) layer, then a softmax-attention one; MoE MLPs
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(**common, head_dim=16, layer_types=["linear_attention", "full_attention"],
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                               linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                               num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                               tie_word_embeddings=False)
    if arch == "axk1":  # DeepSeek-V3's blocks with a norm on the MoE block's sum, inside the block
        from transformers import AXK1Config

        return AXK1Config(**{**common, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=8,
                          num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0, n_shared_experts=1,
                          q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                          norm_topk_prob=True, tie_word_embeddings=False)
    if arch == "deepseek_v3":  # routers that select with a per-expert bias (auxiliary-loss-free balancing)
        from transformers import DeepseekV3Config

        return DeepseekV3Config(**{**common, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=8,
                                num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0,
                                n_shared_experts=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                                qk_nope_head_dim=8, v_head_dim=16, norm_topk_prob=True, tie_word_embeddings=False)
    if arch == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    raise ValueError(arch)


def make_model(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(make_config(arch), attn_implementation="sdpa")


def padded_batches(steps: int, global_batch: int = 8, seq_len: int = 16, seed: int = 1,
                   positions: bool = False) -> list[dict]:
    """Right-padded batches whose first rows carry far more padding than the last ones, plus labels at -100
    in random places: data-parallel ranks hold different numbers of valid tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (global_batch, seq_len), generator=g)
        lengths = torch.full((global_batch,), seq_len)
        lengths[: global_batch // 2] = torch.randint(3, seq_len // 2, (global_batch // 2,), generator=g)
        mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        labels = labels.masked_fill(torch.rand(labels.shape, generator=g) < 0.15, -100)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if positions:  # explicit position ids, offset per row (as when packing continues a document)
            batch["position_ids"] = torch.arange(seq_len)[None, :] + torch.randint(0, 32, (global_batch, 1),
                                                                                   generator=g)
        out.append(batch)
    return out


def packed_batches(steps: int, global_batch: int = 8, seq_len: int = 256, seed: int = 2) -> list[dict]:
    """Rows of several documents each, as transformers' packing collator (DataCollatorWithFlattening) makes
    them: ``position_ids`` restart at 0 at every document, the first token of a document is not a target, no
    attention mask; plus labels at -100 in random places."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (global_batch, seq_len), generator=g)
        positions = torch.zeros(global_batch, seq_len, dtype=torch.long)
        labels = ids.clone()
        for row in range(global_batch):
            start = 0
            while start < seq_len:
                length = int(torch.randint(5, seq_len // 2, (1,), generator=g))
                end = min(seq_len, start + length)
                positions[row, start:end] = torch.arange(end - start)
                labels[row, start] = -100
                start = end
        labels = labels.masked_fill(torch.rand(labels.shape, generator=g) < 0.15, -100)
        out.append({"input_ids": ids, "position_ids": positions, "labels": labels})
    return out


def rows(batch: dict, rank: int, size: int) -> dict:
    per = next(iter(batch.values())).shape[0] // size
    return {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}


def train_steps(pmodel, opt, steps, batches) -> list[float]:
    """AdamW steps ``steps`` over ``batches`` (global batches; each rank takes its rows), clipping at 1.0."""
    losses = []
    for i in steps:
        loss = pmodel.train_step(rows(batches[i], pmodel.data_parallel_rank, pmodel.data_parallel_size))
        pmodel.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
