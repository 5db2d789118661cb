"""Micro-batch size and gradient accumulation in recipes: global_batch = data-parallel size x micro_batch_size x
grad_accum, derived and checked by load_recipe (before any worker starts); with a pipeline the micro-batches are
the schedule's (pp_microbatches); without one the training loop accumulates over micro-batches, and that trains
exactly like the whole batch at once."""
import json
import subprocess
import sys

import pytest
import torch
import yaml

from ultrascale_plugins.interface.config import ConfigError
from ultrascale_plugins.data.recipe import load_recipe

TINY = {
    "nproc": 2,
    "model": {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 64},
    "data": {"seq_len": 32},
    "train": {"steps": 3, "global_batch": 8, "log_every": 1, "eval_batches": 1},
    "parallel": {"dp_shard": 2},
}


def tiny(tmp_path, **sections):
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in TINY.items()}
    for key, value in sections.items():
        if isinstance(value, dict):
            data[key].update(value)
        else:
            data[key] = value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def batching(recipe):
    return recipe.train.global_batch, recipe.train.micro_batch_size, recipe.train.grad_accum


# ---- derivations ---------------------------------------------------------------------------------------------
def test_neither_given_is_one_micro_batch_per_step(tmp_path):
    assert batching(load_recipe(tiny(tmp_path))) == (8, 4, 1)


def test_one_given_derives_the_other(tmp_path):
    path = tiny(tmp_path)
    assert batching(load_recipe(path, ["train.grad_accum=4"])) == (8, 1, 4)
    assert batching(load_recipe(path, ["train.micro_batch_size=2"])) == (8, 2, 2)
    assert batching(load_recipe(path, ["train.micro_batch_size=2", "train.grad_accum=2"])) == (8, 2, 2)


def test_the_set_options_of_the_command_line(tmp_path):
    recipe = load_recipe(tiny(tmp_path), ["train.global_batch=16", "train.micro_batch_size=2", "train.grad_accum=4"])
    assert batching(recipe) == (16, 2, 4)


def test_data_parallel_size_is_the_row_splitting_axes_only(tmp_path):
    """dp = dp_replicate x dp_shard after the layout is resolved against nproc; tp (and pp) do not split rows."""
    path = tiny(tmp_path, nproc=8, parallel={"dp_replicate": 2, "dp_shard": -1, "tp": 2})
    assert batching(load_recipe(path, ["train.global_batch=16"])) == (16, 4, 1)
    assert batching(load_recipe(path, ["train.global_batch=16", "train.grad_accum=2"])) == (16, 2, 2)
    # a worker under torchrun on several nodes resolves against the real world size, not the recipe's nproc
    assert batching(load_recipe(path, ["train.global_batch=16"], world_size=16)) == (16, 2, 1)


def test_the_shipped_recipe_states_its_split():
    from pathlib import Path

    recipe = load_recipe(Path(__file__).parent.parent / "recipes" / "llama_hsdp_tp.yaml")
    assert batching(recipe) == (16, 2, 2)  # dp_replicate 2 x dp_shard 2 x 2 rows x 2 micro-batches


def test_resolved_values_round_trip_through_to_dict(tmp_path):
    recipe = load_recipe(tiny(tmp_path), ["train.grad_accum=2"])
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(recipe.to_dict()))
    assert load_recipe(again) == recipe
    assert recipe.to_dict()["train"]["micro_batch_size"] == 2 and recipe.to_dict()["train"]["grad_accum"] == 2


# ---- errors: each from load_recipe alone, naming the field, the value and the fix ------------------------------
@pytest.mark.parametrize("overrides, words", [
    (["train.micro_batch_size=2", "train.grad_accum=3"],
     ["train.micro_batch_size=2", "train.grad_accum=3", "data-parallel size 2", "= 12", "train.global_batch=8",
      "Fix: set global_batch: 12"]),
    (["train.grad_accum=3"], ["train.grad_accum=3", "4 rows per rank", "Fix:", "multiple of 6"]),
    (["train.micro_batch_size=3"], ["train.micro_batch_size=3", "4 rows per rank", "Fix:", "divides 4"]),
    (["train.global_batch=7"], ["train.global_batch=7", "data-parallel size 2", "Fix: use a multiple of 2"]),
    (["train.grad_accum=-1"], ["train.grad_accum=-1", "0 or more", "Fix:"]),
    (["train.micro_batch_size=1.5"], ["train.micro_batch_size=1.5", "integer", "Fix:"]),
])
def test_inconsistent_values_are_refused(tmp_path, overrides, words):
    with pytest.raises(ConfigError) as info:
        load_recipe(tiny(tmp_path), overrides)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_the_command_line_refuses_before_launch(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "train", str(tiny(tmp_path)),
                           "--set", "train.micro_batch_size=2", "--set", "train.grad_accum=3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ultrascale: error: train.micro_batch_size=2"), proc.stderr
    assert "processes" not in proc.stdout  # no worker printed its banner


