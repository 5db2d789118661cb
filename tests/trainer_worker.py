"""transformers.Trainer under ultrascale (see tests/test_accelerate.py).

    torchrun --nproc_per_node N trainer_worker.py OUT.json FIELD=VALUE ...   UltraScaleTrainer with that layout
    python trainer_worker.py OUT.json --reference                            plain Trainer, one process
"""
import json
import os
import sys
import warnings

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import make_model, padded_batches  # noqa: E402

warnings.filterwarnings("ignore")
GLOBAL_BATCH, STEPS = 8, 4
ROWS = [{k: v[i] for k, v in b.items()} for b in padded_batches(STEPS, GLOBAL_BATCH) for i in range(GLOBAL_BATCH)]


def main():
    from transformers import Trainer, TrainerCallback, TrainingArguments

    out, rest = sys.argv[1], sys.argv[2:]
    losses = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    reference = rest == ["--reference"]
    fields = {} if reference else {k: yaml.safe_load(v) for k, v in (a.split("=", 1) for a in rest)}
    if reference:
        cls, extra, dp = Trainer, {}, 1
    else:
        from ultrascale_plugins.config import ParallelConfig
        from ultrascale_plugins.integrations.accelerate import UltraScalePlugin
        from ultrascale_plugins.integrations.trainer import UltraScaleTrainer

        dp = ParallelConfig(**fields).resolve(int(os.environ["WORLD_SIZE"])).dp
        cls, extra = UltraScaleTrainer, {"ultrascale_plugin": UltraScalePlugin(**fields)}
    args = TrainingArguments(output_dir=os.path.dirname(out) + "/trainer",
                             per_device_train_batch_size=GLOBAL_BATCH // dp,
                             max_steps=STEPS, learning_rate=1e-3, weight_decay=0.01, max_grad_norm=0.5,
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                             train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True,
                             optim="adamw_torch", seed=0)
    trainer = cls(model=make_model("llama8_tied", seed=0), args=args, train_dataset=ROWS, callbacks=[Record()],
                  **extra)
    trainer.train()
    if not reference:
        trainer.save_model(os.path.dirname(out) + "/hf")
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses}, f)


if __name__ == "__main__":
    main()
