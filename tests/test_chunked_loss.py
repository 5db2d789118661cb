"""The chunked loss (``chunked_loss: N``): the head and the cross-entropy N tokens at a time, never the whole
logits. Its parity under every dimension is in tests/parity_cases.py (``chunked_*``), its memory against the
estimate in tests/memory_worker.py (``*_chunked``), its front ends in the Lightning and Trainer tests."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ultrascale_plugins as us
from ultrascale_plugins.features.chunked_loss.head_loss import chunked_head_loss


@pytest.fixture(autouse=True)
def _no_group_left():
    """``parallelize`` in this process makes a world of one; later tests check that nothing made a group."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_chunked_loss_is_the_cross_entropy_of_the_whole_logits(bias, autocast):
    """Value and gradients (hidden states, weight, bias) against F.cross_entropy of the whole logits: ignored
    targets, a last chunk shorter than the others; in fp32 to rounding, under bf16 autocast to bf16's precision."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    b = torch.randn(50, requires_grad=True) if bias else None
    targets = torch.randint(0, 50, (3, 11))
    targets[0, :4] = -100
    params = [t for t in (hidden, weight, b) if t is not None]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        whole = F.cross_entropy(F.linear(hidden, weight, b).float().flatten(0, 1), targets.flatten(),
                                ignore_index=-100, reduction="sum")
        chunked = chunked_head_loss(hidden, weight, b, targets, chunk=7)
    tol = 2e-2 if autocast else 1e-6  # bf16: the parity cases' tolerance
    assert abs(float(chunked) - float(whole)) <= tol * abs(float(whole))
    for want, got in zip(torch.autograd.grad(whole, params), torch.autograd.grad(chunked, params)):
        assert float((want - got).abs().max()) <= tol * float(want.abs().max())


def test_each_tokens_loss_and_its_gradient_for_per_row_sums():
    """``chunked_token_losses``: each token's loss (0 where ignored), and gradients for any weighting of them (a
    preference loss weighs the rows' sums differently)."""
    from ultrascale_plugins.features.chunked_loss.head_loss import chunked_token_losses

    torch.manual_seed(1)
    hidden = torch.randn(2, 9, 8, requires_grad=True)
    weight = torch.randn(30, 8, requires_grad=True)
    targets = torch.randint(0, 30, (2, 9))
    targets[1, 5:] = -100
    whole = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), targets.flatten(), ignore_index=-100,
                            reduction="none").view(2, 9)
    chunked = chunked_token_losses(hidden, weight, None, targets, chunk=4)
    assert torch.allclose(chunked, whole, atol=1e-6) and bool((chunked[1, 5:] == 0).all())
    rows = torch.tensor([1.5, -0.5])  # e.g. chosen and rejected
    for want, got in zip(torch.autograd.grad((whole.sum(1) * rows).sum(), [hidden, weight]),
                         torch.autograd.grad((chunked.sum(1) * rows).sum(), [hidden, weight])):
        assert torch.allclose(want, got, atol=1e-5)


def test_the_step_has_no_logits_and_the_model_outside_it_still_gives_them():
    """Through the engine's forward the loss is the plain run's and ``logits`` is None (they were never made);
    called as a model (generation, a front end's own forward without labels) it returns the whole logits."""
    from models import make_model

    ids = torch.randint(0, 200, (2, 40))
    plain = us.parallelize(make_model("llama"), us.ParallelConfig())
    chunked = us.parallelize(make_model("llama"), us.ParallelConfig(chunked_loss=16))
    want, got = plain.forward({"input_ids": ids}), chunked.forward({"input_ids": ids})
    assert got.logits is None and want.logits is not None
    assert abs(float(got.loss) - float(want.loss)) <= 1e-6
    with torch.no_grad():
        assert torch.allclose(chunked(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-6)


def _tiny(config_cls, **extra):
    from transformers import AutoModelForCausalLM

    config = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=16, **extra)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "granite"])
