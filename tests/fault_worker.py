"""Jobs in which one rank fails, for tests/test_faults.py.

    raise TIMEOUT        rank 1 raises at step 2
    stall TIMEOUT        rank 1 stops responding at step 2 (rank 0 must time out, not hang)
    kill_in_save TIMEOUT DIR   checkpoint at step 3, then rank 1 dies in the middle of the step-5 save
    restart TIMEOUT DIR  resume from DIR's newest checkpoint to step 6, then train 6 steps uninterrupted;
                         rank 0 prints both loss lists as JSON
"""
import json
import os
import sys
import time

import torch

import ultrascale_plugins as us
import ultrascale_plugins.checkpoints.sharded as ckpt
from models import make_model, padded_batches, rows

mode, timeout = sys.argv[1], float(sys.argv[2])
us.init_distributed(timeout=timeout)
rank = torch.distributed.get_rank()
BATCHES = padded_batches(6)


def build():
    pmodel = us.parallelize(make_model("llama"), us.ParallelConfig(dp_shard=2))
    return pmodel, pmodel.build_optimizer(torch.optim.AdamW, lr=1e-3)


def step(pmodel, opt, batch):
    loss = pmodel.train_step(rows(batch, pmodel.data_parallel_rank, pmodel.data_parallel_size))
    opt.step()
    opt.zero_grad()
    return loss.item()


pmodel, opt = build()
if mode in ("raise", "stall"):
    for i, batch in enumerate(BATCHES):
        if i == 2 and rank == 1:
            if mode == "raise":
                raise RuntimeError("injected failure on rank 1")
            time.sleep(3600)
        step(pmodel, opt, batch)
elif mode == "kill_in_save":
    directory = sys.argv[3]
    real_save = ckpt.dcp.save

    def dying_save(state, **kwargs):  # the save's own arguments (its storage writer names the directory)
        real_save(state, **kwargs)
        if rank == 1 and "00000005" in str(kwargs["storage_writer"].path):
            os._exit(17)  # shards written, commit not reached

    ckpt.dcp.save = dying_save
    for i, batch in enumerate(BATCHES):
        step(pmodel, opt, batch)
        if i + 1 in (3, 5):
            ckpt.save_checkpoint(pmodel, opt, directory, step=i + 1, extra={"data_position": i + 1})
elif mode == "restart":
    meta = ckpt.load_checkpoint(pmodel, opt, directory=sys.argv[3])
    resumed = [step(pmodel, opt, b) for b in BATCHES[meta["extra"]["data_position"]:]]
    pmodel, opt = build()
    full = [step(pmodel, opt, b) for b in BATCHES]
    if rank == 0:
        print("RESULT " + json.dumps({"step": meta["step"], "resumed": resumed, "uninterrupted": full}))
print("finished", flush=True)