# ---- with a pipeline: the schedule's micro-batches ------------------------------------------------------------
def test_pipeline_micro_batches_are_the_accumulation():
    """The embedded default: pp=2 (1f1b) x dp_shard=2 x tp=2 on 8 processes, global_batch 16 (dp = 2)."""
    recipe = load_recipe()  # neither given: the pipeline's default, one micro-batch per stage
    assert batching(recipe) == (16, 4, 2) and recipe.parallel.pp_microbatches == 2
    recipe = load_recipe(None, ["train.grad_accum=4"])
    assert batching(recipe) == (16, 2, 4) and recipe.parallel.pp_microbatches == 4
    recipe = load_recipe(None, ["train.micro_batch_size=1"])
    assert batching(recipe) == (16, 1, 8) and recipe.parallel.pp_microbatches == 8
    recipe = load_recipe(None, ["pp_microbatches=4"])
    assert batching(recipe) == (16, 2, 4) and recipe.parallel.pp_microbatches == 4
    recipe = load_recipe(None, ["pp_microbatches=4", "train.grad_accum=4"])
    assert recipe.parallel.pp_microbatches == 4


def test_pipeline_conflicts_name_both_fields():
    with pytest.raises(ConfigError, match=r"train.grad_accum=2 but pp_microbatches=4.*Fix:"):
        load_recipe(None, ["pp_microbatches=4", "train.grad_accum=2"])
    with pytest.raises(ConfigError, match=r"train.grad_accum=1 .*pp_microbatches=1: 1f1b needs at least pp=2"):
        load_recipe(None, ["train.grad_accum=1"])
    with pytest.raises(ConfigError, match=r"pp_microbatches=3: .*8 rows per rank.*Fix:"):
        load_recipe(None, ["pp_microbatches=3"])


def test_the_loop_splits_rows_only_without_a_pipeline(tmp_path):
    """The command line cuts a rank's batch into grad_accum micro-batches unless the model runs them itself (a
    pipeline's schedule: ``pmodel.tokens.microbatches_inside``, from the ``ultrascale_cost_schedule`` hook)."""
    from types import SimpleNamespace

    from ultrascale_plugins.cli.loop import micro_batches
    from ultrascale_plugins.core.tokens import TokenAccounting

    def model_for(recipe):  # what the recipe's ParallelModel answers
        stand_in = SimpleNamespace(pm=recipe.parallel.registry, config=recipe.parallel)
        return SimpleNamespace(tokens=SimpleNamespace(
            microbatches_inside=TokenAccounting.microbatches_inside.fget(stand_in)))

    batch = {"input_ids": torch.arange(4 * 5).view(4, 5), "attention_mask": torch.ones(4, 5), "note": "kept"}
    recipe = load_recipe(tiny(tmp_path), ["train.grad_accum=2"])
    chunks = micro_batches(batch, recipe, model_for(recipe))
    assert [c["input_ids"].tolist() for c in chunks] == [batch["input_ids"][:2].tolist(),
                                                         batch["input_ids"][2:].tolist()]
    assert all(c["attention_mask"].shape == (2, 5) and c["note"] == "kept" for c in chunks)
    recipe = load_recipe(tiny(tmp_path))
    assert micro_batches(batch, recipe, model_for(recipe)) == [batch]
    recipe = load_recipe(None, ["train.grad_accum=4"])  # pp=2: the schedule splits
    assert model_for(recipe).tokens.microbatches_inside == 4 and micro_batches(batch, recipe, model_for(recipe)) == [batch]


# ---- accumulation trains exactly like the whole batch --------------------------------------------------------
def _train(tmp_path, name, *overrides):
    metrics, ckpt = tmp_path / f"{name}.json", tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "train", str(tiny(tmp_path)),
                           "--set", "train.max_grad_norm=100",
                           "--set", f"train.save_dir={ckpt}", *overrides,
                           "--metrics", str(metrics)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(metrics.read_text()), _flat_state(ckpt / "step-00000003", tmp_path / f"{name}.pt")


