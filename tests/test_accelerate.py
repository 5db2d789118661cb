"""Accelerate: `accelerate launch --config_file recipes/accelerate/X.yaml` runs a standard Accelerate loop, step by
step equal to one process without Accelerate (fp32, 1e-5); checkpoints, export, config files and errors."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "accelerate_worker.py"
RECIPES = ROOT / "recipes" / "accelerate"
TOL = 1e-5


def launch(config: str | None, out: Path, *args, through_cli: bool = True, env_extra: dict | None = None,
           launcher_args=(), timeout=600):
    """`ultrascale accelerate-launch F script` (sets ULTRASCALE_CONFIG) or plain `accelerate launch [--config_file F]
    LAUNCHER_ARGS script`."""
    env = {k: v for k, v in os.environ.items() if k != "ULTRASCALE_CONFIG"}
    env.update({"OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR", **(env_extra or {})})
    if through_cli:
        cmd = [sys.executable, "-m", "ultrascale_plugins.cli.main", "accelerate-launch", config, str(WORKER), str(out),
               *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *(["--config_file", config] if config else []),
               *launcher_args, str(WORKER), str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


# every one-process run the launches are compared with, as (data-parallel replicas, accumulation, AdamW,
# architecture, PEFT): all of them are run by one process when the first is asked for (its start-up is most of
# its time), and a key not listed here by one more
REFERENCES = [(1, 1, "fused", "llama8_tied", False), (2, 1, "fused", "llama8_tied", False),
              (2, 1, "for_loop", "llama8_tied", False), (2, 1, "for_loop", "llama8_tied", True),
              (2, 2, "for_loop", "llama8_tied", False), (1, 1, "foreach", "llama8_tied", False),
              (2, 1, "for_loop", "qwen3", False), (2, 1, "for_loop", "qwen3_moe", False)]


class References(dict):
    """One process without Accelerate per key (tests/accelerate_worker.py --reference), run when first asked for."""

    def __init__(self, tmp):
        super().__init__()
        self.tmp = tmp

    def __missing__(self, key):
        keys = [key, *(k for k in REFERENCES if k != key and k not in self)]
        cases = {k: f"{k[0]}:{k[1]}:{k[2]}:{k[3]}{':peft' if k[4] else ''}" for k in keys}
        path = self.tmp / f"references{len(self)}.json"
        proc = subprocess.run([sys.executable, str(WORKER), str(path), "--reference", *cases.values()],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.loads(path.read_text())
        self.update({k: result[case]["losses"] for k, case in cases.items()})
        return self[key]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return References(tmp_path_factory.mktemp("accelerate"))


def check(proc, out: Path, reference, replicas: int, accumulate: int = 1, adamw: str = "for_loop",
          peft: bool = False, arch: str = "llama8_tied"):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert r["distributed_type"] == "DistributedType.MULTI_CPU" and r["data_parallel_size"] == replicas, r
    assert r["parallelized"] == 1, "the model did not go through the engine"
    want = reference[(replicas, accumulate, adamw, arch, peft)]
    assert len(r["losses"]) == len(want) == 6
    assert max(abs(a - b) for a, b in zip(r["losses"], want)) <= TOL, (r["losses"], want)
    return r


@pytest.mark.slow
@pytest.mark.parametrize("recipe,replicas,adamw", [("tp_sp", 1, "fused"), ("zero1", 2, "fused"),
                                                  pytest.param("pp_tp_zero3", 2, "for_loop", marks=pytest.mark.sweep)])
# pp_tp_zero3 (8 processes, 45 s on 2 cores): benchmarks/sweep_tests.py.
# zero3 runs in test_accumulation_save_state_resume_and_save_model, pp_tp (with foreach AdamW) in
# test_plain_accelerate_launch_cpu_with_the_environment_variable; tp x ZeRO-3 inside pp_tp_zero3;
# zero1 is DDP + a partitioned optimizer (ddp.yaml without the partitioning). AdamW(fused=True) and
# AdamW(foreach=True) (the CUDA default) must run under TP without FSDP and match one process using the same.
def test_recipe_configs_match_one_process(tmp_path, reference, recipe, replicas, adamw):
    out = tmp_path / "out.json"
    proc = launch(str(RECIPES / f"{recipe}.yaml"), out, "--adamw", adamw)
    check(proc, out, reference, replicas, adamw=adamw)
    # the layout that trained, said once by rank 0 (ParallelDims.describe): zero1.yaml's ZeRO-1 comes from its
    # 'ultrascale' block and is said although no dp_shard axis says a ZeRO stage
    said = [line for line in proc.stderr.splitlines() if line.startswith("ultrascale: ") and " layout " in line]
    want = {"tp_sp": "tp=2 + sequence parallel", "zero1": "dp_replicate=2 x zero_stage=1",
            "pp_tp_zero3": "pp=2 (1f1b) x dp_shard=2 (ZeRO-3) x tp=2 + sequence parallel"}[recipe]
    processes = {"tp_sp": 2, "zero1": 2, "pp_tp_zero3": 8}[recipe]
    assert said == [f"ultrascale: {processes} processes, layout {want}, model llama 0.31M params"], proc.stderr[-3000:]


@pytest.mark.slow
def test_qwen3_under_zero3_by_tensor_parallel_matches_one_process(tmp_path, reference):
    """An architecture outside the Llama family: Qwen3's per-head q_norm/k_norm are replicated over TP and see
    only this rank's heads (their gradients must be summed over TP, also when FSDP shards them over dp)."""
    out = tmp_path / "out.json"
    proc = launch(str(RECIPES / "tp_zero3.yaml"), out, env_extra={"TEST_ARCH": "qwen3"})
    check(proc, out, reference, replicas=2, arch="qwen3")


