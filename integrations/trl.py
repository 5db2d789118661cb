"""TRL's ``SFTTrainer`` and ``DPOTrainer`` on ultrascale layouts: ``UltraScaleSFTTrainer`` and
``UltraScaleDPOTrainer`` are ``UltraScaleTrainer`` and the TRL trainer in one (``pip install
"ultrascale-plugins[trl]"``); a class of your own built on both (``class MySFT(UltraScaleTrainer, SFTTrainer)``,
``UltraScaleTrainer`` first) works the same.

    from trl import SFTConfig
    from ultrascale_plugins.integrations.accelerate import UltraScalePlugin
    from ultrascale_plugins.integrations.trl import UltraScaleSFTTrainer

    trainer = UltraScaleSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds, processing_class=tokenizer,
                                   ultrascale_plugin=UltraScalePlugin(dp_shard=4, tp=2))
    trainer.train()

TRL's trainers patch the model's forward with their fused LM head (``fused_lm_head=True``: each token's
log-probability, entropy, top-1 hit and mean logit, computed in tiles without the whole logits) and compute their
loss and metrics from them. Under a layout the patch cannot run: it calls the backbone directly, past the wrappers
that gather a sharded model's weights, and gathers a tensor-parallel head whole. Here the parallel model provides
the same contract (``pmodel.outputs.token_outputs``: the chunked loss's head, each rank holding its vocabulary
shard, the per-token figures reduced over the shards; 1,024 tokens at a time when the layout leaves
``chunked_loss`` 0, so no rank holds the logits of a micro-batch).

SFT: the trainer computes TRL's loss (``loss_type`` nll or dft) and its logged metrics (``entropy``,
``mean_token_accuracy``, ``num_tokens``) from this rank's tokens, normalized once: each micro-batch's loss is the
global mean over its valid tokens, weighted by its share of the step's tokens, as a one-process TRL run computes it.

DPO: TRL's own loss code runs on each rank's rows whole (``token_outputs(whole_rows=True)``: a sequence's
log-likelihood is the whole row's on every rank holding some of its tokens), after the reference's
log-probabilities (a reference model parallelized in the same layout and frozen, ``prepare_model(evaluation_mode=
True)``; a PEFT policy with its adapters disabled; or precomputed in the layout at the start of ``train``), and its
mean over this rank's pairs becomes the micro-batch's (``pmodel.outputs.row_mean``).

In a pipeline the loss runs on the last stage, inside the schedule: TRL's loss is computed there as the step's
objective (``pmodel.outputs.with_objective``) from each pipeline micro-batch's per-token outputs, DPO's rows
reordered so that every micro-batch holds whole pairs, and what TRL logs is computed once over the batch and handed
to every stage.

Refused at construction, naming the reason: a TRL version whose trainers' contract is not known here
(``TESTED_TRL``), TRL's other trainers (GRPO, RLOO and the others that generate are out of scope), the TRL
arguments that need the whole logits or that the layout owns: ``parallelism_config``, ``label_smoothing_factor``,
``compute_loss_func``, ``activation_offloading`` (the layout's ``activation_offload`` instead), Liger kernels; DPO's
that the parallel head or a sharded reference cannot honour (``trl_contract.refuse_dpo_arguments``); in a pipeline, a router
auxiliary loss and DPO with a PEFT model. A mixture of experts' router auxiliary loss (TRL's ``router_aux_loss_coef``)
is otherwise computed over the global batch, as one process computes it.
"""
from __future__ import annotations

from ..interface.config import ConfigError
from .trl_contract import DEFAULT_CHUNK


def check_sft_layout(layout: dict, model_config, world_size: int, gpu: str, *, max_length: int = 4096,
                     batch_size: int = 1, accumulate: int = 1, max_grad_norm: float = 1.0) -> str:
    """The checks ``UltraScaleSFTTrainer`` runs before training, at full size without weights or GPUs: the layout
    (``layout``: ParallelConfig fields; TRL's chunked head added when it sets none) against ``world_size`` processes
    and the model (``model_config``, built on the meta device), the Trainer's loop, and the planner's per-rank memory
    estimate against the GPU preset ``gpu`` for ``batch_size`` rows of ``max_length`` tokens, ``accumulate``
    micro-batches a step. Refuses (ConfigError) what cannot run or fit; returns one line saying what fits."""
    return _check_layout("sft", layout, model_config, world_size, gpu, max_length, batch_size, accumulate,
                         max_grad_norm, reference=False)


