"""The dry run's peak against the same step run for real under the same tracker: two cells of
``benchmarks/dry_run_vs_real.py`` (which runs every layout at 0.2B): one process, and ZeRO-3 over 2 gloo processes
with clipping over the sharded gradients. Both equal to the byte, by category (the benchmark's bar is 5 %)."""
import sys
from pathlib import Path

import torch.distributed as dist
from transformers import LlamaConfig

import ultrascale_plugins as us

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from dry_run_vs_real import TOLERANCE_PCT, compare, real_step_peak  # noqa: E402


def test_the_peak_equals_a_real_runs_under_the_same_tracker(monkeypatch):
    """World 1, where the real step runs in this process: the same bytes by category at the peak, real tensors or
    fake."""
    config = LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    layout = us.ParallelConfig(dp_shard=1)
    fake = us.dry_run(config, layout, world_size=1, seq_len=512).roles[0].peak
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        real = real_step_peak(config, layout, 512)
    finally:
        dist.destroy_process_group()
    assert fake == real


# 8 layers, 128 tokens: the peak is in the backward, and the gradients' whole size (6.3 MB) would put one above it
ZERO3 = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256)


def test_with_clipping_over_sharded_gradients_the_peak_equals_a_real_two_rank_steps():
    """ZeRO-3 over 2 gloo processes, the same tracker: the same bytes by category at the peak. Clipping's norm
    over the FSDP-sharded gradients used to count each at full size (DTensor's shape propagation on the dry run's
    own fake mode, ``fake_run.peak_tracker``): a peak in clipping 6.3 MB above the real step's."""
    row = compare(ZERO3, dict(dp_shard=2, mixed_precision="bf16"), world=2, seq_len=128)
    assert row["dry_peak"] == row["real_peak"]
    assert abs(row["worst_rank_diff_pct"]) <= TOLERANCE_PCT
    assert "backward" in row["dry_where"]