@pytest.mark.slow
def test_a_peft_model_is_prepared_by_the_engine(tmp_path, reference):
    """prepare(peft_model, optimizer, ...) parallelizes the PEFT model (ZeRO-3 over 2 processes) rather than
    handing it to Accelerate's own path; every step equals the same PEFT model on one process."""
    out = tmp_path / "out.json"
    check(launch(str(RECIPES / "zero3.yaml"), out, "--peft"), out, reference, 2, peft=True)


@pytest.mark.slow
@pytest.mark.sweep  # benchmarks/sweep_tests.py; regional compile's parity and the Trainer's torch_compile in CI
def test_accelerates_dynamo_config_compiles_each_layer_once(tmp_path, reference):
    """`dynamo_config: {dynamo_backend: INDUCTOR}` (what `accelerate config` writes for torch.compile) becomes
    compile: regional: each decoder layer compiled, the model not compiled again as a whole, every step equal
    to eager on one process."""
    data = yaml.safe_load((RECIPES / "tp_sp.yaml").read_text())
    data["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    config = tmp_path / "tp_sp_compiled.yaml"
    config.write_text(yaml.safe_dump(data))
    out = tmp_path / "out.json"
    r = check(launch(str(config), out, "--adamw", "fused"), out, reference, 1, adamw="fused")
    assert r["compile"] == "regional" and r["compiled_graphs"] > 0, r


@pytest.mark.slow
def test_accumulation_save_state_resume_and_save_model(tmp_path, reference):
    """ZeRO-3, 2 micro-batches per step: save_state after 3 batches, a fresh process (other initial weights)
    load_state-s it and continues exactly; save_model gives an HF directory with equal logits."""
    config = str(RECIPES / "zero3.yaml")
    full = tmp_path / "full.json"
    proc = launch(config, full, "--accumulate", "2", "--save-at", "3", str(tmp_path / "state"),
                  "--save-model", str(tmp_path / "hf"))
    r = check(proc, full, reference, 2, accumulate=2)
    assert (tmp_path / "state" / "ultrascale.json").is_file()
    resumed = tmp_path / "resumed.json"
    proc = launch(config, resumed, "--accumulate", "2", "--resume", str(tmp_path / "state"))
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert json.loads(resumed.read_text())["losses"] == pytest.approx(r["losses"][3:], abs=TOL)
    import torch
    from transformers import AutoModelForCausalLM

    from accelerate_worker import PROBE

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        logits = model(input_ids=PROBE["input_ids"], attention_mask=PROBE["attention_mask"]).logits
    assert (logits - torch.tensor(r["probe_logits"])).abs().max().item() <= TOL


@pytest.mark.slow
@pytest.mark.sweep  # benchmarks/sweep_tests.py; the same launcher path with the environment variable in CI
def test_accelerate_launch_cpu_num_processes_starts_that_many_workers(tmp_path, reference):
    """`accelerate launch --cpu --num_processes 2 script` (Accelerate's --cpu path alone starts one process): two
    MULTI_CPU workers, the default layout (ZeRO-3 over both), every step equal to one process."""
    out = tmp_path / "out.json"
    proc = launch(None, out, through_cli=False, launcher_args=["--cpu", "--num_processes", "2"])
    check(proc, out, reference, 2)
    assert "starting the workers through Accelerate's multi-process launcher" in proc.stderr


@pytest.mark.slow
def test_plain_accelerate_launch_cpu_with_the_environment_variable(tmp_path, reference):
    """The documented mechanism without the wrapper, on 4 CPU processes:
    ULTRASCALE_CONFIG=F accelerate launch --cpu --num_processes 4 --config_file F."""
    out = tmp_path / "out.json"
    config = str(RECIPES / "pp_tp.yaml")
    proc = launch(config, out, "--adamw", "foreach", through_cli=False, env_extra={"ULTRASCALE_CONFIG": config},
                  launcher_args=["--cpu", "--num_processes", "4"])
    check(proc, out, reference, 1, adamw="foreach")


@pytest.mark.slow
def test_pipeline_degree_without_the_file_fails_clearly(tmp_path):
    """Plain `accelerate launch` of a file whose pp lives in the ultrascale block, without ULTRASCALE_CONFIG: the
    exported sizes cover 2 of 4 processes; the workers read the launcher's file and rank 0 says in one line what did
    not reach them and the fix, not a hang, and no rank prints a traceback. Accelerate's launcher then reports the
    failed workers itself (torchrun's ChildFailedError, under its traceback) and exits with status 1, as it does
    whenever a worker fails -- as docs/accelerate.md says."""
    import re

    proc = launch(str(RECIPES / "pp_tp.yaml"), tmp_path / "out.json", through_cli=False, timeout=300)
    said = [line for line in proc.stderr.splitlines() if "ultrascale: error:" in line]
    assert len(said) == 1 and "pp_tp.yaml: the 'ultrascale' block (pp) did not reach the workers" in said[0] and \
        "2 processes but 4 were launched" in said[0] and "ULTRASCALE_CONFIG" in said[0], proc.stderr
    assert "ConfigError" not in proc.stderr and not re.search(r"\[rank\d\]: *Traceback", proc.stderr)
    assert proc.returncode == 1 and "ChildFailedError" in proc.stderr  # Accelerate's launcher's own report


@pytest.mark.slow
def test_a_layout_refused_under_accelerate_launch_cpu_is_said_once_by_its_first_process(tmp_path):
    """`accelerate launch --cpu --num_processes 2` with a layout for 3 processes (ULTRASCALE_CONFIG): the process
    Accelerate starts re-launches the workers (cpu_relaunch.py), says their error in one line and exits with status
    2; the re-launched torchrun's report of failed workers is not shown, no rank prints a traceback. Accelerate's
    own launcher then reports that process's failure -- a CalledProcessError traceback quoting the end of its
    standard error, the line included -- and exits with status 1, as docs/accelerate.md says."""
    import re

    tp3 = tp3_file(tmp_path)
    proc = launch(None, tmp_path / "out.json", through_cli=False, launcher_args=["--cpu", "--num_processes", "2"],
                  env_extra={"ULTRASCALE_CONFIG": str(tp3)}, timeout=300)
    said = [line for line in proc.stderr.splitlines() if line.startswith("ultrascale: error:")]
    assert said and set(said) == {f"ultrascale: error: {tp3}: tp=3: the layout asks for pp*dp_replicate*dp_shard*cp*"
                                  "tp = 1*1*1*1*3 = 3 processes but 2 were launched. Fix: make num_processes 3, or "
                                  "the sizes' product 2"}, proc.stderr[-4000:]
    assert "ChildFailedError" not in proc.stderr and "ConfigError" not in proc.stderr, proc.stderr[-4000:]
    assert not re.search(r"\[rank\d\]: *Traceback", proc.stderr)
    assert proc.returncode == 1 and "returned non-zero exit status 2" in proc.stderr  # Accelerate's own report


@pytest.mark.slow
def test_a_model_the_layout_cannot_run_is_one_line_through_ultrascale_accelerate_launch(tmp_path):
    """ep_zero3.yaml (ep=2) with the test's dense model: the workers find it in prepare(model, ...), after the
    launch, and write it to the launcher's error file; `ultrascale accelerate-launch` says it once, as its last
    line, with exit status 2: no traceback from a rank, no report of failed workers from Accelerate's launcher."""
    proc = launch(str(RECIPES / "ep_zero3.yaml"), tmp_path / "out.json", timeout=300)
    said = [line for line in proc.stderr.splitlines() if "ultrascale: error:" in line]
    assert said == ["ultrascale: error: ep=2: model type 'llama' has no routed experts. Fix: use ep: 1"], \
        proc.stderr[-4000:]
    assert proc.returncode == 2 and proc.stderr.rstrip().endswith(said[0])
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-4000:]