def check_dpo_layout(layout: dict, model_config, world_size: int, gpu: str, *, max_length: int = 2048,
                     batch_size: int = 1, accumulate: int = 1, max_grad_norm: float = 1.0,
                     reference: bool = True) -> str:
    """``check_sft_layout`` for ``UltraScaleDPOTrainer``: ``batch_size`` pairs, each a chosen and a rejected row of
    ``max_length`` tokens in one micro-batch, and with ``reference`` (a reference model kept: not a PEFT policy,
    nor ``precompute_ref_log_probs``) its weights held beside the policy's, sharded the same way (the policy's
    parameter bytes per rank once more; its forward runs without gradients, inside the policy's activation peak)."""
    return _check_layout("dpo", layout, model_config, world_size, gpu, max_length, 2 * batch_size, accumulate,
                         max_grad_norm, reference=reference)


def reference_weights_gb(policy_memory: dict | None) -> float:
    """What a DPO reference model's weights take per rank (GB), given the policy's memory estimate
    (``check_memory``): the policy's parameter bytes on its most loaded rank, since the reference is parallelized in
    the same layout from the same model (tests/test_trl.py measures it: equal on every tested layout)."""
    return policy_memory["params"] if policy_memory is not None else 0.0


def _check_layout(kind, layout, model_config, world_size, gpu, max_length, rows, accumulate, max_grad_norm,
                  reference: bool) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from ..planner.memory_check import check_memory
    from ..core.engine import validate, validate_loop
    from ..interface.config import ParallelConfig
    from ..planner.hardware import PRESETS

    config = ParallelConfig.from_dict(dict(layout))
    if not config.chunked_loss:
        config = config.replace(chunked_loss=DEFAULT_CHUNK)
    if gpu not in PRESETS:
        raise ConfigError(f"gpu={gpu!r}: not a preset. Fix: one of {', '.join(PRESETS)}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    resolved = validate(config, model_config, world_size, model=model)
    validate_loop(resolved, accumulate, max_grad_norm)
    memory = PRESETS[gpu].memory_gb
    held = 0.0
    if reference:  # the reference's weights: what the policy's take per rank, beside them
        mem = check_memory(resolved, model_config, model, world_size, max_length, rows, accumulate, world_size,
                           float("inf"))
        held = reference_weights_gb(mem)
        if mem is not None and mem["total"] + held > memory:
            raise ConfigError(f"model {model_config.model_type} with its DPO reference needs about "
                              f"{mem['total'] + held:.1f} GB per GPU in this layout (the policy {mem['total']:.1f}, "
                              f"the reference's weights {held:.1f}: the planner's estimate), but {gpu} has "
                              f"{memory:g} GB. Fix: shard over more GPUs (dp_shard, tp), train LoRA adapters (the "
                              "reference is then the base, no second copy), or precompute_ref_log_probs=True")
    else:
        mem = check_memory(resolved, model_config, model, world_size, max_length, rows, accumulate, world_size,
                           memory)  # refuses what does not fit
    gb = mem["total"] + held if mem is not None else float("nan")  # ULTRASCALE_SKIP_MEMORY_CHECK=1: not estimated
    fresh = ParallelConfig()
    changed = {k: v for k, v in resolved.to_dict().items() if v != getattr(fresh, k, v)}
    n = sum(p.numel() for p in model.parameters()) / 1e9
    what = (f"{rows // 2} pair(s), 2 rows each," if kind == "dpo" else f"{rows} rows") + f" of {max_length} tokens x "
    extra = f", a reference model's weights {held:.1f} GB included" if reference and mem is not None else ""
    return (f"ok: {model_config.model_type} ({n:.2f}B) on {world_size} x {gpu}, {changed}, {what}{accumulate} "
            f"micro-batches a step per replica: predicted {gb:.1f} GB per GPU (of {memory:g}){extra}")


def _sft_trainer_class():
    from trl import SFTTrainer

    from .trainer import UltraScaleTrainer

    class UltraScaleSFTTrainer(UltraScaleTrainer, SFTTrainer):
        """TRL's ``SFTTrainer`` on an ultrascale layout (module docstring): ``UltraScaleTrainer`` does the work for
        any class built on both, this one included."""

    return UltraScaleSFTTrainer


def _dpo_trainer_class():
    from trl import DPOTrainer

    from .trainer import UltraScaleTrainer

    class UltraScaleDPOTrainer(UltraScaleTrainer, DPOTrainer):
        """TRL's ``DPOTrainer`` on an ultrascale layout (module docstring): ``UltraScaleTrainer`` does the work for
        any class built on both, this one included."""

    return UltraScaleDPOTrainer


_MADE = {"UltraScaleSFTTrainer": _sft_trainer_class, "UltraScaleDPOTrainer": _dpo_trainer_class}


def __getattr__(name: str):
    if name in _MADE:  # made on first use: importing this module needs no TRL
        cls = _MADE[name]()
        cls.__module__ = __name__
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
