"""TRL's trainers' contract as ``UltraScaleTrainer`` keeps it on a layout (what and why: ``trl``'s docstring): the
TRL versions and trainers known here, what is refused at construction, SFT's and DPO's loss and metrics from the
parallel model's per-token outputs, the reference's log-probabilities, and the model card. ``UltraScaleTrainer``
calls these on a class built on a TRL trainer; ``trl`` builds the public classes on ``UltraScaleTrainer``."""
from __future__ import annotations

import collections
import contextlib

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
    for kind, trainer in (("sft", "SFTTrainer"), ("dpo", "DPOTrainer")):
        if trainer in names:  # UltraScale{SFT,DPO}Trainer, or a class of the user's on UltraScaleTrainer and it
            return kind
    raise ConfigError(f"{cls.__name__} builds on TRL's {names[0]}: out of scope: trainers that generate (GRPO, "
                      "RLOO, online DPO, ...) and TRL's others are not supported. Fix: use UltraScaleSFTTrainer or "
                      "UltraScaleDPOTrainer, or the plain TRL trainer without ultrascale")


def refuse_sft_arguments(args) -> None:
    """The SFTConfig (or DPOConfig) values this integration cannot honour, each refused naming the field and the
    fix."""
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
            raise ConfigError(f"{type(args).__name__}({field}={getattr(args, field)!r}) with ultrascale: {fix}")


def refuse_pipeline(pp: int, kind: str = "sft", peft: bool = False) -> None:
    if pp > 1 and kind == "dpo" and peft:
        raise ConfigError(f"UltraScaleDPOTrainer with pp={pp} and a PEFT model: the reference is the model with its "
                          "adapters disabled, and a pipeline's stages hold their own copies of the adapters, which "
                          "TRL's switch does not reach: not available yet. Fix: pp: 1, or a reference model "
                          "(ref_model=) with full fine-tuning")


def router_loss_enabled(model, args) -> bool:
    """Whether TRL's trainer adds a mixture of experts' router auxiliary loss for ``model`` under ``args`` (TRL's
    rule: the model returns router logits, and the coefficient, TRL's or the config's, is not 0)."""
    if model is None or isinstance(model, str) or not hasattr(model, "config"):
        return False
    text = model.config.get_text_config()
    coef = getattr(args, "router_aux_loss_coef", None)
    coef = getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef
    return hasattr(text, "output_router_logits") and bool(coef)


def refuse_router_loss_in_pipeline(pp: int, enabled: bool, kind: str = "sft") -> None:
    if pp > 1 and enabled:
        raise ConfigError(f"UltraScale{kind.upper()}Trainer with pp={pp} and a router auxiliary loss: a pipeline "
                          "computes it per pipeline micro-batch, TRL over its whole batch, and the two differ. Fix: "
                          "pp: 1 (expert parallel is), or router_aux_loss_coef=0")


# DPOConfig values the layout cannot honour: (field, is it set, why and the fix)
def _dpo_taken(args):
    losses = list(getattr(args, "loss_type", None) or ["sigmoid"])
    return [("use_weighting", getattr(args, "use_weighting", False),
             "WPO's weights need each token's log Σp², which the parallel head does not compute: set it to False"),
            ("sync_ref_model", getattr(args, "sync_ref_model", False),
             "TR-DPO's reference updates are not available on a sharded reference yet: set it to False"),
            ("loss_type", any(t in ("aot", "aot_unpaired") for t in losses),
             "AOT sorts the pairs of a micro-batch, which data-parallel ranks split: use another loss type"),
            ("loss_type", "sft" in losses,
             "its term is a mean over the micro-batch's chosen tokens, which data-parallel ranks split: use "
             "SFT before DPO, or another loss type")]


def refuse_dpo_arguments(args, dp: int) -> None:
    """The DPOConfig values this integration cannot honour (the loss types only where ``dp`` > 1 splits the
    micro-batch's pairs), each refused naming the field and the fix."""
    for field, bad, fix in _dpo_taken(args):
        if bad and (field != "loss_type" or dp > 1):
            raise ConfigError(f"DPOConfig({field}={getattr(args, field)!r}) with UltraScaleDPOTrainer"
                              f"{' and ' + str(dp) + ' data-parallel replicas' if field == 'loss_type' else ''}: "
                              f"{fix}")