def test_accelerate_config_writes_a_file_accelerate_accepts(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    out = tmp_path / "c.yaml"
    proc = subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "accelerate-config", "--num-processes",
                           "8", "--cpu", "--set", "pp=2", "--set", "tp=2", "--set", "pp_schedule=zbv",
                           "--set", "mixed_precision=bf16", "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    cfg = load_config_from_file(str(out))
    assert cfg.num_processes == 8 and cfg.mixed_precision == "bf16" and cfg.use_cpu
    assert cfg.parallelism_config["parallelism_config_tp_size"] == 2
    assert cfg.parallelism_config["parallelism_config_dp_shard_size"] == 2
    assert cfg.parallelism_config["ultrascale"] == {"pp": 2, "pp_schedule": "zbv"}
    from ultrascale_plugins.integrations.layout import read_layout_file

    layout = read_layout_file(out)
    assert (layout.pp, layout.tp, layout.dp_shard, layout.pp_schedule, layout.mixed_precision) == \
        (2, 2, 2, "zbv", "bf16")


def test_accelerate_config_interactive(tmp_path):
    """The questions are the fields the plugins mark to be asked, in their declaration order (processes;
    dp_replicate, zero_stage, mixed_precision; tp, sequence_parallel when tp > 1; pp, pp_schedule when pp > 1;
    cp, cp_method when cp > 1; ep): every mesh degree is asked, a follow-up only when it matters."""
    out = tmp_path / "c.yaml"
    answers = "4\n1\n3\nno\n2\nfalse\n2\n1f1b\n1\n1\n"
    proc = subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "accelerate-config", "--interactive",
                           "--cpu", "--out", str(out)], input=answers, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load(out.read_text())
    assert data["num_processes"] == 4 and data["parallelism_config"]["ultrascale"] == {"pp": 2}
    asked = re.findall(r"\((\w+)[:)]", proc.stdout)
    assert asked == ["dp_replicate", "zero_stage", "mixed_precision", "tp", "sequence_parallel", "pp", "pp_schedule",
                     "cp", "ep"], proc.stdout
    answers = "4\n1\n3\nno\n1\n1\n4\nulysses\n1\n"  # cp=4 asks its method; tp=1 and pp=1 ask nothing more
    proc = subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "accelerate-config", "--interactive",
                           "--cpu", "--out", str(out)], input=answers, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "cp_method" in proc.stdout and "sequence_parallel" not in proc.stdout and "pp_schedule" not in proc.stdout
    written = yaml.safe_load(out.read_text())["parallelism_config"]
    assert written["parallelism_config_cp_size"] == 4 and written["ultrascale"] == {"cp_method": "ulysses"}


