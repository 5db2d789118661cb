"""What a trainer reads when it computes its own loss, reached as ``pmodel.outputs``: per-token figures of a
micro-batch (``token_outputs``), rows put back together across the ranks that split them (``whole_rows``), the
loss of a mean over rows (``row_mean``), an objective run where a pipeline computes the loss (``with_objective``,
``from_last_stage``), and the pieces the built-in step assembles its loss from (``forward_targets``,
``token_loss_sum``, ``loss_terms``). TRL's trainers and ``hf_module.ParallelCausalLM`` read these; the token counts
and the loss-scale rule they rest on are ``pmodel.tokens`` (``core.tokens``)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..distributed.loss import token_loss_sum, token_outputs_of
from ..interface.config import ConfigError
from .batches import to_device

FIELDS = ("log_probs", "entropy", "is_top1", "label_mask", "mean_logits")  # TokenOutputs' per-token figures


class TrainerOutputs:
    """The outputs of one parallelized model for a trainer's own loss. ``objective``: the trainer's loss, run where
    the loss runs while ``with_objective`` is open (None: the token cross-entropy)."""

    def __init__(self, pmodel):
        self.pmodel = pmodel
        self.objective = None

    def forward_targets(self, targets: torch.Tensor, per_token: bool = False):
        """Where one micro-batch's forward runs: the model's loss head given its targets (a loss computed inside the
        forward reads them, ``interface.loss_head``; ``per_token``: each token's figures wanted)."""
        return self.pmodel.ctx.loss_head.targets(targets, per_token)

    def token_loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's token-loss sum of one micro-batch: the loss head's, when the forward computed it, else the
        cross-entropy of ``logits`` against ``targets``."""
        computed = self.pmodel.ctx.loss_head.loss_sum(logits, targets)
        return computed if computed is not None else token_loss_sum(logits, targets)

    def loss_terms(self, output, batch) -> list:
        """The plugins' extra terms of this micro-batch's loss (every ``pmodel.loss_parts``' ``terms``: a router's
        auxiliary loss), to fold in with ``pmodel.tokens.add_terms``."""
        return [term for part in self.pmodel.loss_parts for term in part.terms(output, batch)]

    def token_outputs(self, batch: dict, whole_rows: bool = False, **model_kwargs):
        """This rank's tokens of one micro-batch, each with the log-probability of its next-token target (the
        gradient flows), the entropy of its prediction, whether the target is its top-1 and the mean of its logits
        (no gradient), as a ``distributed.loss.TokenOutputs`` with the global valid-token count: what a trainer
        computing its own loss from per-token log-probabilities reads (TRL's fused LM head);
        ``pmodel.tokens.mean`` of its losses' sum is the micro-batch's loss. A head computing its loss in chunks
        gives them without the whole logits (``chunked_loss``). Not in a pipeline: its loss runs on the last
        stage, inside the schedule.

        ``whole_rows``: each of this rank's rows whole instead, as long as the batch's (the figures of the tokens
        other ranks hold, such as context parallel's, gathered without gradient; this rank's keep theirs, and any
        padding a dimension added is dropped), for a loss that is a function of each row's sum (a preference
        loss); ``row_mean`` of a mean over the rows is the micro-batch's loss. ``model_kwargs`` go to the model's
        forward (``output_router_logits``)."""
        pmodel = self.pmodel
        if pmodel.runtime.backward_in_forward:
            raise ConfigError("pp>1: per-token log-probabilities for a trainer's own loss are not available in a "
                              "pipeline (its loss runs on the last stage, inside the schedule). Fix: use pp: 1")
        width = batch["input_ids"].shape[1]
        places = self.token_places(batch) if whole_rows else None  # before the batch's own split
        batch = pmodel.prepare_batch(batch)
        targets = batch.pop("targets")
        count = pmodel.tokens.global_count(targets)
        with pmodel.autocast(), self.forward_targets(targets, per_token=True):
            output = pmodel.forward_module(**batch, use_cache=False, **model_kwargs)
        with pmodel.loss_context():
            got = pmodel.ctx.loss_head.token_outputs(output.logits, targets)
            if got is None:
                got = token_outputs_of(output.logits, targets)
        output.logits = None
        got.count, got.output, got.terms = count, output, self.loss_terms(output, batch)
        if not torch.is_grad_enabled():  # no backward frees what the forward gathered (a frozen reference's pass)
            pmodel.ctx.release_gathered(pmodel.modules)
        return self.whole_rows(got, places, width) if whole_rows else got

    def token_places(self, batch: dict) -> torch.Tensor:
        """Where in its row each token this rank will hold sits (-100: padding a dimension adds): every plugin's
        ``ultrascale_step_shard_batch`` run on the batch with each target replaced by its own position. The plugins
        split by position alone, so the real batch's tokens land where these positions do."""
        pmodel = self.pmodel
        rows, seq = batch["input_ids"].shape
        probe = to_device({k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")
                           if batch.get(k) is not None}, pmodel.device)
        probe["targets"] = torch.arange(seq, device=pmodel.device).expand(rows, seq).clone()
        for step in pmodel.batch_split:
            step.run(batch=probe, ctx=pmodel.ctx)
        return probe["targets"]

    def whole_rows(self, got, places: torch.Tensor, width: int):
        """``got``'s per-token figures put back in their rows, ``width`` tokens each: those of the ranks holding
        other tokens of the same rows (the token-counting axes that do not split rows) all-gathered without
        gradient, this rank's with theirs (its part of every row's sum). ``places``: ``token_places`` of the batch
        (its rows that ``got`` holds)."""
        dims = self.pmodel.dims
        names = tuple(a for a in dims.token_axes if a not in dims.row_axes)
        group = dims.group(names) if names else None
        local = torch.stack([getattr(got, f).detach().float() for f in FIELDS])
        slot = torch.where(places >= 0, places, width)  # padding goes to a column dropped below
        if group is None:
            parts, spots = [local], [slot]
        else:
            size = dist.get_world_size(group)
            parts = [torch.empty_like(local) for _ in range(size)]
            spots = [torch.empty_like(slot) for _ in range(size)]
            dist.all_gather(parts, local.contiguous(), group=group)
            dist.all_gather(spots, slot.contiguous(), group=group)
        rows = local.shape[1]
        whole = torch.zeros(len(FIELDS), rows, width + 1, device=local.device)
        for part, spot in zip(parts, spots):
            whole.scatter_(2, spot.unsqueeze(0).expand_as(part), part)
        whole = whole[..., :width]
        own = torch.zeros(rows, width + 1, device=local.device, dtype=got.log_probs.dtype)
        own = own.scatter(1, slot, got.log_probs - got.log_probs.detach())[:, :width]  # this rank's gradient path
        got.log_probs = whole[0].to(got.log_probs.dtype) + own
        got.entropy, got.mean_logits = whole[1], whole[4]
        got.is_top1, got.label_mask = whole[2].bool(), whole[3].bool()
        return got

    def row_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss from ``loss``, a mean over this rank's rows of figures of whole rows
        (``token_outputs(whole_rows=True)``: the same value on every rank holding other tokens of those rows,
        each rank's gradient flowing through its own tokens): its value the mean over the data-parallel replicas
        (each holding as many rows), its gradient scaled so that the engine's averaging over the gradient axes
        gives that mean's (the replicas' gradients averaged, the token-splitting ranks' summed). Under
        ``torch.no_grad``: the mean."""
        dims = self.pmodel.dims
        mean = loss.detach().to(torch.float64)
        group = dims.group(dims.row_axes)
        if group is not None:
            dist.all_reduce(mean, group=group)
        mean = (mean / dims.dp).float()
        if not torch.is_grad_enabled() or not loss.requires_grad:
            return mean
        scaled = loss * (dims.grad_scale / dims.dp)
        return scaled + (mean - scaled).detach()

    @contextlib.contextmanager
    def with_objective(self, objective):
        """Inside the block, a runtime that computes the loss inside the model call (a pipeline's last stage,
        inside its schedule) computes each micro-batch's as ``objective(chunk, outputs, scale)`` instead of the
        token cross-entropy: ``outputs`` the micro-batch's per-token ``TokenOutputs`` (``token_outputs``'
        contract), ``chunk`` its number in the step (None in a forward-only pass, whose outputs are the whole
        local batch's), ``scale`` the step's token-loss scale (the loss-scale rule of the step's global token count
        and its ``loss_scale``). What it returns is what the schedule differentiates; ``train_step`` and
        ``eval_step`` return the sum of its values over ``scale``, divided by the global token count. For a trainer
        that computes its own loss from per-token log-probabilities (TRL's) in a pipeline."""
        self.objective = objective
        try:
            yield
        finally:
            self.objective = None

    def from_last_stage(self, values):
        """``values`` (a small tensor, or any picklable object, an objective computed where the loss runs) as the
        rank holding the last stage has them, on every rank of the pipeline."""
        return self.pmodel.runtime.from_last_stage(values)
