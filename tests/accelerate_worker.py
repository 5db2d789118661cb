"""A standard Accelerate training loop (see tests/test_accelerate.py), started by ``accelerate launch``.

    accelerate launch --config_file F.yaml accelerate_worker.py OUT.json [--save-at K DIR] [--resume DIR]
        [--save-model DIR] [--accumulate N] [--adamw for_loop|foreach|fused] [--peft]
    python accelerate_worker.py OUT.json --reference CASE [CASE ...]
        CASE = REPLICAS:ACCUMULATE:ADAMW:ARCH[:peft]; one process, no Accelerate: the loop the parallel runs must
        equal, for each case (one start-up for all of them); OUT.json: {CASE: {"losses": [...]}}

The loop is what an Accelerate user writes: data prepared under PartialState().main_process_first() before the
Accelerator exists (Accelerate's own pattern; on a machine without a GPU that PartialState sets Accelerate up for one
process), prepare(model, optimizer, loader, scheduler), accumulate, backward, clip_grad_norm_ on sync steps,
optimizer/scheduler step, gather for the logged loss, save_state / load_state.
"""
import argparse
import json
import logging
import os
import sys
import warnings

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import make_model, padded_batches  # noqa: E402

warnings.filterwarnings("ignore")
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
ARCH = os.environ.get("TEST_ARCH", "llama8_tied")  # another architecture for a test (Qwen3, Qwen3-MoE for ep)
GLOBAL_BATCH, BATCHES, EPOCHS, CLIP = 8, 3, 2, 0.5
ROWS = [{k: v[i] for k, v in b.items()} for b in padded_batches(BATCHES, GLOBAL_BATCH) for i in range(GLOBAL_BATCH)]
PROBE = padded_batches(1, 4, seed=5)[0]
# torch's AdamW implementations: for_loop (the CPU default), foreach (the CUDA default), fused
ADAMW = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def schedule(step: int) -> float:
    return 1.0 / (1 + 0.1 * step)


def build_model(args, seed: int, arch: str = ARCH):
    """The test's model; with --peft wrapped by PEFT (LoRA on every linear layer, no dropout)."""
    model = make_model(arch, seed=seed)
    if not args.peft:
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed + 1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))


def reference(case: str) -> dict:
    """One process: global batches of 8 rows in order, the scheduler stepped once per replica per optimizer
    step (Accelerate's convention: the global batch grows with the data-parallel replicas), an optimizer step
    every `accumulate` micro-batches and at the end of each epoch (Accelerate's sync_with_dataloader)."""
    replicas, accumulate, adamw, arch, *peft = case.split(":")
    args = argparse.Namespace(replicas=int(replicas), accumulate=int(accumulate), adamw=adamw, peft=peft == ["peft"])
    model = build_model(args, seed=0, arch=arch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **ADAMW[args.adamw])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    losses = []
    loader = DataLoader(ROWS, batch_size=GLOBAL_BATCH)
    for _ in range(EPOCHS):
        for micro, batch in enumerate(loader, 1):
            loss = model(**batch).loss
            losses.append(loss.item())
            (loss / args.accumulate).backward()
            # Accelerate steps every `accumulate` micro-batches and at the end of the data loader
            if micro % args.accumulate == 0 or micro == len(loader):
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                for _ in range(args.replicas):
                    sched.step()
                opt.zero_grad()
    return {"losses": losses}


class Position:
    """The data position, saved and restored through register_for_checkpointing."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def train(args) -> dict:
    from accelerate import PartialState

    from ultrascale_plugins.integrations.accelerate import UltraScaleAccelerator

    with PartialState().main_process_first():  # a user's data preparation, before the Accelerator
        rows = list(ROWS)
    accelerator = UltraScaleAccelerator(gradient_accumulation_steps=args.accumulate)
    model = build_model(args, seed=7 if args.resume else 0)  # a resumed run must take everything from the state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **ADAMW[args.adamw])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    loader = DataLoader(rows, batch_size=GLOBAL_BATCH // accelerator.data_parallel_size)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    position = Position()
    accelerator.register_for_checkpointing(position)
    if args.resume:
        accelerator.load_state(args.resume)
    start = position.step
    losses, step = [], 0
    for _ in range(EPOCHS):
        for batch in loader:
            if step < start:
                step += 1
                continue
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(accelerator.gather(loss.detach()).mean().item())
            step += 1
            position.step = step
            if args.save_at and step == args.save_at[0]:
                accelerator.save_state(args.save_at[1])
    result = {"losses": losses, "data_parallel_size": accelerator.data_parallel_size,
              "num_processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
              "compile": accelerator.ultrascale_config.compile, "compiled_graphs": compiled_graphs(),
              "ep": accelerator.ultrascale_config.ep,
              "parallelized": len(accelerator.ultrascale_models)}
    if args.save_model:
        accelerator.save_model(model, args.save_model)
        model.eval()
        with torch.no_grad():
            out = accelerator.unwrap_model(model)(input_ids=PROBE["input_ids"], attention_mask=PROBE["attention_mask"])
        if out.logits is not None:
            result["probe_logits"] = out.logits.tolist()
    accelerator.print("ultrascale accelerate worker done")
    accelerator.end_training()
    return result


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--reference", nargs="+", metavar="CASE")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--save-at", nargs=2, metavar=("STEP", "DIR"))
    ap.add_argument("--resume")
    ap.add_argument("--save-model")
    ap.add_argument("--adamw", choices=list(ADAMW), default="for_loop")
    ap.add_argument("--peft", action="store_true", help="a PEFT (LoRA) model")
    args = ap.parse_args()
    if args.save_at:
        args.save_at = (int(args.save_at[0]), args.save_at[1])
    result = {case: reference(case) for case in args.reference} if args.reference else train(args)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