def test_accelerate_config_interactive_asks_an_outside_plugins_field(tmp_path):
    """A plugin outside the package (tests/outside_plugin) that marks its field to be asked is asked, after the
    built-ins, with no change to the command line."""
    from conftest import outside_plugin_env

    out = tmp_path / "c.yaml"
    proc = subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "accelerate-config", "--interactive",
                           "--cpu", "--out", str(out)], input="4\n1\n3\nno\n1\n1\n1\n1\n2\n", capture_output=True,
                          text=True, env=outside_plugin_env())
    assert proc.returncode == 0, proc.stderr
    assert re.findall(r"\((\w+)[:)]", proc.stdout)[-1] == "acme_dp", proc.stdout
    assert yaml.safe_load(out.read_text())["parallelism_config"]["ultrascale"] == {"acme_dp": 2}


def test_layout_mismatch_and_unavailable_dimensions_are_config_errors(tmp_path):
    from ultrascale_plugins.interface.config import ConfigError
    from ultrascale_plugins.integrations.layout import layout_from_environment

    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
           "PARALLELISM_CONFIG_TP_SIZE": "2", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1"}
    assert layout_from_environment(env, 4).tp == 2
    with pytest.raises(ConfigError, match="4 processes but 8 were launched"):
        layout_from_environment(env, 8)
    with pytest.raises(ConfigError, match="accelerate launch --cpu"):
        layout_from_environment(env, 1)
    # Accelerate's context-parallel sizes, read by the context-parallel plugin: cp_size is the ring, sp_size Ulysses
    ulysses = layout_from_environment({**env, "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1",
                                       "PARALLELISM_CONFIG_CP_SIZE": "1", "PARALLELISM_CONFIG_SP_SIZE": "2"}, 4)
    assert (ulysses.cp, ulysses.cp_method, ulysses.tp) == (2, "ulysses", 2)
    ring = layout_from_environment({**env, "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1", "PARALLELISM_CONFIG_CP_SIZE": "2",
                                    "PARALLELISM_CONFIG_SP_SIZE": "1"}, 4)
    assert (ring.cp, ring.cp_method) == (2, "ring")
    with pytest.raises(ConfigError, match="parallelism_config_cp_size=2 and parallelism_config_sp_size=2"):
        layout_from_environment({**env, "PARALLELISM_CONFIG_CP_SIZE": "2", "PARALLELISM_CONFIG_SP_SIZE": "2"}, 4)
    # expert parallel's own size key, read by its plugin; a size no installed plugin reads is refused
    assert layout_from_environment({**env, "PARALLELISM_CONFIG_EP_SIZE": "2"}, 4).ep == 2
    with pytest.raises(ConfigError, match="parallelism_config_xp_size=2: no installed plugin reads"):
        layout_from_environment({**env, "PARALLELISM_CONFIG_XP_SIZE": "2"}, 4)
    fsdp = {"ACCELERATE_USE_FSDP": "true", "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_VERSION": "2"}
    assert layout_from_environment(fsdp, 4).zero_stage == 2
    offloaded = layout_from_environment({**fsdp, "FSDP_OFFLOAD_PARAMS": "true"}, 4)  # FSDP2's CPUOffloadPolicy
    assert offloaded.cpu_offload and offloaded.zero_stage == 2
    with pytest.raises(ConfigError, match="fp16"):
        layout_from_environment({"ACCELERATE_MIXED_PRECISION": "fp16"}, 2)
    proc = subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "accelerate-launch",
                           str(RECIPES / "pp_tp.yaml").replace("pp_tp", "missing"), "x.py"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def tp3_file(tmp_path) -> Path:
    """zero3.yaml with parallelism_config_tp_size: 3 (and dp_shard 1) for its 2 processes."""
    data = yaml.safe_load((RECIPES / "zero3.yaml").read_text())
    data["parallelism_config"].update(parallelism_config_dp_shard_size=1, parallelism_config_tp_size=3)
    path = tmp_path / "tp3.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_key_neither_accelerate_nor_a_plugin_reads_is_refused_with_the_nearest_one(tmp_path, monkeypatch):
    """A misspelled key in an Accelerate file's parallelism_config (or its 'ultrascale' block, or the environment a
    launcher exported) would leave its size out and train another layout: each is refused in one line naming the
    file, the key and the key it is nearest to; Accelerate's own keys that are no size (cp_backend, the sp_*
    settings) stay accepted."""
    from ultrascale_plugins.interface.config import ConfigError
    from ultrascale_plugins.integrations import layout

    def file_with(section: dict) -> Path:
        data = yaml.safe_load((RECIPES / "zero3.yaml").read_text())
        data["parallelism_config"].update(section)
        path = tmp_path / "f.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    for key, near in (("parallelism_config_tp_sise", "parallelism_config_tp_size"),
                      ("parallelism_config_tp", "parallelism_config_tp_size"),
                      ("tp_size", "parallelism_config_tp_size"),
                      ("parallelism_config_cp_backends", "parallelism_config_cp_backend")):
        path = file_with({"parallelism_config_dp_shard_size": 1, key: 2})
        with pytest.raises(ConfigError) as exc:
            layout.read_layout_file(path)
        said = str(exc.value)
        assert said.startswith(f"{path}: parallelism_config: {key}=2: ") and f"Fix: did you mean '{near}'?" in said, \
            said
        assert "\n" not in said
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'f.yaml'}: parallelism_config: ultrascale: tpp=2: .* Fix: "
                                          "did you mean 'tp'"):
        layout.read_layout_file(file_with({"ultrascale": {"tpp": 2}}))
    plain = tmp_path / "layout.yaml"  # a plain layout file (UltraScalePlugin("layout.yaml"), ULTRASCALE_CONFIG)
    plain.write_text("tpp: 2\n")
    with pytest.raises(ConfigError, match=f"^{plain}: unknown parallel key 'tpp' .*Fix: did you mean 'tp'"):
        layout.read_layout_file(plain)
    # a size no plugin reads: the nearest key, beside the plugin that would read it
    with pytest.raises(ConfigError, match="parallelism_config_tpp_size=2: no installed plugin reads this Accelerate "
                                          "size. Fix: did you mean 'parallelism_config_tp_size'"):
        layout.read_layout_file(file_with({"parallelism_config_tpp_size": 2}))
    accepted = layout.read_layout_file(file_with({
        "parallelism_config_cp_backend": "torch", "parallelism_config_cp_comm_strategy": "allgather",
        "parallelism_config_sp_backend": "deepspeed", "parallelism_config_sp_seq_length": 256,
        "parallelism_config_sp_seq_length_is_variable": True, "parallelism_config_sp_attn_implementation": "sdpa"}))
    assert (accepted.dp_shard, accepted.tp, accepted.cp) == (2, 1, 1)
    # a layout field Accelerate has no size key for belongs in the 'ultrascale' block
    with pytest.raises(ConfigError, match="parallelism_config_pp_size=2: .* Fix: set pp: 2 in parallelism_config's "
                                          "'ultrascale' block"):
        layout.read_layout_file(file_with({"parallelism_config_pp_size": 2}))
    # what a launcher exported, and (plain `accelerate launch`, which passes over a key it does not know) its file
    exported = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1",
                "PARALLELISM_CONFIG_CP_BACKEND": "torch", "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed"}
    monkeypatch.setattr(layout, "launcher_config_file", lambda: None)
    assert layout.layout_from_environment({**exported, "PARALLELISM_CONFIG_TP_SIZE": "2"}, 2).tp == 2
    with pytest.raises(ConfigError, match="PARALLELISM_CONFIG_TP_SISE=2: .* Fix: did you mean "
                                          "'PARALLELISM_CONFIG_TP_SIZE'"):
        layout.layout_from_environment({**exported, "PARALLELISM_CONFIG_TP_SISE": "2"}, 2)
    launched = file_with({"parallelism_config_dp_shard_size": 1, "parallelism_config_tp_sise": 2,
                          "ultrascale": {"zero_stage": 2}})
    monkeypatch.setattr(layout, "launcher_config_file", lambda: str(launched))
    with pytest.raises(ConfigError, match=f"^{launched}: parallelism_config: parallelism_config_tp_sise=2: .* Fix: "
                                          "did you mean 'parallelism_config_tp_size'"):
        layout.layout_from_environment({**exported, "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"}, 2)


