"""Lightning: real ``Trainer.fit`` on CPU processes with every registered strategy name and explicit layouts,
step by step against ``strategy="auto"`` on one device (fp32 within 1e-5)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import torchrun
from ultrascale_plugins.distributed.supervisor import free_port

WORKER = Path(__file__).parent / "lightning_worker.py"
NAMES = ["ultrascale", "ultrascale_zero3", "ultrascale_zero2", "ultrascale_tp", "ultrascale_tp_sp", "ultrascale_pp",
         "ultrascale_cp"]
TOL = 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The worker's initial model as a save_pretrained directory (for the pretrained-weights runs)."""
    from lightning_worker import ARCH
    from models import make_model

    path = tmp_path_factory.mktemp("lightning") / "hf"
    make_model(ARCH, seed=0).save_pretrained(path, max_shard_size="200KB")
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning") / "reference.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(WORKER), "reference", str(out)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def run(nproc, tmp_path, hf_dir, *names, env=None):
    """{run name: its results}, and the job's standard error."""
    out = tmp_path / f"runs{nproc}.json"
    proc = torchrun(nproc, WORKER, "runs", str(out), *names, env={"HF_DIR": str(hf_dir), **(env or {})})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return json.loads(out.read_text()), proc.stderr


def layout_lines(stderr: str, world: int) -> list[str]:
    """The strategy's ``ultrascale: N processes, layout ...`` lines, in the order of the fits."""
    return [line for line in stderr.splitlines() if line.startswith(f"ultrascale: {world} processes, layout ")]


def assert_parity(results, reference, names, tol=TOL):
    from lightning_worker import RUNS, reference_key

    for name in names:
        ref = reference[reference_key(RUNS[name][1])]
        got = results[name]
        assert len(got["losses"]) == len(ref["losses"]) == 6, (name, got)
        diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
        assert diff <= tol, (name, diff, got["losses"], ref["losses"])
        assert abs(got["val_loss"] - ref["val_loss"]) <= tol, (name, got["val_loss"], ref["val_loss"])


@pytest.mark.slow
def test_two_devices_every_name_accumulation_precision_pretrained(tmp_path, reference, hf_dir):
    exact = NAMES + ["zero3_accumulate2", "pp_accumulate2", "pretrained_meta_tp_sp", "pretrained_init_from_zero3",
                     "zero1", "tp_fused", "tp_sp_foreach", "tp_sp_chunked", "peft_zero3", "ultrascale_ep", "ep2_zero2",
                     "zero3_offload_step_in_backward"]
    names = [*exact, "zero3_bf16_mixed", "tp_bf16_true"]
    results, stderr = run(2, tmp_path, hf_dir, *names)
    assert_parity(results, reference, exact)
    # the layout each fit applied, logged once (rank 0), the presets' as well as explicit ones, with the name
    # that chose it
    lines = dict(zip(names, layout_lines(stderr, 2), strict=True))
    assert lines["ultrascale_tp"].endswith('layout tp=2, chosen by strategy="ultrascale_tp", model llama 0.31M params')
    assert 'dp_shard=2 (ZeRO-3) x experts over efsdp=1, ep=2 (the ranks of dp_shard*cp*tp), chosen by strategy="' \
           'ultrascale_ep", model qwen3_moe' in lines["ultrascale_ep"]
    assert "dp_shard=2 (ZeRO-2) x experts over efsdp=1, ep=2" in lines["ep2_zero2"]
    assert "chosen by" not in lines["ep2_zero2"]  # an explicit UltraScaleStrategy(...)
    assert 'layout dp_shard=2 (ZeRO-3) x bf16, chosen by strategy="ultrascale_zero3"' in lines["zero3_bf16_mixed"]
    # the memory features a fit turned on are said with its layout (ParallelDims.describe)
    assert "layout dp_shard=2 (ZeRO-3) x cpu_offload x optimizer_in_backward, model" in \
        lines["zero3_offload_step_in_backward"]
    assert "layout tp=2 + sequence parallel x chunked_loss=16, model" in lines["tp_sp_chunked"]
    assert 'layout tp=2 x param_dtype=bf16, chosen by strategy="ultrascale_tp"' in lines["tp_bf16_true"]
    # expert parallel on the MoE: strategy="ultrascale_ep" picked ep=2 (the devices of the node) under ZeRO-3, and
    # UltraScaleStrategy(ep=2, zero_stage=2) ran as given
    picked = results["ultrascale_ep"]["layout"]
    assert (picked["ep"], picked["dp_shard"], picked["zero_stage"]) == (2, 2, 3), picked
    assert (results["ep2_zero2"]["layout"]["ep"], results["ep2_zero2"]["layout"]["zero_stage"]) == (2, 2)
    # bf16 against Lightning's own bf16 on one device: close, not equal
    assert_parity(results, reference, ["zero3_bf16_mixed", "tp_bf16_true"], tol=5e-3)