def test_a_model_that_changes_its_logits_after_the_head_is_refused_before_launch(kind):
    """Gemma-2's soft-capping, Cohere's and Granite's scaling: found by a meta-device forward, not by name."""
    from transformers import CohereConfig, Gemma2Config, GraniteConfig

    cls = {"gemma2": Gemma2Config, "cohere": CohereConfig, "granite": GraniteConfig}[kind]
    with pytest.raises(us.ConfigError, match="changes the logits after its head.*Fix: set chunked_loss: 0"):
        model = _tiny(cls)
        us.validate(us.ParallelConfig(chunked_loss=64), model.config, 1, model=model)


def test_a_pad_id_outside_the_embedding_passes_the_checks_that_rebuild_the_model():
    """Issue 47: a tokenizer's pad token added without resizing, whose id TRL copies into ``model.config`` after
    the model was built. transformers cannot build the model from that config (nn.Embedding asserts), and the
    meta twins of the chunked loss's and the pipeline's checks were built from it: a raw AssertionError. The twin
    now takes the padding index of the model the user gave; the user's config is left as it is."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ultrascale_plugins.models.dataflow import meta_twin

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=3)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.config.pad_token_id = 64  # the vocabulary's size: one past the embedding's last row, as TRL sets it
    with pytest.raises(AssertionError, match="Padding_idx"), torch.device("meta"):
        type(model)(model.config)  # what meta_twin did
    twin = meta_twin(model)
    assert twin.model.embed_tokens.padding_idx == 3 and model.config.pad_token_id == 64
    us.validate(us.ParallelConfig(chunked_loss=64), model.config, 1, model=model)
    us.validate(us.ParallelConfig(pp=2, dp_shard=1, chunked_loss=64), model.config, 2, model=model)


def test_loss_parallel_beside_the_chunked_loss_is_one_line_naming_the_field():
    with pytest.raises(us.ConfigError, match="chunked_loss=64: .*Fix: set loss_parallel: false"):
        us.validate(us.ParallelConfig(tp=2, loss_parallel=True, chunked_loss=64), None, 2)


def test_an_adapter_on_the_head_is_refused():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig

    model = get_peft_model(_tiny(LlamaConfig), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(us.ConfigError, match="not a torch Linear.*Fix: set chunked_loss: 0"):
        us.validate(us.ParallelConfig(chunked_loss=64), model.config, 1, model=model)


def test_the_estimate_holds_one_chunk_of_logits_and_one_more_head_matmul():
    """Per rank, for a 128k vocabulary: the whole logits' bytes grow with the tokens of a micro-batch, the chunked
    loss's do not (one chunk, plus the head's weight gradient it accumulates from its first chunk on), so what it
    saves more than doubles from 4,096 to 8,192 tokens; under TP the head's rows are split; the head's matmul is
    priced once more."""
    from transformers import LlamaConfig

    mc = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
    for layout in ({"dp_shard": 8}, {"dp_shard": 4, "tp": 2}):
        saved = {}
        for seq in (4096, 8192):
            whole, chunked = (us.estimate(us.ParallelConfig(**layout, mixed_precision="bf16", chunked_loss=chunk), mc,
                                          world_size=8, seq_len=seq) for chunk in (0, 1024))
            saved[seq] = whole.memory["activations"] - chunked.memory["activations"]
            tp = layout.get("tp", 1)
            extra = chunked.factors["extra_flops"] - whole.factors.get("extra_flops", 0.0)
            assert extra == pytest.approx(2 * seq * 4096 * 128256 / tp)
        assert 0 < 2 * saved[4096] < saved[8192], (layout, saved)


def _stats_case(seed: int = 2):
    torch.manual_seed(seed)
    hidden = torch.randn(2, 13, 8)
    weight = torch.randn(40, 8)
    weight[7] = weight[31]  # two vocabulary rows with the same logits, one in each half: a tie for the argmax
    bias = torch.randn(40)
    bias[7] = bias[31]
    targets = torch.randint(0, 40, (2, 13))
    targets[0, :3] = -100
    logits = F.linear(hidden, weight, bias)
    targets[1, :4] = logits[1, :4].argmax(-1)  # some hits
    targets[1, 4] = 31  # the tie's second index: torch.argmax picks 7, so not a hit
    hidden[1, 4] = weight[7] * 10
    return hidden, weight, bias, targets


def _whole_stats(hidden, weight, bias, targets):
    logits = F.linear(hidden, weight, bias).float()
    valid = targets != -100
    p = logits.softmax(-1)
    entropy = -(p * logits.log_softmax(-1)).sum(-1) * valid
    return entropy, (logits.argmax(-1) == targets) & valid, logits.mean(-1) * valid


def test_each_tokens_entropy_and_top1_are_the_whole_logits():
    """``chunked_token_stats`` (the metrics a trainer logs beside the loss: TRL's entropy and mean token accuracy),
    without a vocabulary split: each token's entropy and whether its target is torch.argmax of the whole logits
    (ties: the first index), zero where ignored; and minus ``chunked_token_losses``, its log-probability."""
    from ultrascale_plugins.features.chunked_loss.head_loss import chunked_token_losses, chunked_token_stats

    hidden, weight, bias, targets = _stats_case()
    want_entropy, want_top1, want_mean = _whole_stats(hidden, weight, bias, targets)
    entropy, top1, mean = chunked_token_stats(hidden, weight, bias, targets, chunk=5)
    assert torch.allclose(entropy, want_entropy, atol=1e-5) and torch.equal(top1, want_top1)
    assert torch.allclose(mean, want_mean, atol=1e-6) and bool(mean[1].any())
    assert bool(want_top1[1, :4].all()) and not bool(want_top1[1, 4]) and not bool(entropy[0, :3].any())
    log_probs = F.linear(hidden, weight, bias).log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1))
    want = log_probs.squeeze(-1) * (targets != -100)
    assert torch.allclose(-chunked_token_losses(hidden, weight, bias, targets, chunk=5), want, atol=1e-5)


def _sharded_stats(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from ultrascale_plugins.features.chunked_loss.head_loss import VocabShard, chunked_token_losses, chunked_token_stats

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        hidden, weight, bias, targets = _stats_case()
        rows = weight.shape[0] // world
        part = slice(rank * rows, (rank + 1) * rows)
        shard = VocabShard(dist.group.WORLD, rank * rows)
        entropy, top1, mean = chunked_token_stats(hidden, weight[part], bias[part], targets, chunk=5, vocab=shard)
        losses = chunked_token_losses(hidden, weight[part], bias[part], targets, chunk=5, vocab=shard)
        torch.save({"entropy": entropy, "top1": top1, "mean": mean, "losses": losses}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_each_tokens_entropy_and_top1_over_a_vocabulary_split_in_two(tmp_path):
    """The same over a vocabulary split between 2 gloo processes (tensor parallel's head): the maximum, the sums
    (the logits' for their mean over the whole vocabulary) and the first argmax all-reduced, so every rank has the whole vocabulary's figures, the tie included."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "stats")
    mp.start_processes(_sharded_stats, args=(2, f"file://{tmp_path / 'store'}", out), nprocs=2, join=True,
                       start_method="spawn")
    hidden, weight, bias, targets = _stats_case()
    want_entropy, want_top1, want_mean = _whole_stats(hidden, weight, bias, targets)
    want_losses = F.cross_entropy(F.linear(hidden, weight, bias).flatten(0, 1), targets.flatten(),
                                  ignore_index=-100, reduction="none").view(targets.shape)
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        assert torch.allclose(got["entropy"], want_entropy, atol=1e-5), rank
        assert torch.equal(got["top1"], want_top1), rank
        assert torch.allclose(got["mean"], want_mean, atol=1e-6), rank
        assert torch.allclose(got["losses"], want_losses, atol=1e-5), rank
