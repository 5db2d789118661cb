"""Offloaded states (``cpu_offload``: FSDP2's CPUOffloadPolicy) and the optimizer step inside the backward
(``optimizer_in_backward``). On a CPU the host is the device, so what is tested here is the plumbing and the
arithmetic: each trains exactly as the same layout without it (tests/step_in_backward_worker.py; the offloaded
layouts' parity with one process: tests/parity_cases.py ``offload_*``), a resume, and the refusals, in every front
end. What they save on a GPU is measured by the GPU suite's memory section."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ultrascale_plugins as us
from conftest import torchrun

TESTS = Path(__file__).parent


@pytest.fixture(autouse=True)
def _no_world_of_one_left():
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.slow
def test_stepping_inside_the_backward_and_offloaded_states_train_as_without_them(tmp_path):
    """ZeRO-3, ZeRO-2 and ZeRO-3 offloaded, AdamW foreach and fused with weight decay and a schedule: the same
    losses and weights with the step inside the backward as after it, no gradient left once a backward ends,
    and a run resumed from a checkpoint equal to the uninterrupted one."""
    out = tmp_path / "out.json"
    proc = torchrun(2, TESTS / "step_in_backward_worker.py", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    results = json.loads(out.read_text())
    assert len(results) == 6
    for name, r in results.items():
        assert r["loss_diff"] <= 1e-6 and r["weight_diff"] <= 1e-6, (name, r)
        assert not r["grads_left_in_backward"] and r["base_grads_left"] and r["grads_consumed"], (name, r)
        assert r["resume_loss_diff"] <= 1e-6 and r["resume_weight_diff"] <= 1e-6, (name, r)
        assert r["param_devices"] == ["cpu"], (name, r)


@pytest.mark.parametrize("fields, world, said", [
    ({"optimizer_in_backward": True, "zero_stage": 1}, 2,
     "optimizer_in_backward=True: optimizer_in_backward=true steps each parameter inside the backward.*Fix: use "
     "zero_stage: 2 or 3, or optimizer_in_backward: false"),
    ({"optimizer_in_backward": True, "pp": 2}, 2, "a pipeline accumulates.*Fix: use pp: 1"),
    ({"cpu_offload": True, "zero_stage": 1}, 2, "cpu_offload=True: .*zero_stage=1 does not use FSDP2.*Fix: use "
     "zero_stage: 2 or 3, or cpu_offload: false"),
    ({"cpu_offload": True, "tp": 2}, 2, "cpu_offload=True: tensor parallel with one data-parallel rank.*Fix: use "
     "dp_shard: 2 or more beside tp"),
])
def test_a_layout_they_cannot_run_is_one_line_naming_the_field(fields, world, said):
    with pytest.raises(us.ConfigError, match=said) as exc:
        us.validate(us.ParallelConfig(**fields), None, world)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("micro_batches, clip, said", [
    (2, None, "optimizer_in_backward=true with 2 micro-batches per optimizer step.*Fix: one micro-batch per step"),
    (1, 1.0, "optimizer_in_backward=true with gradient clipping to a global norm of 1.*Fix: turn clipping off"),
])
def test_the_loop_of_every_front_end_is_checked(micro_batches, clip, said):
    from ultrascale_plugins.core.engine import validate_loop

    config = us.ParallelConfig(optimizer_in_backward=True)
    with pytest.raises(us.ConfigError, match=said):
        validate_loop(config, micro_batches, clip)
    validate_loop(config, 1, 0.0)  # one micro-batch, no clipping: runs


def test_accumulation_or_clipping_at_run_time_is_refused_not_skipped():
    """Called anyway (a loop of one's own): ``no_sync`` and ``clip_grad_norm_`` refuse, where they would
    otherwise step each micro-batch alone or clip nothing."""
    import torch

    from models import make_model

    pmodel = us.parallelize(make_model("llama"), us.ParallelConfig(optimizer_in_backward=True))
    opt = pmodel.prepare_optimizer(torch.optim.AdamW(list(pmodel.parameters()), lr=1e-3))
    ids = torch.randint(0, 100, (2, 8))
    pmodel.train_step({"input_ids": ids, "labels": ids})
    assert all(p.grad is None for p in pmodel.parameters())
    opt.step()
    with pytest.raises(us.ConfigError, match="gradient clipping: optimizer_in_backward=true steps each parameter"):
        pmodel.clip_grad_norm_(1.0)
    with pytest.raises(us.ConfigError, match="gradient accumulation"):
        with pmodel.no_sync():
            pass


def test_front_ends_refuse_their_accumulation_and_clipping_before_training(tmp_path):
    """The recipe's default max_grad_norm (1.0), Accelerate's gradient_accumulation_steps, the Trainer's default
    max_grad_norm (1.0) and Lightning's gradient_clip_val: each refused before a step, naming the setting."""
    from accelerate.state import AcceleratorState
    from transformers import TrainingArguments

    from models import make_model
    from ultrascale_plugins.cli.main import check_recipe
    from ultrascale_plugins.data.recipe import load_recipe
    from ultrascale_plugins.integrations.accelerate import UltraScaleAccelerator, UltraScalePlugin
    from ultrascale_plugins.integrations.trainer import UltraScaleTrainer

    recipe = load_recipe(None, ["nproc=2", "tp=1", "pp=1", "dp_shard=2", "optimizer_in_backward=true"])  # clipping: 1.0
    with pytest.raises(us.ConfigError, match="gradient clipping to a global norm of 1"):
        check_recipe(recipe)
    try:
        with pytest.raises(us.ConfigError, match="with 2 micro-batches per optimizer step"):
            UltraScaleAccelerator(ultrascale_plugin=UltraScalePlugin(optimizer_in_backward=True),
                                  gradient_accumulation_steps=2, cpu=True)
    finally:
        AcceleratorState._reset_state(True)
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), report_to=[], use_cpu=True)
    try:
        with pytest.raises(us.ConfigError, match="gradient clipping to a global norm of 1"):
            UltraScaleTrainer(model=make_model("llama"), args=args,
                              ultrascale_plugin=UltraScalePlugin(optimizer_in_backward=True))
    finally:
        AcceleratorState._reset_state(True)