@pytest.mark.slow
@pytest.mark.sweep  # four processes of Lightning: benchmarks/sweep_tests.py; the same names on two devices in CI
def test_four_devices_every_name_and_pipeline_by_tensor_and_an_outside_plugin(tmp_path, reference, hf_dir):
    """Every strategy name (ultrascale_cp: context parallel over the 4 devices) and UltraScaleStrategy(cp=2,
    cp_method="ulysses", dp_shard=2) match one device. With the plugin outside the package installed
    (tests/outside_plugin): its acme_dp field in UltraScaleStrategy(acme_dp=2, dp_shard=2) matches one device, and
    its presence changes no other run."""
    from conftest import outside_plugin_env

    names = NAMES + ["pp2_tp2", "pp2_tp2_fused", "qwen3_dp2_tp2", "cp2_ulysses_dp2", "outside_acme_dp2_zero3_dp2"]
    env = {"PYTHONPATH": outside_plugin_env()["PYTHONPATH"]}
    assert_parity(run(4, tmp_path, hf_dir, *names, env=env)[0], reference, names)


@pytest.mark.slow
def test_model_checkpoint_and_resume_in_the_same_and_another_layout(tmp_path, reference):
    out = tmp_path / "resume.json"
    proc = torchrun(2, WORKER, "resume", str(out), str(tmp_path / "ckpt"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    r = json.loads(out.read_text())
    expected = reference["{}"]["losses"]
    assert r["saved"] == ["epoch=0-step=3.ckpt"]
    assert (tmp_path / "ckpt" / "epoch=0-step=3.ckpt" / "ultrascale.json").is_file()  # a sharded directory
    assert r["first"]["losses"] == pytest.approx(expected[:3], abs=TOL)
    for layout in ("same_layout", "tp"):
        assert r[layout]["losses"] == pytest.approx(expected[3:], abs=TOL), layout


@pytest.mark.slow
def test_two_nodes_of_two_processes(tmp_path, reference, hf_dir):
    """Two torchrun launches sharing one rendezvous, as two machines would: TP within a "node", ZeRO-3 across."""
    port, out = free_port(), tmp_path / "nodes.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR", "HF_DIR": str(hf_dir)}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
                               str(node), "--nproc_per_node", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                               f"127.0.0.1:{port}", "--max_restarts", "0", str(WORKER), "runs", str(out),
                               "ultrascale_tp"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for node in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-6000:]
    assert_parity(json.loads(out.read_text()), reference, ["ultrascale_tp"])


