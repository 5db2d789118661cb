"""Context parallel: the pieces (layout, batch split, partial-attention merge, checks before launch, presets,
estimates) in one process, and the attention functions against unsplit attention across real processes. The
training parity of every CP layout runs with the other layouts (tests/parity_cases.py)."""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import torchrun
from cp_attention_worker import unsplit
from models import make_config, make_model

import ultrascale_plugins as us
from ultrascale_plugins import ConfigError, ParallelConfig
from ultrascale_plugins.dims.context import kernels as cp_kernels, layout as cp_layout
from ultrascale_plugins.dims.context.attention import block_attention, merge, whole_sequence_attention
from ultrascale_plugins.core.engine import estimate, validate


def test_merging_partial_attention_by_log_sum_exp_equals_unsplit_attention():
    """The ring's combination of partial results over disjoint key blocks (log-sum-exp), including rows that see
    nothing of a block and soft-capped scores, equals attention over all keys at once."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 12, 8), torch.randn(2, 4, 12, 8), torch.randn(2, 4, 12, 6)
    mask = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
    for softcap in (None, 20.0):
        s = q @ k.transpose(-1, -2) * 8 ** -0.5
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        want = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v
        out, lse = block_attention(q, k[:, :, :1], v[:, :, :1], mask[..., :1], 8 ** -0.5, softcap)
        for lo, hi in ((1, 5), (5, 12)):  # row 0 sees nothing of these blocks
            out, lse = merge(out, lse, *block_attention(q, k[:, :, lo:hi], v[:, :, lo:hi], mask[..., lo:hi],
                                                        8 ** -0.5, softcap))
        assert (out - want).abs().max() < 1e-5


def test_cpu_kernel_blocks_merge_exactly_when_rows_see_nothing_of_a_block():
    """The CPU SDPA kernel returns log-sum-exp 0, not -inf, for a row with no visible key; uncorrected, that row
    would take weight exp(0 - lse) in the merge. Split keys (row 0 sees nothing of the later blocks; rows 1-3
    nothing of any block but their own), merged by log-sum-exp and differentiated with the final output and
    log-sum-exp, equal attention over all keys, forward and backward."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 12, 8, requires_grad=True) for _ in range(3))
    mask = torch.ones(12, 12, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    mask[1, :, 4:, :4] = False  # row 1 of the batch: a second document from token 4
    scale = 8 ** -0.5
    want = torch.softmax((q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")), -1) @ v
    grad = torch.randn_like(want)
    (want * grad).sum().backward()
    cuts = ((0, 1), (1, 5), (5, 12))
    out, lse = torch.zeros(2, 4, 12, 8), torch.full((2, 4, 12), float("-inf"))
    for lo, hi in cuts:
        o, l_, _ = cp_kernels.block_forward("flash_cpu", q.detach(), k.detach()[:, :, lo:hi], v.detach()[:, :, lo:hi],
                                            mask[..., lo:hi], False, scale)
        if lo > 0:
            assert torch.isneginf(l_[:, :, 0]).all() and (o[:, :, 0] == 0).all()  # row 0 sees nothing here
        out, lse = merge(out, lse, o, l_)
    assert (out - want).abs().max() < 1e-5
    dq = torch.zeros_like(q)
    for lo, hi in cuts:
        gq, gk, gv = cp_kernels.block_backward("flash_cpu", grad, q.detach(), k.detach()[:, :, lo:hi],
                                               v.detach()[:, :, lo:hi], out, lse, mask[..., lo:hi], False, scale)
        dq += gq
        assert (gk - k.grad[:, :, lo:hi]).abs().max() < 1e-5 and (gv - v.grad[:, :, lo:hi]).abs().max() < 1e-5
    assert (dq - q.grad).abs().max() < 1e-5


def _whole_sequence_case(dtype, window, softcap, monkeypatch):
    """Ulysses' whole-sequence attention (the ring's blocks on one rank) with packed documents against unsplit
    fp32 attention of the same rounded inputs: (output, largest relative differences, SDPA kernels called)."""
    import ultrascale_plugins.dims.context.attention as attention

    monkeypatch.setattr(attention, "TILE", 16)  # several tiles, masked and unmasked
    called = []
    block_forward = cp_kernels.block_forward
    monkeypatch.setattr(cp_kernels, "block_forward", lambda name, *a: called.append(name) or block_forward(name, *a))
    torch.manual_seed(0)
    positions = torch.arange(64).expand(2, 64).clone()
    positions[0, 20:] -= 20
    positions[1, 40:] -= 40
    q, k, v = (torch.randn(2, 4, 64, 16).to(dtype).requires_grad_() for _ in range(3))
    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = unsplit(*exact, positions, True, window, softcap, 0.25)
    grad = torch.randn_like(want)
    (want * grad).sum().backward()
    out = whole_sequence_attention(q, k, v, cp_layout.segments(positions), window, 0.25, softcap)
    (out.transpose(1, 2).float() * grad).sum().backward()
    pairs = [(out.transpose(1, 2), want)] + [(a.grad, b.grad) for a, b in zip((q, k, v), exact)]
    pairs = [(a.detach().float(), b.detach()) for a, b in pairs]
    return out, [float((a - b).abs().max() / b.abs().max()) for a, b in pairs], called


@pytest.mark.parametrize("window", [None, 9])
def test_documents_and_windows_run_on_the_cpu_sdpa_kernel_by_default(window, monkeypatch):
    out, diffs, called = _whole_sequence_case(torch.float32, window, None, monkeypatch)
    assert called and set(called) == {"flash_cpu"}  # not the portable path
    assert max(diffs) < 1e-6, diffs


@pytest.mark.parametrize("window", [None, 9])
def test_bf16_runs_the_kernel_in_bf16_within_bf16_rounding(window, monkeypatch):
    out, diffs, called = _whole_sequence_case(torch.bfloat16, window, None, monkeypatch)
    assert out.dtype == torch.bfloat16 and set(called) == {"flash_cpu"}
    # a few bf16 roundings (2^-8 relative) of the output and gradients; measured 0.4-0.7%
    assert max(diffs) < 2e-2, diffs


def test_soft_capping_stays_on_the_portable_path(monkeypatch):
    """No SDPA kernel applies tanh to the scores inside the softmax: soft-capped models compute portably."""
    assert cp_kernels.ring_kernel(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), 30.0) == "portable"
    out, diffs, called = _whole_sequence_case(torch.float32, 9, 30.0, monkeypatch)
    assert called == [] and max(diffs) < 1e-6, diffs


def test_the_attention_function_runs_eagerly_inside_torch_compile():
    """The ring's sends and its autograd.Function loop cannot be traced: a compiled decoder layer breaks its graph
    at the attention function transformers calls."""
    from ultrascale_plugins.dims.context.attention import cp_attention

    assert getattr(cp_attention, "_torchdynamo_disable", False)


def test_forcing_a_kernel_the_device_cannot_run_is_refused_with_the_fix():
    q = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="KERNEL='flash' runs on cuda, but the attention runs on cpu. Fix"):
        cp_kernels.ring_kernel(q, q, None, "flash")
    with pytest.raises(ValueError, match="KERNEL='fast' is not a kernel setting. Fix: one of auto, portable"):
        cp_kernels.ring_kernel(q, q, None, "fast")


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_head_tail_layout_gives_every_rank_equal_causal_work(cp):
    seq = 8 * cp
    held = torch.cat([cp_layout.local_index(seq, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(seq))
    assert torch.equal(held, cp_layout.layout_index(seq, cp))
    work = [int(sum(i + 1 for i in cp_layout.local_index(seq, cp, r).tolist())) for r in range(cp)]
    assert len(set(work)) == 1  # visible (query, key) pairs under causal masking: the same on every rank


def test_batch_split_pads_on_the_right_keeps_global_positions_and_refuses_left_padding():
    ids = torch.arange(10).expand(2, 10)
    batch = {"input_ids": ids.clone(), "targets": ids.clone(), "attention_mask": torch.ones(2, 10, dtype=torch.long)}
    batch["attention_mask"][1, 7:] = 0
    assert cp_layout.shard_batch(batch, 2, 1) is False  # a padding mask: no document masking (transformers' rule)
    # 10 tokens -> 12 (a multiple of 2*cp); rank 1 holds chunks 1 and 2 of 4 (3 tokens each)
    assert batch["input_ids"][0].tolist() == [3, 4, 5, 6, 7, 8]
    assert batch["position_ids"][0].tolist() == [3, 4, 5, 6, 7, 8]
    rank0 = {"input_ids": ids.clone(), "targets": ids.clone()}
    assert cp_layout.shard_batch(rank0, 2, 0) is True
    assert rank0["position_ids"][0].tolist() == [0, 1, 2, 9, 10, 11]  # the padding continues the positions
    assert rank0["targets"][0].tolist() == [0, 1, 2, 9, -100, -100]  # and is never a target
    left = {"input_ids": ids.clone(), "targets": ids.clone(), "attention_mask": torch.ones(2, 10, dtype=torch.long)}
    left["attention_mask"][0, :3] = 0
    with pytest.raises(ConfigError, match="right padding"):
        cp_layout.shard_batch(left, 2, 0)
    with pytest.raises(ConfigError, match="multi-axis rotary"):
        cp_layout.shard_batch({"input_ids": ids, "targets": ids, "position_ids": torch.zeros(3, 2, 10)}, 2, 0)


def test_documents_follow_transformers_packing_rule():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert cp_layout.segments(positions).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]


def _llama(**changes):
    config = make_config("llama")
    for key, value in changes.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("fields, model_changes, words", [
    ({"cp": 8, "cp_method": "ulysses"}, {}, ["cp=8", "cp_method=ulysses", "4 attention heads", "cp_method: ring"]),
    ({"cp": 2}, {"attention_dropout": 0.1}, ["attention_dropout=0.1", "set attention_dropout: 0"]),
    ({"cp": 2}, {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     ["rope_type 'dynamic'"]),
])
def test_layouts_context_parallel_cannot_run_are_refused_before_any_process_group(fields, model_changes, words):
    with pytest.raises(ConfigError) as err:
        validate(ParallelConfig(dp_shard=1, **fields), _llama(**model_changes), world_size=fields["cp"])
    for word in words:
        assert word in str(err.value)
    assert not dist.is_initialized()


def test_ulysses_replicates_key_value_heads_that_do_not_split():
    # 4 heads / 2 KV heads over tp=2 leave 2 heads and 1 KV head per rank: the KV head is repeated for cp=2
    validate(ParallelConfig(cp=2, cp_method="ulysses", tp=2, dp_shard=1), _llama(), world_size=4)


def _tiny(model_type, **fields):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type, fields, words", [
    ("bamba", {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8,
               "attn_layer_indices": [1]}, ["mixes tokens outside attention", "Conv1d"]),
])
def test_models_whose_attention_cp_cannot_take_over_are_refused_before_any_worker(model_type, fields, words):
    model = _tiny(model_type, **fields)
    with pytest.raises(ConfigError) as err:
        validate(ParallelConfig(cp=2, dp_shard=1), model.config, world_size=2, model=model)
    for word in [f"model type '{model_type}'", *words, "cp: 1"]:
        assert word in str(err.value)


def test_a_model_that_goes_through_the_attention_interface_passes_the_probe():
    with torch.device("meta"):
        model = make_model("qwen3")
    validate(ParallelConfig(cp=2, dp_shard=1), model.config, world_size=2, model=model)


def test_presets_and_estimates():

    config = us.get_plugin_manager().preset_config("cp", 8, 4, _llama())
    assert (config.cp, config.dp_shard, config.cp_method) == (4, 2, "ring")
    base = estimate(ParallelConfig(dp_shard=1), _llama(), world_size=1, seq_len=4096)
    split = estimate(ParallelConfig(cp=4, dp_shard=1), _llama(), world_size=4, seq_len=4096)
    ratio = split.memory["activations"] / base.memory["activations"]
    assert 0.05 < ratio <= 0.25 + 1e-9  # each rank holds a quarter of the tokens (attention scores: less)
    assert split.memory["params"] == base.memory["params"]  # cp shards no parameters
    assert split.comm["cp"] > 0 and "cp" not in base.comm


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_and_ulysses_equal_unsplit_attention_forward_and_backward(cp, tmp_path):
    out = tmp_path / "attention.json"
    proc = torchrun(cp, Path(__file__).parent / "cp_attention_worker.py", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["cases"] == 60  # every method x heads x masking case ran, on the SDPA kernel and portably
    for setting in ("auto", "portable"):
        assert result["max_diff"][setting] < 1e-5, result
        assert math.isfinite(result["max_diff"][setting])
    assert result["kernel_blocks"]["auto"] > 0 and result["kernel_blocks"]["portable"] == 0, result
    # bf16 in, bf16 kernel: within 2% of the largest value, a few bf16 roundings (2^-8 each) of the inputs' scale
    assert result["bf16_max_rel"] < 2e-2, result