def before_init(kind: str, args: tuple, kwargs: dict, plugin) -> None:
    """``UltraScaleTrainer.__init__`` of a TRL trainer, before its own: what is refused (module docstring)."""
    where = 1 if kind == "sft" else 2  # SFTTrainer(model, args, ...), DPOTrainer(model, ref_model, args, ...)
    trl_args = kwargs.get("args") if "args" in kwargs else (args[where] if len(args) > where else None)
    config = getattr(plugin, "config", None)
    if trl_args is not None:
        refuse_sft_arguments(trl_args)
        if kind == "dpo":
            refuse_dpo_arguments(trl_args, config.dp if config is not None else 1)
    if kwargs.get("compute_loss_func") is not None:
        raise ConfigError(f"UltraScale{kind.upper()}Trainer(compute_loss_func=...): a loss of the whole logits, "
                          "which the layout never builds. Fix: TRL's loss_type instead")
    if config is not None:
        model = kwargs.get("model", args[0] if args else None)
        refuse_router_loss_in_pipeline(config.pp, router_loss_enabled(model, trl_args), kind)
        peft = kwargs.get("peft_config") is not None or hasattr(model, "peft_config")
        refuse_pipeline(config.pp, kind, peft)


def after_init(trainer) -> None:
    """After the TRL trainer's ``__init__``: the resolved layout checked against what TRL decided (the refusals of
    ``before_init`` once more, for a layout from the launch or with degrees left to resolve); TRL's patch of the
    model's forward (its fused head) removed, since the parallel model provides the head's outputs."""
    from ..distributed.launch import refuse

    kind, config = trainer._trl, trainer.accelerator.ultrascale_config
    try:
        if kind == "dpo":
            refuse_dpo_arguments(trainer.args, config.dp)
        refuse_router_loss_in_pipeline(config.pp, getattr(trainer, "aux_loss_enabled", False), kind)
        refuse_pipeline(config.pp, kind, hasattr(trainer.model, "peft_config"))
    except ConfigError as exc:
        refuse(exc)
    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    base.__dict__.pop("forward", None)
    reference = getattr(trainer, "ref_model", None)
    if reference is not None and hasattr(reference, "pmodel"):  # DPO's reference, parallelized in the layout
        reference.pmodel.module.__dict__.pop("forward", None)


def compute_loss(trainer, model, inputs, return_outputs=False, num_items_in_batch=None):
    """SFTTrainer's loss and metrics from the parallel model's per-token outputs (module docstring)."""
    import torch
    from trl import SFTTrainer

    adapter = trainer._ultrascale_adapter()
    if adapter is None:  # not prepared yet (an evaluation before train): TRL's own, on one process
        return SFTTrainer.compute_loss(trainer, model, inputs, return_outputs, num_items_in_batch)
    mode = "train" if model.training else "eval"  # the model that runs (a pipeline's stages are not trainer.model)
    if return_outputs:
        raise ConfigError("compute_loss(return_outputs=True): the layout never builds the whole logits. Fix: "
                          "evaluate with prediction_loss_only=True")
    pmodel = adapter.pmodel
    metrics = trainer._metrics[mode]
    batch = {k: v for k, v in inputs.items() if k != "use_cache"}
    if adapter.pipelined:  # the loss runs on the last stage, inside the schedule: TRL's there, as an objective
        sums = torch.zeros(3, dtype=torch.float64, device=pmodel.device)

        def objective(chunk, out, scale):
            nonlocal sums
            sums = sums + _sft_stats(out)
            return _sft_token_losses(trainer, out).sum() * scale

        with pmodel.outputs.with_objective(objective):
            loss = model(**batch).loss
        sums = pmodel.outputs.from_last_stage(sums)
    else:
        out = model(**batch, fused_lm_head=True)
        loss_sum = _sft_token_losses(trainer, out).sum()
        if out.terms:  # a mixture of experts' router auxiliary loss (coefficient included), over the global batch
            # TRL adds it to each micro-batch's loss divided by the window's micro-batches; the window weighs this
            # micro-batch by its token share (UltraScaleTrainer.training_step: current_gradient_accumulation_steps
            # is 1 / share)
            weight = trainer.current_gradient_accumulation_steps / max(1, trainer.args.gradient_accumulation_steps)
            loss_sum = pmodel.tokens.add_terms(loss_sum, [t * weight for t in out.terms], out.count)
            if trainer.aux_loss_enabled and trainer.router_aux_loss_coef:
                metrics["aux_loss"].append(float(sum(t.detach() for t in out.terms)) / trainer.router_aux_loss_coef)
        loss = pmodel.tokens.mean(loss_sum, out.count)
        sums = _sft_stats(out)
    # the metrics over every rank holding other tokens, as one process holding them all computes them
    valid, entropy, correct = (float(x) for x in pmodel.tokens.sum_over_tokens(sums))  # data- and context-parallel
    metrics["entropy"].append(entropy / valid if valid > 0 else 0.0)
    metrics["mean_token_accuracy"].append(correct / valid if valid > 0 else 0.0)
    if mode == "train":  # the rows' tokens (padding-free: their positions), every data-parallel replica's
        local = inputs["attention_mask"].sum() if "attention_mask" in inputs else torch.tensor(
            inputs["position_ids"].numel())
        trainer._total_train_tokens += int(pmodel.tokens.sum_over_rows(local.reshape(1).double().cpu())[0])
    metrics["num_tokens"] = [trainer._total_train_tokens]
    return loss