def refused_trainer(capsys, **kwargs) -> str:
    """The one line ``L.Trainer(**kwargs)`` refuses with (status 2, no exception), without its prefix."""
    import lightning.pytorch as L

    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        L.Trainer(accelerator="cpu", logger=False, **kwargs)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("ultrascale: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0].removeprefix("ultrascale: error: ")


def test_invalid_layout_fails_when_the_trainer_is_built(capsys):
    """Before any other process starts: with several devices one line and status 2, as every front end refuses;
    with one device (no other process to say it again) the ConfigError itself, for a caller to catch."""
    import re

    import lightning.pytorch as L

    from ultrascale_plugins.interface.config import ConfigError
    from ultrascale_plugins.integrations.lightning import UltraScaleStrategy

    assert "does not divide the world size 3" in refused_trainer(capsys, devices=3, strategy=UltraScaleStrategy(tp=2))
    assert refused_trainer(capsys, devices=2, strategy="ultrascale_tp", precision="16-true").startswith(
        "precision='16-true': not available with the ultrascale strategy. Fix: use one of")
    # expert parallel: ep must divide the dp_shard*cp*tp ranks it borrows
    assert re.match(r"ep=3: .* 4\*1\*1 = 4, which 3 does not divide\. Fix: pick an ep that",
                    refused_trainer(capsys, devices=4, strategy=UltraScaleStrategy(ep=3)))
    with pytest.raises(ConfigError, match="precision=.16-true."):
        L.Trainer(accelerator="cpu", devices=1, strategy="ultrascale_tp", precision="16-true", logger=False)
    with pytest.raises(ConfigError, match="does not divide the world size 1"):
        L.Trainer(accelerator="cpu", devices=1, strategy=UltraScaleStrategy(tp=2), logger=False)


def test_a_misspelled_ultrascale_strategy_name_is_refused_with_the_nearest_registered_one(capsys, monkeypatch):
    """Trainer(strategy="ultrascale_zer3"): Lightning would list a few of its own names; a name that starts with
    "ultrascale" is one of the package's misspelled, refused naming the nearest registered one (in a torchrun
    worker: one line from rank 0, status 2). Any other unknown name keeps Lightning's own error; so does each
    name in the standalone pytorch_lightning."""
    import lightning.pytorch as L

    import ultrascale_plugins.integrations.lightning  # noqa: F401 - registers the names
    from ultrascale_plugins.interface.config import ConfigError

    for name, near in (("ultrascale_zer3", "ultrascale_zero3"), ("ultrascale-tp", "ultrascale_tp"),
                       ("ULTRASCALE_TP_SP2", "ultrascale_tp_sp")):
        with pytest.raises(ConfigError, match=rf"^strategy='{name}': no strategy of that name is registered\. Fix: "
                                              rf"did you mean '{near}'\?"):
            L.Trainer(accelerator="cpu", devices=1, strategy=name, logger=False)
    with pytest.raises(ValueError, match="You selected an invalid strategy name: `strategy='dpp'`") as plain:
        L.Trainer(accelerator="cpu", devices=1, strategy="dpp", logger=False)
    assert not isinstance(plain.value, ConfigError)
    import pytorch_lightning

    with pytest.raises(ConfigError, match="did you mean 'ultrascale_pp'"):
        pytorch_lightning.Trainer(accelerator="cpu", devices=1, strategy="ultrascale_ppp", logger=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert refused_trainer(capsys, devices=2, strategy="ultrascale_zer3") == \
        "strategy='ultrascale_zer3': no strategy of that name is registered. Fix: did you mean 'ultrascale_zero3'?"


def test_expert_parallel_is_checked_against_the_model_before_the_process_group(capsys):
    """What needs the model (its experts, and zero_stage 2 or 3 for them) is checked when fit() reaches the
    strategy's setup_environment, before this process joins a process group; strategy="ultrascale_ep" picks the
    devices of a node for ep, halved until it divides the experts and the world."""
    import re

    import lightning.pytorch as L
    import torch

    from lightning_worker import CausalLM
    from models import make_config

    import ultrascale_plugins as us
    from ultrascale_plugins.interface.config import ConfigError
    from ultrascale_plugins.integrations.lightning import UltraScaleStrategy

    assert re.match(r"zero_stage=1: ep=2 shards the experts.* Fix: use zero_stage: 2 or 3",
                    refused_trainer(capsys, devices=2, strategy=UltraScaleStrategy(ep=2, zero_stage=1)))
    assert not torch.distributed.is_initialized()  # refused from the layout alone, before the model is known
    cases = [(UltraScaleStrategy(ep=2), "llama", r"^ep=2: model type 'llama' has no routed experts\. Fix: use ep: 1"),
             ("ultrascale_ep", "llama", r"^ep=2: model type 'llama' has no routed experts")]
    for strategy, arch, error in cases:
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
        trainer.strategy.connect(CausalLM(arch=arch))
        trainer.strategy._init_dist_connection = lambda *a, **k: pytest.fail("a process group was started first")
        with pytest.raises(ConfigError, match=error):
            trainer.strategy.setup_environment()
        assert not torch.distributed.is_initialized()
    layout = us.get_plugin_manager().presets()["ep"].layout
    moe = make_config("qwen3_moe")  # 8 experts
    assert layout(4, 4, moe) == {"dp_shard": 4, "ep": 4, "zero_stage": 3}
    assert layout(16, 8, moe)["ep"] == 8 and layout(12, 4, moe)["ep"] == 4 and layout(2, 1, moe)["ep"] == 1
    assert layout(6, 6, moe)["ep"] == 2  # the largest that divides the 8 experts and the 6 devices


# sweep: layout: auto under torchrun and the other front ends' recipe scripts run in CI
@pytest.mark.slow
@pytest.mark.sweep
def test_recipe_script_through_lightnings_own_launcher(tmp_path):
    """`python finetune.py --devices 2 --strategy ultrascale` (layout: auto): Lightning starts the processes; the
    planner's choice is logged once, saying what it assumed; logger, val_check_interval, max_steps,
    ModelCheckpoint and resume behave as usual, and the checkpoint exports to an HF directory."""
    import csv

    script = Path(__file__).parent.parent / "recipes" / "lightning" / "finetune.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = [sys.executable, str(script), "--strategy", "ultrascale", "--devices", "2",
              "--val-check-interval", "3", "--out", str(tmp_path)]
    proc = subprocess.run([*common, "--max-steps", "6"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    chose = [line for line in proc.stderr.splitlines() if "layout: auto chose" in line]
    assert len(chose) == 1 and "assumed auto_seq_len=" in chose[0], proc.stderr[-4000:]
    applied = layout_lines(proc.stderr, 2)  # and the layout that ran, once for the job
    assert len(applied) == 1 and ', chosen by strategy="ultrascale", model llama ' in applied[0], applied
    last = tmp_path / "ckpt" / "last.ckpt"
    assert (last / "ultrascale.json").is_file()
    proc = subprocess.run([*common, "--max-steps", "9", "--resume", str(last)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [r for f in sorted(tmp_path.glob("logs/version_*/metrics.csv")) for r in csv.DictReader(f.open())]
    train_steps = sorted(int(r["step"]) for r in rows if r.get("train_loss"))
    val_steps = sorted(int(r["step"]) for r in rows if r.get("val_loss"))
    assert train_steps == list(range(9)) and val_steps == [2, 5, 8], (train_steps, val_steps)
    from ultrascale_plugins.checkpoints.export import export_hf

    export_hf(last, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("built", ["in_init", "in_configure_model"])
def test_a_refused_layout_is_said_once_through_lightnings_own_launcher(tmp_path, hf_dir, built):
    """`python script.py` with Trainer(devices=2, strategy=UltraScaleStrategy(ep=2)) on a dense model: the user's
    process is rank 0 and Lightning's launcher runs the script again for rank 1. A model the LightningModule holds
    from __init__ is refused before rank 1 starts; one built in configure_model is refused by both ranks after the
    process group (rank 1 first, by 6 s: Lightning's process observer would kill rank 0 if rank 1 ended then), and
    rank 0 ends rank 1. Either way: one line, status 2, no traceback, and no process of the job left when the
    command returns (none prints after it)."""
    import psutil

    marker = str(tmp_path / "refused")  # in the command line of every rank of this job
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DIR": str(hf_dir)}
    proc = subprocess.Popen([sys.executable, str(WORKER), "refuse", marker, built], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        status = proc.wait(timeout=600)
        left = [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]
        for p in left:
            p.kill()
        _, err = proc.communicate(timeout=120)  # to the end: what any rank printed after the command returned too
    finally:
        proc.kill()
    errors = [line for line in err.splitlines() if line.startswith("ultrascale: error: ")]
    assert (status, [p.pid for p in left]) == (2, []), err[-6000:]
    assert errors == ["ultrascale: error: ep=2: model type 'llama' has no routed experts. Fix: use ep: 1"], err[-6000:]
    assert "Traceback" not in err, err[-6000:]


PL_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from models import make_model, padded_batches
import ultrascale_plugins.integrations.lightning
import pytorch_lightning as PL
from torch.utils.data import DataLoader
batches = padded_batches(3)
rows = [{{k: v[i] for k, v in b.items()}} for b in batches for i in range(8)]
class M(PL.LightningModule):
    def __init__(self):
        super().__init__(); self.model = make_model("llama"); self.losses = []
    def training_step(self, b, i):
        loss = self.model(**b).loss; self.losses.append(loss.item()); return loss
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
m = M()
PL.Trainer(accelerator="cpu", devices=1, strategy="ultrascale_zero3", max_steps=3, logger=False,
           enable_checkpointing=False, enable_progress_bar=False, use_distributed_sampler=False).fit(m, DataLoader(rows, batch_size=8))
ref, opt, want = make_model("llama"), None, []
opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
for b in batches:
    loss = ref(**b).loss; want.append(loss.item()); loss.backward(); opt.step(); opt.zero_grad()
assert max(abs(a - b) for a, b in zip(m.losses, want)) < 1e-5, (m.losses, want)
print("ok")
"""


@pytest.mark.skipif(not __import__("importlib").util.find_spec("pytorch_lightning"), reason="the standalone pytorch_lightning package is not installed (lightning.pytorch is tested above)")
def test_standalone_pytorch_lightning_package_gets_the_names_too():
    code = PL_SCRIPT.format(tests=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