def test_a_size_that_does_not_fit_the_processes_is_blamed_on_itself(tmp_path, monkeypatch):
    """A file with parallelism_config_tp_size: 3 for 2 processes: a plain `accelerate launch` worker names
    Accelerate's tp_size key (the file has no 'ultrascale' block to blame); through ULTRASCALE_CONFIG the message
    names the file and tp=3; `ultrascale accelerate-launch` refuses the file before starting anything, exit 2."""
    from ultrascale_plugins.interface.config import ConfigError
    from ultrascale_plugins.integrations import layout

    tp3 = tp3_file(tmp_path)
    exported = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
                "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1", "PARALLELISM_CONFIG_TP_SIZE": "3",
                "PARALLELISM_CONFIG_CP_SIZE": "1"}
    monkeypatch.setattr(layout, "launcher_config_file", lambda: str(tp3))
    with pytest.raises(ConfigError) as exc:
        layout.layout_from_environment(exported, 2)
    assert str(exc.value) == ("parallelism_config_tp_size=3: the layout asks for pp*dp_replicate*dp_shard*cp*tp = "
                              "1*1*1*1*3 = 3 processes but 2 were launched. Fix: make num_processes 3, or the sizes' "
                              "product 2")
    with pytest.raises(ConfigError, match=f"^{tp3}: tp=3: the layout asks for .* = 3 processes but 2 were launched"):
        layout.layout_from_environment({**exported, "ULTRASCALE_CONFIG": str(tp3)}, 2)
    proc = subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "accelerate-launch", str(tp3), "x.py"],
                          capture_output=True, text=True, timeout=120)
    said = [line for line in proc.stderr.splitlines() if line.startswith("ultrascale")]
    assert proc.returncode == 2 and len(said) == 1 and said[0].startswith(f"ultrascale: error: {tp3} "), proc.stderr


