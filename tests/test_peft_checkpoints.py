"""Checkpoints and exports of PEFT models: adapter-only sharded checkpoints that resume exactly (ZeRO-3 bit for
bit, DDP and ZeRO-1 within 1e-5) and refuse another base, and ``ultrascale export --adapter`` / ``--merged``
(tests/peft_checkpoint_worker.py: one 2-process launch), plus DoRA / rsLoRA / LoRA-on-the-embedding merges from a
one-process checkpoint."""
import json
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parent / "peft_checkpoint_worker.py"
TOL = 1e-5  # fp32, as tests/test_peft.py


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from conftest import torchrun

    out = tmp_path_factory.mktemp("peft_ckpt")
    proc = torchrun(2, WORKER, str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return {**json.loads((out / "results.json").read_text()), "dir": out}


@pytest.fixture(scope="module")
def run_tp_sp(tmp_path_factory):
    """The run under ZeRO-3 x TP + SP on four processes, checkpointed after step 4."""
    from conftest import torchrun

    out = tmp_path_factory.mktemp("peft_ckpt_tp_sp")
    proc = torchrun(4, WORKER, str(out), "tp_sp")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return {**json.loads((out / "results.json").read_text()), "dir": out}


def step4(run) -> Path:
    return run["dir"] / "ckpt" / "step-00000004"


def base(run):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(run["dir"] / "base", attn_implementation="sdpa")


def export(*args) -> int:
    from ultrascale_plugins.cli.main import main

    return main(["export", *map(str, args)])


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_not_the_frozen_base(run):
    assert set(run["model_tensors"]) == set(run["trainable"])  # the LoRA matrices and the head's trained copy
    assert any("modules_to_save" in n for n in run["model_tensors"])
    assert not set(run["frozen"]) & set(run["model_tensors"])
    assert {n.rsplit(".", 1)[0] for n in run["optim_tensors"]} == set(run["trainable"])  # SGD's momentum buffers
    assert run["full_model_tensors"] == len(run["frozen"]) + len(run["trainable"])
    assert run["adapter_only_bytes"] < 0.5 * run["full_bytes"], (run["adapter_only_bytes"], run["full_bytes"])


@pytest.mark.slow
def test_resume_is_bit_for_bit_in_the_same_layout_and_within_tolerance_in_others(run):
    after = run["losses"][2:]
    assert run["resumed"]["zero3"]["losses"] == after and run["resumed"]["zero3"]["adapters_equal"]
    for layout in ("ddp", "zero1"):
        got = run["resumed"][layout]
        assert got["data_position"] == 2
        assert max(abs(a - b) for a, b in zip(got["losses"], after)) <= TOL, (layout, got, after)
    # the base fingerprint comes out the same from the ranks' shards in every layout (rounding only)
    assert all(d <= 1e-12 for d in run["fingerprint_rel_diff"].values()), run["fingerprint_rel_diff"]
    # and the run is the one-process PEFT run
    assert max(abs(a - b) for a, b in zip(run["losses"], run["ref_losses"])) <= TOL


@pytest.mark.slow
def test_another_base_or_other_adapters_are_refused_before_anything_is_read(run):
    nudged = run["refused"]["nudged_base"]
    assert nudged["error"] is not None, "a base one weight away from the checkpoint's was resumed onto"
    assert "another frozen base" in nudged["error"] and "layers.1.mlp.down_proj.base_layer.weight" in nudged["error"]
    assert str(run["dir"] / "base") in nudged["error"]  # the base to build on, as PEFT recorded it
    other = run["refused"]["other_rank"]
    assert other["error"] is not None and "r is 8 here, 4 in the checkpoint" in other["error"]
    for refused in (nudged, other):
        assert refused["unchanged"] and refused["no_optimizer_state"]


@pytest.mark.slow
def test_a_full_checkpoint_written_before_still_loads(run):
    assert run["full_checkpoint_loads"]


@pytest.mark.slow
def test_plain_export_is_refused_and_points_to_adapter_and_merged(run, tmp_path):
    from ultrascale_plugins.checkpoints.export import export_hf
    from ultrascale_plugins.checkpoints.errors import CheckpointError

    with pytest.raises(CheckpointError, match="not parameters of a llama model.*export --adapter.*export --merged"):
        export_hf(step4(run), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_export_adapter_gives_the_runs_adapters_in_pefts_files(run, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    assert export(step4(run), tmp_path / "adapter", "--adapter") == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head"]
    files = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(files) == len(run["trainable"])  # every adapter, none of the base

    model = PeftModel.from_pretrained(base(run), tmp_path / "adapter").eval()
    state = model.state_dict()
    run_adapters = torch.load(run["dir"] / "run_adapters.pt")
    loaded = {k: state[k] for k in run_adapters}
    assert max_diff(loaded, run_adapters) == 0.0  # exactly the run's gathered adapters
    assert max_diff(loaded, torch.load(run["dir"] / "ref_adapters.pt")) <= TOL  # the one-process run's
    with torch.no_grad():
        loss = model(**torch.load(run["dir"] / "eval_batch.pt")).loss.item()
    assert abs(loss - run["eval_loss"]) <= TOL, (loss, run["eval_loss"])


@pytest.mark.slow
def test_export_adapter_of_a_zero3_tp_sp_run_gathers_every_shard(run_tp_sp, tmp_path):
    """Adapters sharded over ZeRO-3 and TP (B by rows after column-wise layers, A by columns before row-wise ones):
    the export equals the run's gathered adapters exactly, the one-process run's within 1e-5, and reloaded by PEFT
    it gives the run's loss."""
    from peft import PeftModel

    r = run_tp_sp
    assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= TOL
    assert export(step4(r), tmp_path / "adapter", "--adapter") == 0
    model = PeftModel.from_pretrained(base(r), tmp_path / "adapter").eval()
    state = model.state_dict()
    run_adapters = torch.load(r["dir"] / "run_adapters.pt")
    assert set(run_adapters) == set(r["trainable"])
    loaded = {k: state[k] for k in run_adapters}
    assert max_diff(loaded, run_adapters) == 0.0
    assert max_diff(loaded, torch.load(r["dir"] / "ref_adapters.pt")) <= TOL
    with torch.no_grad():
        loss = model(**torch.load(r["dir"] / "eval_batch.pt")).loss.item()
    assert abs(loss - r["eval_loss"]) <= TOL, (loss, r["eval_loss"])


@pytest.mark.slow
def test_export_merged_gives_a_plain_model_with_the_runs_logits(run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # no --base: the pretrained directory PEFT recorded when the run built its model
    assert export(step4(run), tmp_path / "merged", "--merged") == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="sdpa").eval()
    assert not any("lora" in k or "modules_to_save" in k for k in merged.state_dict())
    assert export(step4(run), tmp_path / "adapter", "--adapter") == 0
    peft = PeftModel.from_pretrained(base(run), tmp_path / "adapter").eval()
    batch = torch.load(run["dir"] / "eval_batch.pt")
    with torch.no_grad():
        out, ref = merged(**batch), peft(**batch)
    assert (out.logits - ref.logits).abs().max().item() <= TOL
    assert abs(out.loss.item() - run["eval_loss"]) <= TOL


@pytest.mark.slow
def test_export_merged_refuses_another_base(run, tmp_path, capsys):
    nudged = base(run)
    with torch.no_grad():
        nudged.model.layers[0].self_attn.q_proj.weight[0, 0] += 1e-4
    nudged.save_pretrained(tmp_path / "nudged")
    assert export(step4(run), tmp_path / "merged", "--merged", "--base", tmp_path / "nudged") == 2
    err = capsys.readouterr().err
    assert "is not the frozen base" in err and "layers.0.self_attn.q_proj.base_layer.weight" in err, err
    assert not (tmp_path / "merged").exists()  # nothing written
    assert export(step4(run), tmp_path / "a", "--base", tmp_path / "nudged") == 2  # --base belongs to --merged


@pytest.fixture
def one_process():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("extra", [
    {"use_dora": True, "modules_to_save": ["lm_head"]},
    {"target_modules": ["embed_tokens", "q_proj", "v_proj"], "use_rslora": True},
], ids=["dora_head", "embedding_rslora"])
def test_export_merged_folds_dora_rslora_and_the_embedding_in(extra, tmp_path, one_process):
    """One process (the export reads any layout alike): adapters trained away from their initialization, then
    --merged against the PEFT model's own logits, and --adapter against its adapters. The base (from_config: PEFT
    records no path) comes from the --init-from the command line records with its checkpoints, or from --base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import ultrascale_plugins as us
    from models import padded_batches
    from peft_worker import base_model, peft_model
    from ultrascale_plugins.checkpoints.export import export_form
    from ultrascale_plugins.checkpoints.errors import CheckpointError
    from ultrascale_plugins.checkpoints.sharded import save_checkpoint

    base_model("llama").save_pretrained(tmp_path / "base")
    pmodel = us.parallelize(peft_model("llama", extra), us.ParallelConfig())
    opt = pmodel.build_optimizer(torch.optim.AdamW, lr=2e-2)
    for batch in padded_batches(3):
        pmodel.train_step(batch)
        opt.step()
        opt.zero_grad()
    recorded = "use_dora" in extra
    path = save_checkpoint(pmodel, opt, tmp_path / "ckpt", step=3,
                           extra={"init_from": str(tmp_path / "base")} if recorded else None)
    if recorded:
        export_form(path, tmp_path / "merged", "merged")
    else:
        with pytest.raises(CheckpointError, match="records no pretrained base.*--base DIR"):
            export_form(path, tmp_path / "merged", "merged")
        assert not (tmp_path / "merged").exists()
        export_form(path, tmp_path / "merged", "merged", base=tmp_path / "base")
    export_form(path, tmp_path / "adapter", "adapter")
    model = pmodel.module.eval()
    batch = padded_batches(4)[3]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    reloaded = PeftModel.from_pretrained(base_model("llama"), tmp_path / "adapter").eval()
    with torch.no_grad():
        want = model(**batch)
        moved = (want.logits - base_model("llama").eval()(**batch).logits).abs().max().item()
        assert moved > 1e-2  # the adapters do something the merge has to reproduce
        assert (merged(**batch).logits - want.logits).abs().max().item() <= TOL
        assert (reloaded(**batch).logits - want.logits).abs().max().item() == 0.0
