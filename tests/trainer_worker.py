"""transformers.Trainer under ultrascale (see tests/test_accelerate.py and tests/test_trainer.py).

    torchrun --nproc_per_node N trainer_worker.py OUT.json FIELD=VALUE ... [OPTIONS]   UltraScaleTrainer, that layout
    python trainer_worker.py OUT.json --reference                                       plain Trainer, one process
    ... CASE --then CASE ...                                     several runs, one after the other, in one launch

OPTIONS (checkpoints, tests/test_trainer.py):
    --max-steps N          optimizer steps (default 4: one epoch of the 4 global batches; more runs more epochs)
    --accumulate N         gradient_accumulation_steps=N (the global batch of 8 rows stays: N micro-batches)
    --save-steps S         save_strategy="steps" every S steps (default: save_strategy="no")
    --save-limit L         save_total_limit
    --eval-steps E         evaluate every E steps on one batch; with --save-steps also load_best_model_at_end
    --keep STEP DIR        when checkpoint-STEP is saved, copy it to DIR (rotation may delete it later)
    --resume PATH          trainer.train(resume_from_checkpoint=PATH)
    --output-dir DIR       TrainingArguments.output_dir (default: OUT.json's directory/trainer)
    --no-save-model        skip the final save_model
    --torch-compile        TrainingArguments(torch_compile=True): ultrascale compiles each decoder layer
    --peft                 the model is a PEFT (LoRA) model
    --arch ARCH            the model's architecture (tests/models.py; default llama8_tied), e.g. qwen3_moe for ep
    --optim NAME           TrainingArguments(optim=NAME), e.g. adamw_torch_8bit (torchao's low-bit AdamW)
    --max-grad-norm X      TrainingArguments(max_grad_norm=X) (default 0.5: clipping at every step; 0: none)
    --fail-at-save STEP    the save of checkpoint-STEP raises after its shards are written (a crash while saving);
                           OUT.json then says whether an existing checkpoint-STEP was left untouched

TrainingArguments are the defaults a user has (no use_cpu=True: on a machine without a GPU transformers sets
Accelerate up for one process, which UltraScaleAccelerator corrects).

Every run but one with --no-save-model ends with trainer.save_model(OUT.json's directory/hf).
OUT.json: {"losses": [...], "grad_norms": [...], "steps": [...] (the step of each logged loss), "eval": [[step, eval_loss], ...],
"best": the best checkpoint or null, "samples": train_samples_per_second x train_runtime (the samples Trainer
counted), "ranks": per rank {"rank", "dp_rank", "rows": the training rows it read (indices into ROWS, in order),
"world_size" and "main" as Trainer sees them, "state_writes": trainer_state.json files it wrote}; with --save-steps
also "output_dir": the output directory as the run left it (a later run of the launch may write there, _listing);
with --fail-at-save also "failed" and "untouched"}.
"""
import json
import os
import shutil
import sys
import warnings

import torch
import yaml
from transformers.data.data_collator import default_data_collator
from transformers.trainer_callback import TrainerState

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import make_model, padded_batches  # noqa: E402

warnings.filterwarnings("ignore")
GLOBAL_BATCH, STEPS = 8, 4
ROWS = [{k: v[i] for k, v in b.items()} for b in padded_batches(STEPS, GLOBAL_BATCH) for i in range(GLOBAL_BATCH)]
ROW_INDEX = {tuple(row["input_ids"].tolist()): i for i, row in enumerate(ROWS)}
assert len(ROW_INDEX) == len(ROWS)
EVAL_ROWS = [{k: v[i] for k, v in b.items()} for b in padded_batches(1, GLOBAL_BATCH, seed=7)
             for i in range(GLOBAL_BATCH)]
OPTIONS = {"--max-steps": 1, "--save-steps": 1, "--save-limit": 1, "--eval-steps": 1, "--keep": 2, "--resume": 1,
           "--output-dir": 1, "--no-save-model": 0, "--reference": 0, "--fail-at-save": 1, "--accumulate": 1,
           "--torch-compile": 0, "--peft": 0, "--arch": 1, "--optim": 1, "--max-grad-norm": 1}