def test_an_ep_size_that_accelerates_launcher_drops_is_refused_not_ignored(monkeypatch):
    """recipes/accelerate/ep_zero3.yaml holds parallelism_config_ep_size, which Accelerate's launcher does not
    export: read through $ULTRASCALE_CONFIG (or PARALLELISM_CONFIG_EP_SIZE in the environment) it is ep=2; a worker
    of a plain `accelerate launch --config_file` of it reads the launcher's file and stops with the fix instead of
    training without expert parallelism (and likewise for the `ultrascale` block, e.g. zero1.yaml's zero_stage)."""
    from ultrascale_plugins import ParallelConfig
    from ultrascale_plugins.interface.config import ConfigError
    from ultrascale_plugins.integrations import layout

    ep_file = str(RECIPES / "ep_zero3.yaml")
    assert (layout.read_layout_file(ep_file).ep, layout.read_layout_file(ep_file).dp_shard) == (2, 2)
    written = layout.accelerate_yaml(ParallelConfig(dp_shard=2, ep=2), 2, True)  # `accelerate-config --set ep=2`
    assert written["parallelism_config"]["parallelism_config_ep_size"] == 2
    assert layout.from_accelerate_file(written, "f.yaml").ep == 2
    assert layout.launcher_config_file(["/venv/bin/python", "/venv/bin/accelerate", "launch", "--config_file",
                                        ep_file, "train.py", "--lr", "1"]) == ep_file
    assert layout.launcher_config_file(["python", "-m", "torch.distributed.run", "train.py"]) is None
    # what `accelerate launch --config_file ep_zero3.yaml` exports to its workers
    exported = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
                "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "1",
                "PARALLELISM_CONFIG_CP_SIZE": "1", "PARALLELISM_CONFIG_SP_SIZE": "1"}
    monkeypatch.setattr(layout, "launcher_config_file", lambda: ep_file)
    with pytest.raises(ConfigError, match=r"ep_zero3.yaml: parallelism_config_ep_size=2 did not reach the workers"
                                          r".* Fix: launch with `ultrascale accelerate-launch .*ep_zero3.yaml SCRIPT`"):
        layout.layout_from_environment(exported, 2)
    assert layout.layout_from_environment({**exported, "ULTRASCALE_CONFIG": ep_file}, 2).ep == 2
    assert layout.layout_from_environment({**exported, "PARALLELISM_CONFIG_EP_SIZE": "2"}, 2).ep == 2
    zero1 = str(RECIPES / "zero1.yaml")
    monkeypatch.setattr(layout, "launcher_config_file", lambda: zero1)
    with pytest.raises(ConfigError, match=r"the 'ultrascale' block \(zero_stage\) did not reach the workers"):
        layout.layout_from_environment({**exported, "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
                                        "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1"}, 2)


