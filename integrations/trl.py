"""TRL's ``SFTTrainer`` on ultrascale layouts: ``UltraScaleSFTTrainer`` is ``UltraScaleTrainer`` and ``SFTTrainer``
in one (``pip install "ultrascale-plugins[trl]"``); a class of your own built on both (``class
MySFT(UltraScaleTrainer, SFTTrainer)``, ``UltraScaleTrainer`` first) works the same.

    from trl import SFTConfig
    from ultrascale_plugins.integrations.accelerate import UltraScalePlugin
    from ultrascale_plugins.integrations.trl import UltraScaleSFTTrainer

    trainer = UltraScaleSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds, processing_class=tokenizer,
                                   ultrascale_plugin=UltraScalePlugin(dp_shard=4, tp=2))
    trainer.train()

TRL's ``SFTTrainer`` patches the model's forward with its fused LM head (``fused_lm_head=True``: each token's
log-probability, entropy and top-1 hit, computed in tiles without the whole logits) and computes its loss and
metrics from them. Under a layout the patch cannot run: it calls the backbone directly, past the wrappers that
gather a sharded model's weights, and gathers a tensor-parallel head whole. Here the parallel model provides the
same contract (``ParallelModel.token_outputs``: the chunked loss's head, each rank holding its vocabulary shard,
the per-token figures reduced over the shards) and the trainer computes TRL's loss (``loss_type`` nll or dft) and
its logged metrics (``entropy``, ``mean_token_accuracy``, ``num_tokens``) from it, normalized once: each
micro-batch's loss is the global mean over its valid tokens, weighted by its share of the step's tokens, as a
one-process TRL run computes it. The head runs ``chunked_loss`` tokens at a time (1,024 when the layout leaves it
0), so no rank holds the logits of a micro-batch.

Refused at construction, naming the reason: a TRL version whose trainers' contract is not known here
(``TESTED_TRL``), TRL's other trainers (DPO is not yet here; GRPO, RLOO and the others that generate are out of
scope), and the TRL arguments that need the whole logits or that the layout owns: ``parallelism_config``,
``label_smoothing_factor``, ``compute_loss_func``, ``activation_offloading`` (the layout's ``activation_offload``
instead), Liger kernels; a pipeline (``pp > 1``). A mixture of experts' router auxiliary loss (TRL's
``router_aux_loss_coef``) is computed over the global batch, as one process computes it.
"""
from __future__ import annotations

from ..interface.config import ConfigError

# TRL minor versions whose SFTTrainer contract (its fused LM head's outputs, compute_loss, _metrics) this module
# implements and tests (tests/test_trl.py)
TESTED_TRL = ("1.16",)
# the chunk of tokens the head runs at a time when the layout sets none (TRL's own head is always fused)
DEFAULT_CHUNK = 1024


def trl_kind(cls) -> str | None:
    """``"sft"`` for a class built on TRL's ``SFTTrainer``, None for one built on no TRL trainer; any other TRL
    trainer, or an unknown TRL version, is refused (ConfigError). Reads ``sys.modules`` only: TRL is never
    imported for a Trainer that does not use it."""
    import sys

    trl = sys.modules.get("trl")
    bases = [c for c in cls.__mro__ if c.__module__.split(".")[0] == "trl"]
    if trl is None or not bases:
        return None
    version = getattr(trl, "__version__", "?")
    if ".".join(version.split(".")[:2]) not in TESTED_TRL:
        raise ConfigError(f"trl {version}: its trainers' contract is not known to ultrascale-plugins (tested: "
                          f"{', '.join(t + '.x' for t in TESTED_TRL)}). Fix: pip install 'trl~={TESTED_TRL[-1]}.0'")
    names = [c.__name__ for c in bases]
    if "SFTTrainer" in names:  # UltraScaleSFTTrainer, or a class of the user's on UltraScaleTrainer and SFTTrainer
        return "sft"
    first = names[0]
    why = ("not yet (SFTTrainer is: UltraScaleSFTTrainer)" if first == "DPOTrainer" else
           "out of scope: trainers that generate (GRPO, RLOO, online DPO, ...) and TRL's others are not supported")
    raise ConfigError(f"{cls.__name__} builds on TRL's {first}: {why}. Fix: use UltraScaleSFTTrainer, or the "
                      "plain TRL trainer without ultrascale")


