"""``transformers.Trainer`` on any ultrascale layout: a ``Trainer`` whose Accelerator is ``UltraScaleAccelerator``.

    from ultrascale_plugins.integrations.trainer import UltraScaleTrainer
    trainer = UltraScaleTrainer(model=model, args=TrainingArguments(..., save_strategy="no"),
                                train_dataset=ds, ultrascale_plugin=UltraScalePlugin(tp=2))
    trainer.train(); trainer.save_model("out/")     # every rank calls save_model (it streams shards)

The layout comes from ``ultrascale_plugin`` or, like any Accelerate run, from the launch (``ultrascale
accelerate-launch F.yaml train.py``). What works: training (loss, gradient accumulation, ``max_grad_norm``,
``bf16=True``), logging, evaluation loss, ``save_model``. What does not: Trainer checkpoints during training
(``save_strategy`` other than ``"no"``; the optimizer state is sharded — use the Accelerate loop's
``save_state`` for resumable checkpoints) and ``num_items_in_batch`` loss kwargs (the model's loss is already the
exact global mean).
"""
from __future__ import annotations

import functools

from transformers import Trainer

from ..config import ConfigError
from .accelerate import UltraScaleAccelerator, UltraScalePlugin


class UltraScaleTrainer(Trainer):
    def __init__(self, *args, ultrascale_plugin: UltraScalePlugin | None = None, **kwargs):
        self.ultrascale_plugin = ultrascale_plugin or UltraScalePlugin()
        super().__init__(*args, **kwargs)
        if self.args.save_strategy not in ("no", None) and str(self.args.save_strategy) not in ("no",
                                                                                              "SaveStrategy.NO"):
            raise ConfigError(f"save_strategy={self.args.save_strategy!r}: Trainer checkpoints are not available "
                              "with ultrascale (sharded optimizer state). Fix: save_strategy='no' and "
                              "trainer.save_model() at the end, or an Accelerate loop with save_state")
        # the adapter's loss is the global mean over every valid token already: no num_items_in_batch scaling
        self.model_accepts_loss_kwargs = False

    def create_accelerator_and_postprocess(self) -> None:
        import transformers.trainer as trainer_module

        original = trainer_module.Accelerator
        trainer_module.Accelerator = functools.partial(UltraScaleAccelerator,
                                                       ultrascale_plugin=self.ultrascale_plugin)
        try:
            super().create_accelerator_and_postprocess()
        finally:
            trainer_module.Accelerator = original

    def training_step(self, model, inputs, num_items_in_batch=None):
        for adapter in self.accelerator.ultrascale_models:  # a pipeline's backward runs inside the call
            adapter.loss_scale = 1.0 / self.current_gradient_accumulation_steps
        return super().training_step(model, inputs, num_items_in_batch)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        adapters = self.accelerator.ultrascale_models
        if not adapters:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        adapters[0].save_pretrained(output_dir)  # collective: every rank writes its shards
        if self.processing_class is not None and self.args.should_save:
            self.processing_class.save_pretrained(output_dir)


__all__ = ["UltraScaleTrainer"]
