"""A new user's first hour, replayed from a fresh clone: each story of the README and the docs run as a user runs
it (install, the embedded default, the three framework front ends, the planner, save / resume / export, the tiny
MoE recipe, a tokenizer made offline), plus the failures a new user met before (issue 32): a job killed with
SIGTERM, a corrupted checkpoint, a typo in the model section, a pretrained model against a conflicting recipe, a
bad layout under torchrun. Each story's wall time and outcome go to a JSON file.

    python benchmarks/first_hour.py --out benchmarks/results/first_hour.json        # clones this checkout's HEAD
    python benchmarks/first_hour.py --clone /tmp/fh --skip-install                  # reuse a clone with its .venv

Nothing downloads but the install (pip, from the package index); every model is built from a config.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


class Clone:
    def __init__(self, root: Path):
        self.root = root
        self.venv = root / ".venv"
        self.env = {**os.environ, "PATH": f"{self.venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
                    "VIRTUAL_ENV": str(self.venv), "OMP_NUM_THREADS": "1"}
        self.env.pop("PYTHONPATH", None)
        self.work = root / "first-hour"
        self.work.mkdir(exist_ok=True)

    def run(self, command: str, timeout: float = 900, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", command], cwd=cwd or self.root, env=self.env, capture_output=True,
                              text=True, timeout=timeout)

    def start(self, command: str, cwd: Path | None = None) -> subprocess.Popen:
        return subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd or self.root, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def story(results: list, name: str, fn) -> None:
    start = time.perf_counter()
    try:
        ok, detail = fn()
    except Exception as exc:  # noqa: BLE001 - a story that breaks is recorded, the others still run
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    seconds = round(time.perf_counter() - start, 1)
    results.append({"story": name, "ok": bool(ok), "seconds": seconds, "detail": detail})
    print(f"{'ok  ' if ok else 'FAIL'} {seconds:7.1f}s  {name}: {detail}", flush=True)


def tail(proc, n: int = 600) -> str:
    return (proc.stdout[-n:] + " | " + proc.stderr[-n:]).replace("\n", " / ")


def last_line(text: str, start: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith(start)]
    return lines[-1] if lines else ""


def quiet(proc) -> bool:
    """No torchao import notes (the package drops them once it is imported, and its recipes import it first)."""
    return not any(note in proc.stdout + proc.stderr for note in ("Failed to load", "natively supported"))


def layout_lines(proc) -> list[str]:
    """The resolved-layout lines a front end printed at start (rank 0, once)."""
    return [line for line in (proc.stdout + "\n" + proc.stderr).splitlines()
            if line.startswith("ultrascale: ") and " processes, layout " in line]


def first_choice(plan_output: str) -> dict:
    """``ultrascale plan``'s first choice: its line, the share of memory it leaves free and the margin it needs."""
    import re

    lines = plan_output.splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith("Chosen:")), None)
    if at is None:
        return {"line": plan_output[-300:], "free": None, "margin": None}
    said = " ".join(lines[at:at + 2])
    free = re.search(r"fits with ([\d.]+)% of the GPU's memory free", said)
    margin = re.search(r"([\d.]+)% margin", said)
    return {"line": lines[at], "free": float(free.group(1)) if free else None,
            "margin": float(margin.group(1)) if margin else None}


