"""Build a model on the meta device and initialize it shard by shard in several layouts (see tests/test_init.py).

    python -m torch.distributed.run --standalone --nproc_per_node N tests/init_worker.py OUT.pt SEED

One process runs the single-process layout, four processes every layout of LAYOUTS_4. Rank 0 saves
``{layout: {"state": full weights, "eval_loss": float, "tied": bool | None}}`` with ``torch.save``.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import make_config, padded_batches, rows  # noqa: E402

import ultrascale_plugins as us  # noqa: E402
from ultrascale_plugins.checkpoints.load import weights_for  # noqa: E402

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
ARCH = "llama8_tied"

LAYOUTS_4 = {
    "zero3_dp4": {"dp_shard": 4},
    "tp2_dp2": {"tp": 2, "dp_shard": 2},  # FSDP over TP: strided shards on dim 0
    "tp2_sp_dp2": {"tp": 2, "dp_shard": 2, "sequence_parallel": True},
    "pp2_dp2": {"pp": 2, "dp_shard": 2},
    "pp2_tp2": {"pp": 2, "tp": 2},
    "pp2_zbv_dp2": {"pp": 2, "dp_shard": 2, "pp_schedule": "zbv"},  # the tied embedding and head on one rank
    "ddp_dp4": {"dp_shard": 4, "zero_stage": 0},  # materialized before DDP wraps the model
}


def run(layout: dict, seed: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)  # as the CLI does: the initializer takes torch.initial_seed()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config(ARCH), attn_implementation="sdpa")
    pmodel = us.parallelize(model, us.ParallelConfig(**layout), init_weights=weights_for(model, None))
    tied = None
    if layout.get("pp", 1) == 1:
        tied = pmodel.module.lm_head.weight is pmodel.module.model.embed_tokens.weight
    batch = padded_batches(1)[0]
    loss = float(pmodel.eval_step(rows(batch, pmodel.data_parallel_rank, pmodel.data_parallel_size)))
    state = pmodel.full_state_dict()
    return {"state": state, "eval_loss": loss, "tied": tied}


def main() -> None:
    out, seed = sys.argv[1], int(sys.argv[2])
    us.init_distributed(timeout=120)
    layouts = {"single": {}} if dist.get_world_size() == 1 else LAYOUTS_4
    results = {}
    for name, layout in layouts.items():
        print(f"[init] layout {name} (rank {dist.get_rank()})", file=sys.stderr, flush=True)
        results[name] = run(layout, seed)
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