def _sft_token_losses(trainer, out):
    """Each token's loss under TRL's ``loss_type`` (nll; dft: weighted by its probability, without gradient)."""
    per_token = -out.log_probs  # zero where the label is ignored
    if trainer.args.loss_type == "dft":
        per_token = per_token * out.log_probs.exp().detach()
    return per_token


def _sft_stats(out):
    """(valid tokens, summed entropy, top-1 hits) of a micro-batch's outputs on this rank, fp64."""
    import torch

    return torch.stack([out.label_mask.sum(), out.entropy.sum(), out.is_top1.sum()]).double()


class WholeRowsHead:
    """A parallel model called the way TRL's DPOTrainer calls its fused head (``fused_lm_head=True``), answering
    with TRL's fields for each row whole, ``seq_len - 1`` next-token figures (``pmodel.outputs.token_outputs(
    whole_rows=True)``): every per-row sum TRL takes (a sequence's log-likelihood) is the whole row's on every rank
    holding some of its tokens. ``aux_loss``: a mixture of experts' router loss over the global batch without its
    coefficient, its gradient scaled for ``row_mean`` (each rank's carries its own tokens' part of it)."""

    def __init__(self, adapter):
        self.adapter = adapter

    def __call__(self, **kwargs):
        out = self.adapter(**kwargs, whole_rows=True)
        aux = None
        if out.terms:
            term = sum(out.terms)
            coef = float(getattr(self.adapter.config.get_text_config(), "router_aux_loss_coef", 0.0) or 0.0)
            dp = self.adapter.pmodel.dims.dp
            scaled = term * dp  # row_mean averages the replicas' gradients; the term's parts add up
            aux = (scaled + (term - scaled).detach()) / (coef or 1.0)
        return GivenHead({name: getattr(out, name) for name in FIELDS}, aux_loss=aux)()


def dpo_compute_loss(trainer, model, inputs, return_outputs=False, num_items_in_batch=None):
    """DPOTrainer's loss and metrics, TRL's own code run on the parallel model's whole rows: the reference's
    log-probabilities first (the sharded reference model, or for a PEFT model the policy with its adapters
    disabled, as TRL does; precomputed ones from the batch), then TRL's loss, a mean over this rank's pairs, made
    the micro-batch's (``row_mean``: the mean over the data-parallel replicas)."""
    from trl import DPOTrainer

    adapter = trainer._ultrascale_adapter()
    if adapter is None:  # not prepared yet (an evaluation before train): TRL's own, on one process
        return DPOTrainer.compute_loss(trainer, model, inputs, return_outputs, num_items_in_batch)
    if return_outputs:
        raise ConfigError("compute_loss(return_outputs=True): the layout never builds the whole logits. Fix: "
                          "evaluate with prediction_loss_only=True")
    if "ref_chosen_logps" not in inputs:
        reference = trainer.ref_model if trainer.ref_model is not None else adapter
        chosen, rejected = reference_log_probs(trainer, reference, inputs)
        inputs = {**inputs, "ref_chosen_logps": chosen, "ref_rejected_logps": rejected}
    if adapter.pipelined:
        return _pipelined_dpo_loss(trainer, model, inputs)
    with _precomputed(trainer):  # TRL reads the reference's log-probabilities from the batch
        loss = DPOTrainer._compute_loss(trainer, WholeRowsHead(adapter), inputs, False)
    return adapter.pmodel.outputs.row_mean(loss)


FIELDS = ("log_probs", "entropy", "mean_logits", "is_top1", "label_mask")