def one_error_line(proc) -> tuple[bool, str]:
    """A refusal as the project promises it: exit 2, one 'ultrascale: error:' line, no traceback."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ultrascale: error:")]
    ok = proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr and "Fix:" in errors[0]
    return ok, f"exit {proc.returncode}, {len(proc.stderr.splitlines())} stderr lines: {errors[0] if errors else tail(proc)}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clone", help="the directory to clone into (default: a temporary one)")
    ap.add_argument("--skip-install", action="store_true", help="the clone and its .venv exist already")
    ap.add_argument("--out", help="write the stories' results here (JSON)")
    args = ap.parse_args(argv)
    root = Path(args.clone or tempfile.mkdtemp(prefix="first-hour-")) / "ultrascale-plugins"
    results: list[dict] = []
    if not args.skip_install:
        subprocess.run(["git", "clone", "-q", str(HERE), str(root)], check=True)
    c = Clone(root)
    w = c.work

    if not args.skip_install:
        def install():
            p = c.run('python3 -m venv .venv && . .venv/bin/activate && pip install --quiet torch==2.13.0 .',
                      timeout=1800)
            torchao = c.run('python -c "import importlib.util as u; print(u.find_spec(\'torchao\') is not None)"')
            return p.returncode == 0 and torchao.stdout.strip() == "False", \
                f"{tail(p, 200)}; torchao installed: {torchao.stdout.strip()}"
        story(results, "install (README, first command's install part: the package alone, no torchao)", install)

    def quick_start():
        p = c.run("ultrascale train")
        return p.returncode == 0, last_line(p.stdout, "ultrascale: loss")
    story(results, "the embedded default (README, first command's run part)", quick_start)

    if not args.skip_install:  # the stories below run with every extra installed, torchao included (the noisy case)
        story(results, "install the test command's extras (README, second command's install part)", lambda: (
            lambda p: (p.returncode == 0, tail(p, 200)))(c.run('pip install --quiet ".[test]"', timeout=1800)))

    def lightning():
        p = c.run("python recipes/lightning/finetune.py --strategy ultrascale_tp --devices 2 --max-steps 10 "
                  f"--out {w / 'lightning'}", cwd=root)
        said = layout_lines(p)
        ok = p.returncode == 0 and quiet(p) and len(said) == 1
        return ok, f"{last_line(p.stdout + p.stderr, 'ultrascale:')}; layout said {len(said)} time(s); " \
                   f"torchao notes: {not quiet(p)}"
    story(results, "Lightning: recipes/lightning/finetune.py, ultrascale_tp on 2 processes", lightning)

    def accelerate():
        cfg = w / "layout.yaml"
        p = c.run(f"ultrascale accelerate-config --num-processes 2 --set tp=2 --out {cfg} && "
                  f"ultrascale accelerate-launch {cfg} recipes/accelerate/finetune.py --steps 10")
        said = layout_lines(p)
        ok = p.returncode == 0 and quiet(p) and len(said) == 1 and "tp=2" in said[0]
        return ok, f"layout said {len(said)} time(s): {said[:1]}; torchao notes: {not quiet(p)}; {tail(p, 300)}"
    story(results, "Accelerate: accelerate-config + accelerate-launch recipes/accelerate/finetune.py, tp=2", accelerate)

    def trainer():
        p = c.run(f"torchrun --standalone --nproc_per_node 2 recipes/trainer/finetune.py --set dp_shard=2 --steps 10 "
                  f"--output-dir {w / 'trainer'}")
        summaries = p.stdout.count("train_runtime") + p.stderr.count("train_runtime")
        said = layout_lines(p)
        ok = p.returncode == 0 and summaries == 1 and quiet(p) and len(said) == 1 and "dp_shard=2" in said[0]
        return ok, (f"train_runtime printed {summaries} time(s); layout said {len(said)} time(s): {said[:1]}; "
                    f"torchao notes: {not quiet(p)}")
    story(results, "Trainer: torchrun recipes/trainer/finetune.py, default TrainingArguments, dp_shard=2", trainer)

    def plan():
        p = c.run("ultrascale plan --model llama-3.1-8b --gpus 8 --gpu h100-sxm-80gb")
        return p.returncode == 0, " / ".join(p.stdout.strip().splitlines()[:6])[:600]
    story(results, "plan: Llama-3.1-8B on 8 x H100 80 GB", plan)

    ck = w / "ck"

    def save_resume_export():
        logs = w / "logs"
        a = c.run(f"ultrascale train --set train.steps=20 --set train.save_dir={ck} --set train.save_every=10 "
                  f"--log-dir {logs}")
        # resumed from step 10, not the newest: the first run's steps 11-20 are superseded in the metrics
        b = c.run(f"ultrascale train --set train.steps=30 --set train.save_dir={ck} --resume {ck}/step-00000010 "
                  f"--log-dir {logs}")
        e = c.run(f"ultrascale export {ck}/step-00000030 {w / 'exported'}")
        steps = [json.loads(line)["step"] for line in (logs / "metrics.jsonl").read_text().splitlines()] \
            if (logs / "metrics.jsonl").exists() else []
        once = steps == sorted(set(steps)) and bool(steps) and steps[-1] == 30
        ok = a.returncode == 0 and b.returncode == 0 and e.returncode == 0 and "resumed from" in b.stdout and once
        return ok, (f"{last_line(b.stdout, 'ultrascale: resumed')}; metrics.jsonl: {len(steps)} records, each step "
                    f"once: {once}; {e.stdout.strip()[:200]}")
    story(results, "save, resume from an earlier step, export; the metrics hold each step once", save_resume_export)

    def tiny_moe():
        p = c.run("ultrascale train recipes/tiny_moe.yaml")
        return p.returncode == 0, last_line(p.stdout, "ultrascale: loss")
    story(results, "the tiny MoE recipe (ep=2)", tiny_moe)

    def tokenizer_offline():
        rows = [{"messages": [{"role": "user", "content": f"what is {i} plus {i}?"},
                              {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(200)]
        (w / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        recipe = {"nproc": 2, "model": {"model_type": "llama", "vocab_size": 500, "hidden_size": 64,
                                        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                        "num_key_value_heads": 2},
                  "data": {"dataset": "sft.jsonl", "format": "chat", "tokenizer": "tok", "seq_len": 64},
                  "train": {"steps": 10, "global_batch": 4}, "parallel": {"dp_shard": 2}}
        (w / "sft.yaml").write_text(json.dumps(recipe))
        p = c.run(f"python {root}/recipes/tokenizer/train_tokenizer.py sft.jsonl tok --format chat --vocab-size 500 "
                  "&& ultrascale train sft.yaml", cwd=w)
        return p.returncode == 0, last_line(p.stdout, "ultrascale: loss")
    story(results, "a tokenizer made offline, a chat dataset (docs/data.md)", tokenizer_offline)

    # ---- the failures issue 32 found ----------------------------------------------------------------------------
    def sigterm():
        proc = c.start(f"ultrascale train --set train.steps=100000 --set train.save_dir={w / 'killed'}")
        deadline = time.time() + 300
        line = ""
        while time.time() < deadline and "processes, layout" not in line:
            line = proc.stdout.readline()  # the layout line: the workers are built; give them a few steps
        time.sleep(5)
        import psutil

        family = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        sent = time.perf_counter()
        os.kill(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return False, "the command did not exit within 120 s of SIGTERM"
        gone_after = time.perf_counter() - sent
        left = [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        ok = not left and "Traceback" not in err
        return ok, (f"exit {proc.returncode} {gone_after:.1f} s after SIGTERM, {len(family)} processes, {len(left)} "
                    f"left, stderr: {err.strip()[-300:]!r}")
    story(results, "SIGTERM to `ultrascale train` stops every process", sigterm)

    def corrupted():
        shard = sorted((ck / "step-00000030").glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        middle = len(data) // 2
        data[middle:middle + 4000] = bytes(255 - b for b in data[middle:middle + 4000])
        shard.write_bytes(bytes(data))
        return one_error_line(c.run(f"ultrascale train --set train.steps=40 --resume {ck}/step-00000030"))
    story(results, "a corrupted checkpoint is refused", corrupted)

    def typo():
        return one_error_line(c.run("ultrascale train --set model.hiden_size=64"))
    story(results, "a typo in the model section is refused", typo)

    def init_from_conflict():
        p = c.run(f"ultrascale train --set model.hidden_size=256 --set train.steps=2 --init-from {w / 'exported'}")
        said = "--init-from" in p.stdout + p.stderr and "hidden_size" in p.stdout + p.stderr
        return said, f"exit {p.returncode}: {(last_line(p.stderr, 'ultrascale') or last_line(p.stdout, 'ultrascale'))[:300]}"
    story(results, "--init-from against a conflicting model section is said", init_from_conflict)

    def trainer_bad_layout():
        return one_error_line(c.run(f"ultrascale accelerate-launch {w / 'layout.yaml'} recipes/trainer/finetune.py "
                                    "--set tp=3"))
    story(results, "a bad layout in a Trainer script is one line", trainer_bad_layout)

    # ---- what issue 47 found: a silent wrong layout, tracebacks for bad input, a first choice at the edge -------
    def accelerate_key_typos():
        outcomes = []
        base = w / "default-layout.yaml"  # the default layout (ZeRO-3 over both processes), then one size key added
        made = c.run(f"ultrascale accelerate-config --num-processes 2 --out {base}")
        if made.returncode != 0:
            return False, tail(made)
        for bad in ("parallelism_config_tp_sise: 2", "parallelism_config_tp: 2", "tp_size: 2"):
            cfg = w / "typo.yaml"
            text = base.read_text()
            cfg.write_text(text.replace("parallelism_config:", f"parallelism_config:\n  {bad}", 1))
            ok, detail = one_error_line(c.run(f"ultrascale accelerate-launch {cfg} recipes/accelerate/finetune.py "
                                              "--steps 2"))
            outcomes.append((ok, f"{bad!r}: {detail}"))
        return all(ok for ok, _ in outcomes), " || ".join(d for _, d in outcomes)
    story(results, "a misspelled Accelerate size key is refused, not trained as another layout", accelerate_key_typos)

    def layout_line_features():
        p = c.run("ultrascale train --nproc 2 --set pp=1 --set tp=1 --set dp_shard=2 --set cpu_offload=true "
                  "--set optimizer_in_backward=true --set train.max_grad_norm=0 --set train.steps=2")
        said = layout_lines(p)
        ok = p.returncode == 0 and len(said) == 1 and all(f in said[0] for f in ("cpu_offload", "optimizer_in_backward"))
        return ok, f"{said[:1] or tail(p)}"
    story(results, "the layout line names the memory features turned on", layout_line_features)

    def bad_files():
        (w / "truncated.json").write_text('{"model_type": "llama", "hidden_size": 4')
        (w / "big.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "big"}))
        bad_dir = w / "bad-init"
        bad_dir.mkdir(exist_ok=True)
        (bad_dir / "config.json").write_text("not json")
        (w / "list.yaml").write_text("model: {model_type: llama}\nparallel: [1, 2]\n")
        (w / "train5.yaml").write_text("model: {model_type: llama}\ntrain: 5\n")
        outcomes = []
        for command in ("ultrascale plan --model truncated.json --gpus 8", "ultrascale plan --model big.json --gpus 8",
                        f"ultrascale train --set train.steps=2 --init-from {bad_dir}", "ultrascale train list.yaml",
                        "ultrascale train train5.yaml"):
            ok, detail = one_error_line(c.run(command, cwd=w))
            outcomes.append((ok, f"{command.split(' ', 2)[1]} {command.rsplit(' ', 1)[-1]}: {detail}"))
        return all(ok for ok, _ in outcomes), " || ".join(d for _, d in outcomes)
    story(results, "a truncated JSON, a wrong-typed field, a bad config.json, a recipe section of the wrong type",
          bad_files)

    def one_line_under_torchrun(script: str, bad: str, extra: str = ""):
        p = c.run(f"torchrun --standalone --nproc_per_node 2 {script} --set {bad} {extra}")
        errors = [line for line in p.stderr.splitlines() if line.startswith("ultrascale: error:")]
        workers = [line for line in p.stderr.splitlines() if script in line and line.strip().startswith("File")]
        ok = p.returncode != 0 and len(errors) == 1 and not workers and "Fix:" in errors[0]
        return ok, f"exit {p.returncode}, worker traceback lines {len(workers)}: {errors[0] if errors else tail(p)}"

    story(results, "Trainer under torchrun: UltraScalePlugin(tpp=2) is one line from rank 0",
          lambda: one_line_under_torchrun("recipes/trainer/finetune.py", "tpp=2", f"--output-dir {w / 'tr-bad'}"))
    # --set values are YAML (`yes` is true): a value no YAML reads as a boolean
    story(results, "TRL under torchrun: sequence_parallel='maybe' is one line from rank 0",
          lambda: one_line_under_torchrun("recipes/trl/sft.py", "sequence_parallel=maybe",
                                          f"--model {w / 'exported'} --data {w / 'sft.jsonl'} --output-dir {w / 'trl-bad'}"))

    def lightning_strategy_typo():
        p = c.run("python recipes/lightning/finetune.py --strategy ultrascale_tpp --devices 2 --max-steps 1 "
                  f"--out {w / 'lightning-typo'}", cwd=root)
        return p.returncode != 0 and "ultrascale_tp" in p.stderr.split("ultrascale_tpp", 1)[-1], tail(p, 400)
    story(results, "Lightning: a misspelled ultrascale strategy name gets the nearest registered one",
          lightning_strategy_typo)

    def planner_margin(model: str, gpus: int):
        p = c.run(f"ultrascale plan --model {model} --gpus {gpus} --gpu h100-sxm-80gb")
        first = first_choice(p.stdout)
        return p.returncode == 0 and None not in (first["free"], first["margin"]) and first["free"] >= first["margin"], \
            f"{first['line']} (free {first['free']}, margin {first['margin']})"
    story(results, "plan: the README's example (Llama-3.1-8B, 16 x H100) first picks a layout that leaves the margin",
          lambda: planner_margin("llama-3.1-8b", 16))
    story(results, "plan: Qwen2.5-7B on 64 x H100 first picks a layout that leaves the margin",
          lambda: planner_margin("qwen2.5-7b", 64))

    for r in results:  # the clone's temporary path says nothing to a reader
        r["detail"] = r["detail"].replace(str(root), "<clone>")
    record = {"script": "benchmarks/first_hour.py", "command": " ".join(["python", "benchmarks/first_hour.py", *(argv or sys.argv[1:])]),
              "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip(),
              "total_seconds": round(sum(r["seconds"] for r in results), 1), "stories": results}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