def _flat_state(checkpoint, out):
    """Model weights and AdamW moments of a sharded checkpoint, gathered into one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, out)
    flat = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, torch.Tensor) and v.is_floating_point():
                flat[prefix + k] = v

    walk(torch.load(out, weights_only=True), "")
    return flat


@pytest.mark.slow
def test_grad_accum_trains_like_the_whole_batch(tmp_path):
    """2 processes of ZeRO-3 (FSDP no_sync), global batch 8: 4 rows per rank in one micro-batch vs 2 x 2 rows.
    Same per-step losses, validation loss, weights and AdamW moments. The moments pin the gradient itself: AdamW
    updates and clipping hide a uniform gradient scale, so a wrong weighting (loss_scale=1 instead of
    1/grad_accum: gradients x2) would still match the losses but double every exp_avg. Clipping is therefore
    kept out of play (max_grad_norm=100: the norm is computed, nothing is clipped): at max_grad_norm=1 both runs'
    gradients are clipped to the same norm and that mistake passes (checked)."""
    out1, whole, state1 = _train(tmp_path, "whole", "--set", "train.grad_accum=1")
    out2, accum, state2 = _train(tmp_path, "accum", "--set", "train.grad_accum=2")
    assert "batch 8 = 2 x micro-batch 4 x 1" in out1 and "batch 8 = 2 x micro-batch 2 x 2" in out2
    assert len(whole["losses"]) == 3
    for a, b in zip(whole["losses"], accum["losses"]):
        assert abs(a - b) <= 1e-5, (whole["losses"], accum["losses"])
    assert abs(whole["val_loss"] - accum["val_loss"]) <= 1e-5
    assert state1.keys() == state2.keys() and any(".exp_avg" in k for k in state1)
    for key, a in state1.items():
        b = state2[key]
        if key.startswith("model."):
            assert (a - b).abs().max() <= 1e-5, key
        else:  # exp_avg, exp_avg_sq: relative to the tensor's scale
            assert (a - b).abs().max() <= 1e-4 * a.abs().max() + 1e-12, key


class _Recorder:
    """A ParallelModel's accumulation surface: token counts over the rows, no_sync; records which calls synced."""

    def __init__(self):
        self.synced = []
        self.inside = False
        self.tokens = self  # pmodel.tokens: the token accounting's shares

    def shares(self, chunks):
        counts = [int((c["labels"] != -100).sum()) for c in chunks]
        return [c / sum(counts) for c in counts]

    def no_sync(self):
        import contextlib

        @contextlib.contextmanager
        def local():
            self.inside = True
            yield
            self.inside = False
        return local()

    def step(self, chunk, weight):
        self.synced.append(not self.inside)
        return float(chunk["loss"])


def test_the_accumulation_window_weights_and_syncs_every_front_end_alike():
    """``AccumulationWindow``: by tokens (the command line, the Trainer) the window's loss is the token mean, and
    only the last micro-batch's backward syncs; evenly (Lightning, Accelerate) each weighs 1/n; ``take`` hands a
    framework's per-call steps the weights in order, then None."""
    from ultrascale_plugins.core.accumulation import AccumulationWindow

    labels = [torch.tensor([1, 2, -100, -100]), torch.tensor([1, 2, 3, 4]), torch.tensor([5, -100, -100, -100])]
    # a micro-batch's loss is the mean over its own valid tokens: 3.0 over 2 tokens, 1.0 over 4, 6.0 over 1
    chunks = [{"labels": l, "loss": v} for l, v in zip(labels, (3.0, 1.0, 6.0))]
    pmodel = _Recorder()
    window = AccumulationWindow.by_tokens(pmodel, chunks)
    assert window.weights == [2 / 7, 4 / 7, 1 / 7]
    assert window.run(pmodel, chunks, pmodel.step) == pytest.approx((3.0 * 2 + 1.0 * 4 + 6.0 * 1) / 7)
    assert pmodel.synced == [False, False, True]
    assert window.combine([3.0, 1.0, 6.0]) == pytest.approx(16 / 7)
    even = AccumulationWindow.even(4)
    assert [even.take() for _ in range(5)] == [0.25, 0.25, 0.25, 0.25, None]