class GivenHead:
    """Per-token outputs already computed (a pipeline's last stage: ``FIELDS`` of whole rows, targets-shaped),
    answered the way TRL's fused head answers (``seq_len - 1`` next-token figures)."""

    def __init__(self, fields: dict, aux_loss=None):
        self.fields, self.aux_loss = fields, aux_loss

    def __call__(self, **kwargs):
        from types import SimpleNamespace

        cut = {name: value[:, :-1] for name, value in self.fields.items()}
        return SimpleNamespace(**cut, aux_loss=self.aux_loss, log_sum_sq_probs=None, loss=None)


@contextlib.contextmanager
def _precomputed(trainer):
    """TRL's loss reading the reference's log-probabilities from the batch."""
    saved, trainer.precompute_ref_logps = trainer.precompute_ref_logps, True
    try:
        yield
    finally:
        trainer.precompute_ref_logps = saved


@contextlib.contextmanager
def _unlogged(trainer):
    """TRL's loss computed without what it logs (a pipeline micro-batch's part of the loss: the micro-batch's
    figures are logged once, over all its pairs). Its gathers for the metrics stay local: what they gather is
    discarded."""
    metrics, tokens = trainer._metrics, trainer._total_train_tokens
    accelerator = trainer.accelerator
    trainer._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    accelerator.gather = accelerator.gather_for_metrics = lambda data, *args, **kwargs: data
    try:
        yield
    finally:
        trainer._metrics, trainer._total_train_tokens = metrics, tokens
        del accelerator.gather, accelerator.gather_for_metrics  # the class's again


def _pipelined_rows(adapter, inputs, objective):
    """Run ``adapter`` (a pipeline) on TRL's rows with the completions as labels, ``objective(chunk, fields)``
    given each micro-batch's per-token outputs of whole rows on the last stage (the whole local batch outside
    training); returns the model's output."""
    pmodel = adapter.pmodel
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    batch = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "labels": labels}
    width = labels.shape[1]
    places = pmodel.outputs.token_places(batch)

    def run(chunk, out, scale):
        part = places if chunk is None else places.tensor_split(pmodel.tokens.microbatches_inside)[chunk]
        return objective(chunk, pmodel.outputs.whole_rows(out, part, width))

    with pmodel.outputs.with_objective(run):
        return adapter(**batch)


def reference_log_probs(trainer, reference, inputs):
    """The reference's summed log-probabilities of the chosen and the rejected completions (TRL's
    ``compute_ref_log_probs``) from ``reference``, a parallel model (the sharded reference, or the policy: a PEFT
    model's adapters disabled by TRL), on every rank; a pipeline computes them on its last stage."""
    import torch
    from trl import DPOTrainer

    if not reference.pipelined:
        return DPOTrainer.compute_ref_log_probs(trainer, WholeRowsHead(reference), inputs)
    got = {}

    def keep(chunk, out):
        got["fields"] = {name: getattr(out, name).detach() for name in FIELDS}
        return out.log_probs.detach().sum() * 0  # a forward-only pass: its value is not used

    with torch.no_grad():
        _pipelined_rows(reference, inputs, keep)
    rows = inputs["input_ids"].shape[0] // 2
    both = torch.zeros(2 * rows, device=inputs["input_ids"].device)
    if got:  # the last stage
        both = torch.cat(DPOTrainer.compute_ref_log_probs(trainer, GivenHead(got["fields"]), inputs)).float()
    return reference.pmodel.outputs.from_last_stage(both).chunk(2)


