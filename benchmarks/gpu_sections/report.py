"""The files the suite writes: ``<date>-<gpu>.json`` (everything) and ``<date>-<gpu>.md`` (the same as tables)."""
from __future__ import annotations

import importlib.metadata
import json
import platform
import re
from pathlib import Path

import torch

PACKAGES = ("torch", "transformers", "accelerate", "lightning", "torchao", "ultrascale-plugins")


def versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    out["python"] = platform.python_version()
    out["cuda"] = torch.version.cuda or "none"
    return out


def gpu_name(dry_run: bool) -> str:
    """The GPU's name, from nvidia-smi when there is one: the driver process then holds no CUDA context (its
    memory stays free for the sections)."""
    import shutil
    import subprocess

    if dry_run or not torch.cuda.is_available():
        return f"cpu dry run ({platform.machine()})"
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True)
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.strip().splitlines()[0]
    return torch.cuda.get_device_name(0)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def write(result: dict, json_path: Path) -> None:
    """Both files, rewritten after every section: a suite killed halfway leaves what it had."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    json_path.with_suffix(".md").write_text(markdown(result))


def markdown(result: dict) -> str:
    lines = [f"# GPU suite: {result['gpu']}, {result['date']}", ""]
    if result["dry_run"]:
        lines += ["**CPU dry run** (tiny sizes, gloo): checks that the suite runs, not a GPU measurement.", ""]
    lines += ["Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()), "",
              "Commands:", "", "```bash", *result["commands"], "```", "",
              "| section | status | wall (s) | budget (s) | pass | fail | ok | skipped | error/timeout |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, sec in result["sections"].items():
        counts = {s: sum(r["status"] == s for r in sec["rows"]) for s in ("pass", "fail", "ok", "skipped")}
        bad = sum(r["status"] in ("error", "timeout") for r in sec["rows"])
        lines.append(f"| {name} | {sec['status']} | {sec['wall_s']} | {sec['budget_s']} | {counts['pass']} | "
                     f"{counts['fail']} | {counts['ok']} | {counts['skipped']} | {bad} |")
    for name, sec in result["sections"].items():
        lines += ["", f"## {name}", "", *table(sec["rows"])]
    return "\n".join(lines) + "\n"


def table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(no rows)"]
    columns = []
    for row in rows:
        columns += [k for k in row if k not in columns and k != "section"]
    out = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        out.append("| " + " | ".join(cell(row.get(c)) for c in columns) + " |")
    return out


def cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 and value != 0 else f"{value:.4g}"
    if isinstance(value, dict):
        value = json.dumps(value)
    return str(value).replace("|", "\\|").replace("\n", " ")