def refuse_sft_arguments(args) -> None:
    """The SFTConfig values this integration cannot honour, each refused naming the field and the fix."""
    taken = [("parallelism_config", getattr(args, "parallelism_config", None) is not None,
              "the layout is ultrascale's: describe it with UltraScalePlugin"),
             ("label_smoothing_factor", getattr(args, "label_smoothing_factor", 0) > 0,
              "label smoothing needs the whole logits, which the layout never builds: set it to 0"),
             ("activation_offloading", getattr(args, "activation_offloading", False),
              "use the layout's activation_offload: true (UltraScalePlugin(activation_offload=True))"),
             ("use_liger_kernel", getattr(args, "use_liger_kernel", False),
              "Liger's kernels replace the modules the layout shards: leave it False")]
    for field, bad, fix in taken:
        if bad:
            raise ConfigError(f"SFTConfig({field}={getattr(args, field)!r}) with UltraScaleSFTTrainer: {fix}")


def refuse_pipeline(pp: int) -> None:
    if pp > 1:
        raise ConfigError(f"UltraScaleSFTTrainer with pp={pp}: TRL computes its loss from per-token log-probabilities "
                          "after the forward, and a pipeline runs its loss on the last stage, inside the schedule: "
                          "not available yet. Fix: pp: 1 (ZeRO, HSDP, tensor and context parallel are)")


def before_init(args: tuple, kwargs: dict, plugin) -> None:
    """``UltraScaleTrainer.__init__`` of an SFTTrainer, before Trainer's: what is refused (module docstring)."""
    sft_args = kwargs.get("args") if "args" in kwargs else (args[1] if len(args) > 1 else None)
    if sft_args is not None:
        refuse_sft_arguments(sft_args)
    if kwargs.get("compute_loss_func") is not None:
        raise ConfigError("UltraScaleSFTTrainer(compute_loss_func=...): a loss of the whole logits, which the layout "
                          "never builds. Fix: SFTConfig(loss_type='nll' or 'dft') instead")
    config = getattr(plugin, "config", None)
    if config is not None:
        refuse_pipeline(config.pp)


def after_init(trainer) -> None:
    """After Trainer's ``__init__``: a layout from the launch checked; TRL's patch of the model's forward (its fused
    head) removed, since the parallel model provides the head's outputs."""
    if getattr(trainer.ultrascale_plugin, "config", None) is None:  # the layout came from the launch
        from ..distributed.launch import refuse

        try:
            refuse_pipeline(trainer.accelerator.ultrascale_config.pp)
        except ConfigError as exc:
            refuse(exc)
    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    base.__dict__.pop("forward", None)


def compute_loss(trainer, model, inputs, return_outputs=False, num_items_in_batch=None):
    """SFTTrainer's loss and metrics from the parallel model's per-token outputs (module docstring)."""
    import torch
    from trl import SFTTrainer

    mode = "train" if trainer.model.training else "eval"
    adapter = trainer._ultrascale_adapter()
    if adapter is None:  # not prepared yet (an evaluation before train): TRL's own, on one process
        return SFTTrainer.compute_loss(trainer, model, inputs, return_outputs, num_items_in_batch)
    if return_outputs:
        raise ConfigError("compute_loss(return_outputs=True): the layout never builds the whole logits. Fix: "
                          "evaluate with prediction_loss_only=True")
    pmodel = adapter.pmodel
    out = model(**{k: v for k, v in inputs.items() if k != "use_cache"}, fused_lm_head=True)
    per_token = -out.log_probs  # zero where the label is ignored
    if trainer.args.loss_type == "dft":
        per_token = per_token * out.log_probs.exp().detach()
    loss_sum = per_token.sum()
    metrics = trainer._metrics[mode]
    if out.terms:  # a mixture of experts' router auxiliary loss (coefficient included), over the global batch
        # TRL adds it to each micro-batch's loss divided by the window's micro-batches; the window weighs this
        # micro-batch by its token share (UltraScaleTrainer.training_step: current_gradient_accumulation_steps is
        # 1 / share)
        weight = trainer.current_gradient_accumulation_steps / max(1, trainer.args.gradient_accumulation_steps)
        loss_sum = pmodel.add_loss_terms(loss_sum, [t * weight for t in out.terms], out.count)
        if trainer.aux_loss_enabled and trainer.router_aux_loss_coef:
            metrics["aux_loss"].append(float(sum(t.detach() for t in out.terms)) / trainer.router_aux_loss_coef)
    loss = pmodel.token_mean(loss_sum, out.count)
    # the metrics over every rank holding other tokens, as one process holding them all computes them
    sums = torch.stack([out.label_mask.sum(), out.entropy.sum(), out.is_top1.sum()]).double()
    valid, entropy, correct = (float(x) for x in pmodel.sum_over_tokens(sums))  # data- and context-parallel ranks
    metrics["entropy"].append(entropy / valid if valid > 0 else 0.0)
    metrics["mean_token_accuracy"].append(correct / valid if valid > 0 else 0.0)
    if mode == "train":  # the rows' tokens (padding-free: their positions), every data-parallel replica's
        local = inputs["attention_mask"].sum() if "attention_mask" in inputs else torch.tensor(
            inputs["position_ids"].numel())
        trainer._total_train_tokens += int(pmodel.sum_over_rows(local.reshape(1).double().cpu())[0])
    metrics["num_tokens"] = [trainer._total_train_tokens]
    return loss


