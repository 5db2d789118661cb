"""A job in which one rank fails (``raise``) or stalls (``stall``) at step 2, for tests/test_faults.py."""
import sys
import time

import torch

import ultrascale_plugins as us
from models import make_model, padded_batches, rows

mode, timeout = sys.argv[1], float(sys.argv[2])
us.init_distributed(timeout=timeout)
pmodel = us.parallelize(make_model("llama"), us.ParallelConfig(dp_shard=2))
opt = pmodel.build_optimizer(torch.optim.SGD, lr=0.1)
rank = torch.distributed.get_rank()
for step, batch in enumerate(padded_batches(6)):
    if step == 2 and rank == 1:
        if mode == "raise":
            raise RuntimeError("injected failure on rank 1")
        time.sleep(3600)  # stalls without dying: rank 0 must time out, not hang
    pmodel.train_step(rows(batch, pmodel.data_parallel_rank, pmodel.data_parallel_size))
    opt.step()
    opt.zero_grad()
print("finished", flush=True)