def test_cpu_relaunch_reads_the_launch_command_in_all_its_spellings():
    from ultrascale_plugins.integrations import cpu_relaunch

    tail = ["--cpu", "--num_processes", "4", "--config_file", "f.yaml", "train.py", "--lr", "1", "--cpu"]
    want = (["--cpu", "--num_processes", "4", "--config_file", "f.yaml"], ["train.py", "--lr", "1", "--cpu"])
    for head in (["/venv/bin/python", "/venv/bin/accelerate", "launch"], ["accelerate-launch"],
                 ["python", "-m", "accelerate.commands.launch"]):
        assert cpu_relaunch.launch_arguments(head + tail) == want, head
    assert cpu_relaunch.launch_arguments(["python", "train.py"]) is None
    assert cpu_relaunch.launch_arguments(["accelerate", "env"]) is None
    env = {"ACCELERATE_USE_CPU": "True", "MASTER_PORT": "29500"}
    assert cpu_relaunch.single_process_cpu_launch(env)
    assert not cpu_relaunch.single_process_cpu_launch({**env, "RANK": "0"})  # a torchrun / multi-process worker
    assert not cpu_relaunch.single_process_cpu_launch({**env, "OMPI_COMM_WORLD_SIZE": "2"})  # mpirun
    assert not cpu_relaunch.single_process_cpu_launch({"ACCELERATE_USE_CPU": "True"})  # --num_processes 1
    proc = subprocess.run([sys.executable, "-c", "from ultrascale_plugins.integrations.accelerate import "
                           "UltraScaleAccelerator as A; A()"], capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}, **env})
    assert proc.returncode != 0 and "ConfigError" in proc.stderr, proc.stderr[-2000:]
    assert "was not started by `accelerate launch`" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.sweep  # benchmarks/sweep_tests.py; the outside plugin's parity in CI: the Python API and the command line