def check_sft_layout(layout: dict, model_config, world_size: int, gpu: str, *, max_length: int = 4096,
                     batch_size: int = 1, accumulate: int = 1, max_grad_norm: float = 1.0) -> str:
    """The checks ``UltraScaleSFTTrainer`` runs before training, at full size without weights or GPUs: the layout
    (``layout``: ParallelConfig fields; TRL's chunked head added when it sets none) against ``world_size`` processes
    and the model (``model_config``, built on the meta device), the Trainer's loop, and the planner's per-rank memory
    estimate against the GPU preset ``gpu`` for ``batch_size`` rows of ``max_length`` tokens, ``accumulate``
    micro-batches a step. Refuses (ConfigError) what cannot run or fit; returns one line saying what fits."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..cli.main import check_memory
    from ..core.engine import validate, validate_loop
    from ..interface.config import ParallelConfig
    from ..planner.hardware import PRESETS

    config = ParallelConfig.from_dict(dict(layout))
    if not config.chunked_loss:
        config = config.replace(chunked_loss=DEFAULT_CHUNK)
    refuse_pipeline(config.pp)
    if gpu not in PRESETS:
        raise ConfigError(f"gpu={gpu!r}: not a preset. Fix: one of {', '.join(PRESETS)}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    resolved = validate(config, model_config, world_size, model=model)
    validate_loop(resolved, accumulate, max_grad_norm)
    memory = PRESETS[gpu].memory_gb
    mem = check_memory(resolved, model_config, model, world_size, max_length, batch_size, accumulate, world_size,
                       memory)  # refuses what does not fit
    gb = mem["total"] if mem is not None else float("nan")  # ULTRASCALE_SKIP_MEMORY_CHECK=1: not estimated
    fresh = ParallelConfig()
    changed = {k: v for k, v in resolved.to_dict().items() if v != getattr(fresh, k, v)}
    n = sum(p.numel() for p in model.parameters()) / 1e9
    return (f"ok: {model_config.model_type} ({n:.2f}B) on {world_size} x {gpu}, {changed}, {batch_size} x "
            f"{accumulate} rows of {max_length} tokens a step per replica: predicted {gb:.1f} GB per GPU "
            f"(of {memory:g})")


def _sft_trainer_class():
    from trl import SFTTrainer

    from .trainer import UltraScaleTrainer

    class UltraScaleSFTTrainer(UltraScaleTrainer, SFTTrainer):
        """TRL's ``SFTTrainer`` on an ultrascale layout (module docstring): ``UltraScaleTrainer`` does the work for
        any class built on both, this one included."""

    return UltraScaleSFTTrainer


def __getattr__(name: str):
    if name == "UltraScaleSFTTrainer":  # made on first use: importing this module needs no TRL
        cls = _sft_trainer_class()
        cls.__module__ = __name__
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