def _pipelined_dpo_loss(trainer, adapter, inputs):
    """DPO in a pipeline: the rows reordered so that each pipeline micro-batch holds whole pairs (its pairs'
    chosen rows, then their rejected rows, as TRL's collator orders a batch), each micro-batch's TRL loss computed
    on the last stage inside the schedule (its share of the gradient), then TRL's loss and metrics over every pair
    at once from the kept outputs, as a plain run logs them, handed to every stage."""
    import torch
    from trl import DPOTrainer

    pmodel = adapter.pmodel
    training = adapter.training and torch.is_grad_enabled()
    pairs = inputs["input_ids"].shape[0] // 2
    m = pmodel.tokens.microbatches_inside if training else 1
    if pairs % m:
        raise ConfigError(f"UltraScaleDPOTrainer with {m} pipeline micro-batches: {pairs} pairs per batch do not "
                          f"split into whole pairs per micro-batch. Fix: per_device_train_batch_size a multiple of "
                          f"{m} (pp_microbatches)")
    per = pairs // m
    order = torch.cat([torch.cat([torch.arange(k * per, (k + 1) * per), pairs + torch.arange(k * per, (k + 1) * per)])
                       for k in range(m)]).to(inputs["input_ids"].device)
    moved = {k: inputs[k].index_select(0, order) for k in ("input_ids", "attention_mask", "completion_mask")}
    kept: dict = {}
    weight = adapter.loss_scale * pmodel.dims.grad_scale / pmodel.dims.dp / m  # row_mean's rule, per micro-batch

    def objective(chunk, out):
        kept[chunk] = {name: getattr(out, name).detach() for name in FIELDS}
        if chunk is None:  # forward only: the figures come from the kept outputs below
            return out.log_probs.detach().sum() * 0
        rows = slice(2 * per * chunk, 2 * per * (chunk + 1))
        these = torch.arange(chunk * per, (chunk + 1) * per, device=order.device)
        part = {k: v[rows] for k, v in moved.items()}
        part.update(ref_chosen_logps=inputs["ref_chosen_logps"].index_select(0, these),
                    ref_rejected_logps=inputs["ref_rejected_logps"].index_select(0, these))
        with _precomputed(trainer), _unlogged(trainer):
            return DPOTrainer._compute_loss(trainer, GivenHead(
                {name: getattr(out, name) for name in FIELDS}), part, False) * weight

    _pipelined_rows(adapter, moved, objective)
    mode = "train" if adapter.training else "eval"
    value = torch.zeros((), device=pmodel.device)
    if kept:  # the last stage: TRL's loss and metrics of the whole batch, rows back in TRL's order
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        fields = {name: torch.cat([kept[c][name] for c in sorted(kept, key=lambda c: -1 if c is None else c)])
                  .index_select(0, back) for name in FIELDS}
        with torch.no_grad(), _precomputed(trainer):
            value = DPOTrainer._compute_loss(trainer, GivenHead(fields), inputs, False).detach().float()
    value = pmodel.outputs.from_last_stage(value)
    logged = pmodel.outputs.from_last_stage(({k: list(v) for k, v in trainer._metrics[mode].items()},
                                     trainer._total_train_tokens))
    trainer._metrics[mode] = collections.defaultdict(list, logged[0])
    trainer._total_train_tokens = logged[1]
    with torch.no_grad():
        return pmodel.outputs.row_mean(value)


def precompute_reference(trainer, dataset, batch_size: int):
    """``dataset`` with TRL's ``ref_chosen_logps`` and ``ref_rejected_logps`` columns (``precompute_ref_log_probs``)
    computed by the parallel model (the sharded reference, or the policy before training; a PEFT model's adapters
    disabled): each data-parallel replica reads its share of the rows, and the results are gathered over the
    replicas only (their tensor-, context-parallel peers hold the same rows)."""
    import torch
    from torch.utils.data import DataLoader

    adapter = trainer._ultrascale_adapter()
    if adapter is None:
        adapter = trainer.accelerator.prepare(trainer.model)  # Trainer's own prepare reuses it (no second copy)
    reference = trainer.ref_model if trainer.ref_model is not None else adapter
    loader = trainer.accelerator.prepare_data_loader(DataLoader(
        dataset, batch_size=batch_size, collate_fn=trainer.data_collator, shuffle=False,
        num_workers=trainer.args.dataloader_num_workers, pin_memory=trainer.args.dataloader_pin_memory))
    chosen, rejected = [], []
    for batch in loader:
        c, r = reference_log_probs(trainer, reference, batch)
        c, r = trainer.accelerator.gather_for_metrics((c, r))
        chosen.append(c.cpu())
        rejected.append(r.cpu())
    for name in ("ref_chosen_logps", "ref_rejected_logps"):
        if name in dataset.column_names:
            dataset = dataset.remove_columns(name)
    return (dataset.add_column("ref_chosen_logps", torch.cat(chosen).tolist())
            .add_column("ref_rejected_logps", torch.cat(rejected).tolist()))


def write_model_card(trainer) -> None:
    """TRL's model card (README.md in ``output_dir``), as its trainers write it before each checkpoint."""
    from pathlib import Path

    hub = trainer.args.hub_model_id
    trainer.create_model_card(model_name=Path(trainer.args.output_dir).name if hub is None else hub.split("/")[-1])