def test_outside_plugin_axis_through_accelerate(tmp_path, reference):
    """A dimension plugin outside the package (tests/outside_plugin: the acme_dp axis) in an Accelerate file's
    `ultrascale` block, written by `ultrascale accelerate-config --set acme_dp=2`: every step equals one process."""
    from conftest import outside_plugin_env

    env = outside_plugin_env()
    config = tmp_path / "acme.yaml"
    made = subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "accelerate-config", "--num-processes",
                           "4", "--set", "dp_shard=2", "--set", "acme_dp=2", "--out", str(config)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert made.returncode == 0, made.stderr
    assert yaml.safe_load(config.read_text())["parallelism_config"]["ultrascale"]["acme_dp"] == 2
    out = tmp_path / "out.json"
    check(launch(str(config), out, env_extra={"PYTHONPATH": env["PYTHONPATH"]}), out, reference, 2)


@pytest.mark.slow
def test_accelerates_own_sp_size_key_runs_ulysses_context_parallel(tmp_path, reference):
    """Accelerate's own `parallelism_config_sp_size` (its Ulysses) in a plain `accelerate launch --config_file`:
    the context-parallel plugin reads it as cp=2, cp_method=ulysses; every step equals one process."""
    from ultrascale_plugins.integrations.layout import read_layout_file

    layout = read_layout_file(RECIPES / "sp_ulysses_zero3.yaml")
    assert (layout.cp, layout.cp_method, layout.dp_shard) == (2, "ulysses", 2)
    out = tmp_path / "out.json"
    check(launch(str(RECIPES / "sp_ulysses_zero3.yaml"), out, through_cli=False), out, reference, 2)


@pytest.mark.slow
def test_expert_parallel_from_the_ep_size_key_matches_one_process(tmp_path, reference):
    """recipes/accelerate/ep_zero3.yaml (parallelism_config_ep_size: 2 over dp_shard 2) on a mixture of experts
    (Qwen3-MoE, 8 experts, top-2): each process holds 4 of every layer's experts, tokens go to them and back, and
    every step equals the same model on one process without Accelerate."""
    out = tmp_path / "out.json"
    r = check(launch(str(RECIPES / "ep_zero3.yaml"), out, env_extra={"TEST_ARCH": "qwen3_moe"}), out, reference,
              replicas=2, arch="qwen3_moe")
    assert r["ep"] == 2, r
