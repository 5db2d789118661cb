"""Tensor parallel's activation collectives per step, counted in one process on a fake 2-rank group.

Megatron's count per decoder layer: forward, one all-reduce (TP) or one all-gather + one reduce-scatter (SP) per
region (attention, MLP); the backward mirrors it. A region reduces its input's gradient once, after the
column-parallel projections' partial gradients are summed locally. The fake process group moves no data, so this
counts collectives without a launch; the values are proven by the parity cases (tests/parity_cases.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ACTIVATION = 1000  # elements: a tiny model's activation (4 x 16 x 64 / tp) against norm weights and routing values
CASES = ["llama:tp", "llama:sp", "llama_tied:sp", "qwen3:tp", "qwen3:sp", "gpt2:tp", "gpt2:sp", "qwen3_moe:sp",
         "deepseek_v3:tp"]


def _count(arch: str, layout: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    import ultrascale_plugins as us
    from models import make_model

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
                if op in name and "wait" not in name and args and torch.is_tensor(args[0]):
                    self.seen[op if args[0].numel() >= ACTIVATION else op + " (small)"] += 1
            return func(*args, **(kwargs or {}))

    model = make_model(arch.removesuffix("+lora"))
    if arch.endswith("+lora"):  # every linear layer of the decoder, as the PEFT tests do
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj"]))
    pmodel = us.parallelize(model, us.ParallelConfig(tp=2, dp_shard=1, sequence_parallel=layout == "sp"))
    ids = torch.randint(0, 256, (4, 16))
    with Count() as fwd:
        out = pmodel.module(input_ids=ids, labels=ids)
    with Count() as bwd:
        out.loss.backward()
    dist.destroy_process_group()
    return {"forward": dict(fwd.seen), "backward": dict(bwd.seen)}


def main(cases: list[str]) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(Path(__file__).parent))
    os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")
    out = {}
    for case in cases:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        out[case] = _count(*case.split(":"))
    print(json.dumps(out))


@pytest.fixture(scope="module")
def counts():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, __file__, *CASES], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


LAYERS = 2


def test_print(counts):
    print(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
