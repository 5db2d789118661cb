"""What every section shares: the sizes of a GPU run or a CPU dry run, the row recorder, the small models the
correctness checks train, random batches and the differences they report."""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent.parent
TESTS = BENCHMARKS.parent / "tests"
for _path in (BENCHMARKS, TESTS):  # the other benchmarks and the tests' shared helpers (tests/models.py)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

# Tolerances of the checks, stated once (the rows carry the one each check used).
TOL_FP32 = 1e-5  # same math in fp32 through two code paths (eager vs compiled, resumed vs uninterrupted)
TOL_BF16_REL = 1e-2  # bf16 against fp32 or two bf16 code paths: |difference| / |reference loss|
TOL_ADAMW = 1e-6  # torch's AdamW implementations against each other (as tests/test_parity.py)
TOL_INIT_STD = 0.05  # relative deviation of an initialized weight's std from the config's initializer_range


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big everything is. ``gpu()``: the H200 run; ``dry_run()``: the same code on CPU, tiny and quick."""

    dry_run: bool
    small: dict  # LlamaConfig fields of the model the correctness checks train
    moe: dict  # Qwen3MoeConfig fields of the MoE check
    rows: int  # rows per batch of the correctness checks
    seq: int  # their sequence length
    steps: int  # their optimizer steps
    throughput_seq: int
    micro_batch: dict  # {preset name: rows per step}
    warmup: int  # untimed steps (compilation happens here)
    timed: int  # timed steps; tok/s is over their median
    front_end_micro_batch: int
    front_end_steps: int  # steps per front end, the first ``warmup`` untimed

    @classmethod
    def gpu(cls, micro_batch_1b: int = 4, micro_batch_3b: int = 2, seq: int = 4096) -> "Sizes":
        return cls(dry_run=False,
                   small=dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                              tie_word_embeddings=False),
                   moe=dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                            num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=32, max_position_embeddings=1024,
                            tie_word_embeddings=False),
                   rows=4, seq=512, steps=6, throughput_seq=seq,
                   micro_batch={"llama-3.2-1b": micro_batch_1b, "llama-3.2-3b": micro_batch_3b},
                   warmup=3, timed=6, front_end_micro_batch=max(1, micro_batch_1b // 2), front_end_steps=8)

    @classmethod
    def dry(cls) -> "Sizes":
        return cls(dry_run=True,
                   small=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                              tie_word_embeddings=False),
                   moe=dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                            tie_word_embeddings=False),
                   rows=2, seq=64, steps=3, throughput_seq=64,
                   micro_batch={"llama-3.2-1b": 2, "llama-3.2-3b": 1},
                   warmup=1, timed=2, front_end_micro_batch=2, front_end_steps=3)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Sizes":
        return cls(**json.loads(text))


class Recorder:
    """Appends one JSON line per result row to a file, flushed at once: the driver reads whatever is there when
    the section ends, however it ends."""

    def __init__(self, path: str | Path, section: str):
        self.path, self.section = Path(path), section

    def add(self, name: str, status: str, **values) -> dict:
        row = {"section": self.section, "name": name, "status": status, **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=_plain) + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(f"[{self.section}] {name}: {status}", file=sys.stderr, flush=True)
        return row

    def check(self, name: str, diff: float, tol: float, **values) -> dict:
        """A comparison: pass when ``diff`` <= ``tol`` (a NaN difference fails)."""
        return self.add(name, "pass" if diff <= tol else "fail", max_diff=diff, tol=tol, **values)

    def skipped(self, name: str, reason: str, **values) -> dict:
        return self.add(name, "skipped", reason=reason, **values)


def _plain(value):
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, (torch.device, Path)):
        return str(value)
    return repr(value)


def read_rows(path: str | Path) -> list[dict]:
    """The rows a section wrote; a last line cut off by a kill is dropped."""
    rows = []
    path = Path(path)
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


# ---- the device and the process group ----------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_of_one_env(dry_run: bool) -> dict:
    """The environment of a world of one, as ``torchrun --nproc_per_node 1`` sets it (``launch.init_distributed``,
    Lightning and Accelerate read it), on a fresh port."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONFAULTHANDLER": "1"}
    if dry_run:  # the CPU path even on a machine with a GPU
        env.update(CUDA_VISIBLE_DEVICES="", ULTRASCALE_DEVICE="cpu")
    return env


def device() -> torch.device:
    """This process's device as the package picks it (``launch.device_for_rank``: CUDA unless told otherwise)."""
    from ultrascale_plugins.distributed import launch

    return launch.device_for_rank()


def synchronize() -> None:
    if torch.cuda.is_available() and device().type == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    """Between two runs in one section: drop what the last one left (its model, optimizer, compiled graphs)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def quiet() -> None:
    """The warnings every run prints that say nothing about the results (as the CLI silences them)."""
    import logging
    import warnings

    from ultrascale_plugins.cli.train import quiet_known_warnings

    quiet_known_warnings()
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in ("torchao", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


# ---- models and batches ------------------------------------------------------------------------------------
def small_llama(sizes: Sizes, seed: int = 0):
    """The correctness checks' Llama, built on the CPU from ``seed`` (the same weights on every device)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**sizes.small), attn_implementation="sdpa")


def small_llama_config(sizes: Sizes):
    from transformers import LlamaConfig

    return LlamaConfig(**sizes.small)


def random_batches(count: int, rows: int, seq: int, vocab: int, seed: int = 1) -> list[dict]:
    """Random token rows (labels = inputs: every token a target), the same for every run of a check."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (rows, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def train_losses(pmodel, optimizer, batches) -> list[float]:
    """One optimizer step per batch, clipping at 1.0 (the tests' loop, ``tests/models.train_steps``)."""
    from models import train_steps

    return train_steps(pmodel, optimizer, range(len(batches)), batches)


def max_abs_diff(a, b) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=float("nan"))


def max_state_diff(state: dict, reference: dict) -> float:
    """Largest |difference| over the tensors of two state dicts with the same keys (a missing key: infinity)."""
    if set(state) != set(reference):
        return float("inf")
    return max(((state[k].float().cpu() - reference[k].float().cpu()).abs().max().item() for k in reference),
               default=0.0)