def parse(argv):
    out, opts, fields, i = argv[0], {}, [], 1
    while i < len(argv):
        a = argv[i]
        if a in OPTIONS:
            n = OPTIONS[a]
            opts[a] = argv[i + 1:i + 1 + n] if n else True
            i += 1 + n
        else:
            fields.append(a)
            i += 1
    return out, opts, {k: yaml.safe_load(v) for k, v in (a.split("=", 1) for a in fields)}


def run(argv):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    out, opts, fields = parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    losses, steps, evals, norms = [], [], [], []
    keep = opts.get("--keep")

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])
                norms.append(float(logs.get("grad_norm", "nan")))
                steps.append(state.global_step)
            if logs and "eval_loss" in logs:
                evals.append([state.global_step, logs["eval_loss"]])

        def on_save(self, args, state, control, **kwargs):
            if keep and state.global_step == int(keep[0]) and rank == 0:
                shutil.copytree(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"), keep[1])

    rows_read = []

    def collate(rows):
        """Trainer's default collator, noting which training rows this rank reads (evaluation rows are not noted)."""
        rows_read.extend(i for i in (ROW_INDEX.get(tuple(r["input_ids"].tolist())) for r in rows) if i is not None)
        return default_data_collator(rows)

    state_writes = []
    save_state = TrainerState.save_to_json

    def counted_save(self, json_path):
        state_writes.append(json_path)
        return save_state(self, json_path)

    TrainerState.save_to_json = counted_save
    reference = "--reference" in opts
    if reference:
        cls, extra, dp = Trainer, {}, 1
    else:
        from ultrascale_plugins.interface.config import ConfigError, ParallelConfig
        from ultrascale_plugins.integrations.accelerate import UltraScalePlugin
        from ultrascale_plugins.integrations.trainer import UltraScaleTrainer

        try:  # the per-device batch; a layout that cannot run is UltraScaleTrainer's to refuse (test_trainer.py)
            dp = ParallelConfig(**fields).resolve(int(os.environ["WORLD_SIZE"])).dp
        except ConfigError:
            dp = 1
        cls, extra = UltraScaleTrainer, {"ultrascale_plugin": UltraScalePlugin(**fields)}
    checkpoints = {}
    if "--save-steps" in opts:
        checkpoints = dict(save_strategy="steps", save_steps=int(opts["--save-steps"][0]))
        if "--save-limit" in opts:
            checkpoints["save_total_limit"] = int(opts["--save-limit"][0])
    evaluation = {}
    if "--eval-steps" in opts:
        evaluation = dict(eval_strategy="steps", eval_steps=int(opts["--eval-steps"][0]),
                          per_device_eval_batch_size=GLOBAL_BATCH // dp)
        if checkpoints:
            evaluation.update(load_best_model_at_end=True, metric_for_best_model="eval_loss")
    output_dir = opts["--output-dir"][0] if "--output-dir" in opts else os.path.dirname(out) + "/trainer"
    accumulate = int(opts.get("--accumulate", [1])[0])
    # TrainingArguments' defaults otherwise (the optimizer: adamw_torch_fused)
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=GLOBAL_BATCH // dp // accumulate,
                             gradient_accumulation_steps=accumulate,
                             max_steps=int(opts.get("--max-steps", [STEPS])[0]), learning_rate=1e-3,
                             weight_decay=0.01, max_grad_norm=float(opts.get("--max-grad-norm", [0.5])[0]),
                             lr_scheduler_type="linear",
                             logging_steps=1, report_to=[], train_sampling_strategy="sequential",
                             disable_tqdm=True, seed=0, torch_compile="--torch-compile" in opts,
                             **({"optim": opts["--optim"][0]} if "--optim" in opts else {}),
                             **({"save_strategy": "no"} | checkpoints), **evaluation)
    model = make_model(opts.get("--arch", ["llama8_tied"])[0], seed=0)
    if "--peft" in opts:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    trainer = cls(model=model, args=args, train_dataset=ROWS, callbacks=[Record()], data_collator=collate,
                  eval_dataset=EVAL_ROWS if evaluation else None, **extra)
    result = {}
    if "--fail-at-save" in opts:
        fail_at = int(opts["--fail-at-save"][0])
        existing = os.path.join(output_dir, f"checkpoint-{fail_at}")
        before = _snapshot(existing)
        save_rng = trainer._save_rng_state

        def failing(output_dir):
            if trainer.state.global_step == fail_at:
                raise RuntimeError("injected failure while saving")
            return save_rng(output_dir)

        trainer._save_rng_state = failing
    try:
        metrics = trainer.train(resume_from_checkpoint=opts["--resume"][0] if "--resume" in opts else None).metrics
        result["samples"] = metrics["train_samples_per_second"] * metrics["train_runtime"]
    except RuntimeError as exc:
        if "--fail-at-save" not in opts or "injected" not in str(exc):
            raise
        result.update(failed=str(exc), untouched=before is not None and _snapshot(existing) == before)
    if "--no-save-model" not in opts and "failed" not in result:
        trainer.save_model(os.path.dirname(out) + "/hf")
    TrainerState.save_to_json = save_state
    if not reference:
        mine = {"rank": rank, "dp_rank": trainer.accelerator.data_parallel_rank, "rows": rows_read,
                "world_size": trainer.args.world_size, "main": trainer.is_world_process_zero(),
                "state_writes": len(state_writes)}
        result["ranks"] = [None] * int(os.environ["WORLD_SIZE"])
        torch.distributed.all_gather_object(result["ranks"], mine)
    if rank == 0:
        result.update(losses=losses, grad_norms=norms, steps=steps, eval=evals,
                      best=trainer.state.best_model_checkpoint)
        if checkpoints and "failed" not in result:
            result["output_dir"] = _listing(output_dir)
        if hasattr(trainer.accelerator, "ultrascale_config"):
            from torch._dynamo.utils import counters

            result.update(compile=trainer.accelerator.ultrascale_config.compile,
                          compiled_graphs=counters["stats"]["unique_graphs"],
                          ep=trainer.accelerator.ultrascale_config.ep)
        with open(out, "w") as f:
            json.dump(result, f)


def _snapshot(directory):
    """(name, inode, mtime, size) of every file under a directory: any rewrite or replacement changes it."""
    if not os.path.isdir(directory):
        return None
    found = []
    for root, _, files in os.walk(directory):
        for name in files:
            st = os.stat(os.path.join(root, name))
            found.append((os.path.relpath(os.path.join(root, name), directory), st.st_ino, st.st_mtime_ns,
                          st.st_size))
    return sorted(found)


def _listing(output_dir) -> dict:
    """Every entry of a Trainer's output directory: {name: {"files", and for a checkpoint "global_step" (its
    trainer_state.json) and "optimizer_class" (its ultrascale.json)}}."""
    listing = {}
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        entry = listing[name] = {"files": sorted(os.listdir(path)) if os.path.isdir(path) else []}
        if "trainer_state.json" in entry["files"] and "ultrascale.json" in entry["files"]:
            with open(os.path.join(path, "trainer_state.json")) as f:
                entry["global_step"] = json.load(f)["global_step"]
            with open(os.path.join(path, "ultrascale.json")) as f:
                entry["optimizer_class"] = json.load(f)["optimizer"]["class"]
    return listing


def main():
    """Cases separated by ``--then`` run one after the other in these processes (one launch, several runs)."""
    case = []
    for a in sys.argv[1:] + ["--then"]:
        if a == "--then":
            run(case)
            case = []
        else:
            case.append(a)


if __name__ == "__main__":
    main()
