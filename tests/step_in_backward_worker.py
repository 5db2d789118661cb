"""Worker: the optimizer step inside the backward (``optimizer_in_backward``) and the offloaded states
(``cpu_offload``) against the same layout without them, on 2 ranks: AdamW (foreach and fused) with weight decay
and a learning-rate schedule, no clipping. Per layout: the losses and final weights of both, whether any
gradient was left after a backward, where the parameters live, and a resume from a checkpoint written after two
steps. Writes a JSON file (rank 0)."""
import json
import sys
import tempfile

import torch
import torch.distributed as dist

import ultrascale_plugins as us
from models import make_model
from ultrascale_plugins.checkpoints.sharded import load_checkpoint, save_checkpoint

STEPS = 4
LAYOUTS = {
    "zero3_dp2": {"dp_shard": 2, "zero_stage": 3},
    "zero2_dp2": {"dp_shard": 2, "zero_stage": 2},
    "zero3_dp2_offload": {"dp_shard": 2, "zero_stage": 3, "cpu_offload": True},
}


def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (4, 16), generator=g) for _ in range(STEPS)]


def build(layout: dict, fused: bool):
    torch.manual_seed(0)
    pmodel = us.parallelize(make_model("llama"), us.ParallelConfig(**layout))
    opt = pmodel.prepare_optimizer(torch.optim.AdamW(list(pmodel.parameters()), lr=1e-2, weight_decay=0.1,
                                                     foreach=not fused, fused=fused))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return pmodel, opt, sched


def train(pmodel, opt, sched, data) -> tuple[list[float], bool]:
    losses, left = [], False
    for ids in data:
        mine = ids.chunk(pmodel.data_parallel_size)[pmodel.data_parallel_rank]
        loss = pmodel.train_step({"input_ids": mine, "labels": mine})
        left = left or any(p.grad is not None for p in pmodel.parameters())
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, left


def weights(pmodel) -> dict:
    return {k: v.float() for k, v in pmodel.full_state_dict().items()}


def run(layout: dict, fused: bool, root: str) -> dict:
    data = batches()
    base = build(layout, fused)
    base_losses, base_left = train(*base, data)
    stepped = build({**layout, "optimizer_in_backward": True}, fused)
    losses, left = train(*stepped, data)
    want, got = weights(base[0]), weights(stepped[0])
    # resume: two steps, a checkpoint, a fresh model and optimizer, the last two steps
    first = build({**layout, "optimizer_in_backward": True}, fused)
    train(*first, data[:2])
    path = save_checkpoint(first[0], first[1], root, step=2)
    again = build({**layout, "optimizer_in_backward": True}, fused)
    load_checkpoint(again[0], again[1], path)
    for _ in range(2):
        again[2].step()
    resumed, _ = train(*again, data[2:])
    after = weights(again[0])
    return {"base_losses": base_losses, "losses": losses,
            "loss_diff": max(abs(a - b) for a, b in zip(losses, base_losses)),
            "weight_diff": max(float((want[k] - got[k]).abs().max()) for k in want),
            "grads_left_in_backward": left, "base_grads_left": base_left,
            "resume_loss_diff": max(abs(a - b) for a, b in zip(resumed, losses[2:])),
            "resume_weight_diff": max(float((after[k] - got[k]).abs().max()) for k in got),
            "param_devices": sorted({str(p.device) for p in stepped[0].parameters()}),
            "grads_consumed": bool(stepped[0].gradients.consumed)}


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:] or list(LAYOUTS)
    us.init_distributed()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        dist.broadcast_object_list(shared)
        for name in names:
            for fused in (False, True):
                key = f"{name}:{'fused' if fused else 'foreach'}"
                results[key] = run(LAYOUTS[name], fused, f"{shared[0]}/{key.replace(':', '_')}")
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