@pytest.mark.slow
def test_the_trainer_steps_inside_the_backward_as_a_plain_trainer_steps_after_it(tmp_path):
    """TrainingArguments' defaults but max_grad_norm=0 (its fused AdamW, weight decay, linear schedule): ZeRO-3
    stepping inside the backward, and offloaded too, follow a plain Trainer on one process."""
    worker = TESTS / "trainer_worker.py"
    ref = tmp_path / "ref" / "out.json"
    ref.parent.mkdir()
    proc = subprocess.run([sys.executable, str(worker), str(ref), "--reference", "--max-grad-norm", "0",
                           "--no-save-model"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = json.loads(ref.read_text())
    cases = {"step_in_backward": ["dp_shard=2", "optimizer_in_backward=true"],
             "offloaded": ["dp_shard=2", "optimizer_in_backward=true", "cpu_offload=true"]}
    args = []
    for name, fields in cases.items():
        (tmp_path / name).mkdir()
        args += [str(tmp_path / name / "out.json"), *fields, "--max-grad-norm", "0", "--no-save-model", "--then"]
    proc = torchrun(2, worker, *args[:-1])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    for name in cases:
        run = json.loads((tmp_path / name / "out.json").read_text())
        assert len(run["losses"]) == len(want["losses"]) == 4
        assert max(abs(a - b) for a, b in zip(run["losses"], want["losses"])) <= 1e-5, (name, run, want)


def test_activation_offload_moves_the_layers_saved_tensors_and_not_their_weights(monkeypatch):
    """Under full recomputation a layer saves its inputs, and those are what go to the host (its hidden states,
    and the rotary tables it is handed); without recomputation everything it saves but its weights. The gradients
    are those of the same model without offload."""
    import torch

    from models import make_model
    from ultrascale_plugins.features.activation_offload.offloader import HostOffload

    sent = []
    pack = HostOffload.pack

    def recording(self, tensor):
        out = pack(self, tensor)
        if out is not tensor:
            sent.append(tensor.untyped_storage().data_ptr())
        return out

    monkeypatch.setattr(HostOffload, "pack", recording)
    ids = torch.randint(0, 100, (2, 32))
    grads, moved = {}, {}
    for name, fields in {"plain": {}, "full": {"activation_checkpointing": "full", "activation_offload": True},
                         "none": {"activation_offload": True}}.items():
        pmodel = us.parallelize(make_model("llama"), us.ParallelConfig(**fields))
        sent.clear()
        pmodel.train_step({"input_ids": ids, "labels": ids})
        assert not set(sent) & {p.untyped_storage().data_ptr() for p in pmodel.parameters()}, name
        grads[name] = {n: p.grad.clone() for n, p in pmodel.named_parameters()}
        hooks = pmodel.ctx.plugin_state.get("activation_offload")
        moved[name] = hooks.moved_bytes if hooks is not None else 0
        import torch.distributed as dist

        dist.destroy_process_group()
    config = make_model("llama").config
    hidden = 2 * 32 * config.hidden_size * 4  # one layer's input, fp32
    layers = config.num_hidden_layers
    assert layers * hidden <= moved["full"] <= 2 * layers * hidden, moved
    assert moved["none"] > 4 * moved["full"], moved
    for name in ("full", "none"):
        assert all(torch.allclose(grads[name][k], grads["plain"][k], atol=1e-6) for k in grads["plain"]), name


def test_activation_offload_beside_compile_is_one_line_naming_the_field():
    with pytest.raises(us.ConfigError, match="activation_offload=True: compile=regional.*Fix: use compile: none"):
        us.validate(us.ParallelConfig(activation_offload=True, compile="regional"), None, 1)
