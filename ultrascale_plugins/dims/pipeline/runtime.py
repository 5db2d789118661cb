"""The pipeline at run time on one rank: its stages under a ``torch.distributed.pipelining`` schedule, the
loss scaling that makes a pipelined step equal the unpipelined one, tied-weight gradient sums, a forward-only
validation pass and per-step busy/idle timing."""
from __future__ import annotations

import contextlib
import functools
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...interface.config import ConfigError
from ...models.placeholder import Absent
from ...interface.fake_values import is_fake
from ...interface.runtime import Runtime
from .fake_step import refuse_routed, skip_vote, static_shapes, value
from .split import LOOPED, SINGLE_STAGE, SPLIT_BACKWARD, V_SHAPED, microbatches, pp_rank_of_stage


class Pipeline(Runtime):
    """The schedule and its stages on this rank; built lazily at the first step, after every other transform
    has wrapped the stage modules (PipelineStage must wrap the final, FSDP-sharded module)."""

    backward_in_forward = True

    def __init__(self, ctx, stages, stage_ids, n_stages):
        self.ctx, self.stages, self.stage_ids, self.n_stages = ctx, stages, stage_ids, n_stages
        self.schedule = None
        self.scale = 1.0
        self._pmodel, self._has_mask = None, True  # the step's model and whether its batch has a mask
        self._target_chunks = None  # the step's targets, one block per micro-batch (the last stage's forward)
        pp_mesh = ctx.sub_mesh("pp")
        self.pp_group = pp_mesh.get_group()
        self.pp_rank = pp_mesh.get_local_rank()
        self.has_first = 0 in stage_ids
        self.has_last = n_stages - 1 in stage_ids
        self.tied = bool(ctx.plan is not None and ctx.plan.tied)
        self.root = ctx.plan.root if ctx.plan is not None else ""  # the causal LM inside a wrapper (PEFT's)
        self.tie_group = None
        self._chunk = None  # the micro-batch the last stage ran last (its loss is computed next)
        self._built_for: tuple | None = None  # the local batch shape the schedule's stages were built for
        self._tie_ready = False
        self.last_step_stats: dict | None = None  # busy/idle time of this rank's last training step
        self._busy = 0.0

    def _loss(self, output, targets):
        objective = self._pmodel.outputs.objective
        if objective is not None and not self.ctx.stand_in:  # a trainer's own loss of the per-token outputs
            return objective(self._chunk, self._token_outputs(output, targets), self.scale)
        return self._loss_sum(output, targets) * self.scale

    def _token_outputs(self, output, targets, count=None):
        """The last stage's per-token outputs of one micro-batch (``pmodel.outputs.token_outputs``' contract), with
        the plugins' loss terms (the router auxiliary loss, from every stage's router logits) and, where there are
        terms or it is given, its global valid-token count."""
        from types import SimpleNamespace

        from ...distributed.loss import token_outputs_of

        pmodel = self._pmodel
        logits, terms = output, []
        if isinstance(output, tuple):
            logits, routed, mask = output
            layers = tuple(routed.split(targets.numel())) if routed.numel() else ()
            seen = SimpleNamespace(logits=logits, router_logits=layers)
            terms = pmodel.outputs.loss_terms(seen, {"attention_mask": mask if self._has_mask else None})
        got = pmodel.ctx.loss_head.token_outputs(logits, targets)
        if got is None:
            got = token_outputs_of(logits, targets)
        # the global count (a collective) only where the loss terms need it: an objective normalizes its own way
        got.count = count if count is not None or not terms else pmodel.tokens.global_count(targets)
        got.terms = terms
        return got

    def _loss_sum(self, output, targets, count=None):
        """This rank's token-loss sum of one micro-batch (the last stage's ``output``), with the plugins' loss
        terms (``ultrascale_step_loss``'s ``terms``: the router auxiliary loss, from every stage's router logits)
        folded in by the micro-batch's global token count: summed over the micro-batches, each term weighs by its
        micro-batch's share of the step's tokens, as under gradient accumulation without a pipeline."""
        from types import SimpleNamespace

        pmodel = self._pmodel
        if not isinstance(output, tuple):
            return pmodel.outputs.token_loss_sum(output, targets)
        logits, routed, mask = output
        loss_sum = pmodel.outputs.token_loss_sum(logits, targets)
        layers = tuple(routed.split(targets.numel())) if routed.numel() else ()
        seen = SimpleNamespace(logits=logits, router_logits=layers)
        terms = pmodel.outputs.loss_terms(seen, {"attention_mask": mask if self._has_mask else None})
        if count is None:
            count = pmodel.tokens.global_count(targets)  # this micro-batch's, over every rank holding its tokens
        return pmodel.tokens.add_terms(loss_sum, terms, count)

    def build(self, ids: torch.Tensor):
        """The stages and the schedule for batches of ``ids``' shape. On fake tensors (a dry run) every stage is
        given the shapes it exchanges and the schedule's vote on them its outcome (``fake_step``); a real run's
        stages infer them from each other at the first step."""
        from torch.distributed import pipelining

        cfg = self.ctx.config
        fake = self._on_fake_tensors()
        for module in self.stages:  # a frozen first stage still hands on a graph (see build_stage)
            module.pipeline_options["grad_chain"] = cfg.pp_schedule in SPLIT_BACKWARD
        stages = [pipelining.PipelineStage(m, sid, self.n_stages, self.ctx.device, group=self.pp_group,
                                           **(self._static_shapes(ids, sid) if fake else {}))
                  for m, sid in zip(self.stages, self.stage_ids)]
        names = {**SINGLE_STAGE, **LOOPED, **V_SHAPED}
        cls = getattr(pipelining.schedules, names[cfg.pp_schedule])
        for stage in stages:
            self._time_compute(stage)
            if stage.is_last:
                self._give_targets(stage)
            _zero_inferred_inputs(stage)
            self._mark_stand_in(stage)
        arg = stages[0] if cfg.pp_schedule in SINGLE_STAGE else stages
        self.schedule = cls(arg, n_microbatches=microbatches(cfg), loss_fn=self._loss, scale_grads=False)
        if fake:
            skip_vote(self.schedule)
        if self.tied and not self._tie_ready:
            self._init_tie_group()
            self._tie_ready = True

    def _static_shapes(self, ids, stage_id: int) -> dict:
        """``fake_step.static_shapes`` for ``stage_id`` and this rank's batch of ``ids``: the hidden states cross
        in the weights' dtype (as ``_forward_only`` sends them)."""
        from .split import routed_logits_width

        lm = self.causal_lm(self.stages[0])
        refuse_routed(routed_logits_width(lm))
        rows = (ids.shape[0] // microbatches(self.ctx.config), ids.shape[1])
        hidden = (lm.config.get_text_config().hidden_size, self._held_dtype())
        return static_shapes(stage_id, self.n_stages, rows, hidden, lm.config.get_text_config().vocab_size)

    def _on_fake_tensors(self) -> bool:
        """Whether the stages' weights are fake tensors (a dry run's; the batch may still be real)."""
        weight = next(iter(self.stages[0].parameters()), None)
        return weight is not None and is_fake(weight.to_local() if isinstance(weight, DTensor) else weight)

    def _held_dtype(self) -> torch.dtype:
        """The dtype the stages hold their weights in, which the hidden states cross between stages in (fp32 under
        mixed precision: autocast keeps the residual stream fp32; bf16 where the weights are held in bf16)."""
        return next((p.dtype for p in self.stages[0].parameters() if p.is_floating_point()), torch.float32)

    def _mark_stand_in(self, stage) -> None:
        """torch infers a stage's shapes by running it on inputs made from metadata (and its backward): the
        context says so while it does (``ParallelContext.stand_in``)."""
        @contextlib.contextmanager
        def stand_in():
            self.ctx.stand_in = True
            try:
                yield
            finally:
                self.ctx.stand_in = False

        _around(stage, ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference"), stand_in)

    def _give_targets(self, stage) -> None:
        """Run each micro-batch's forward on the last stage inside ``pmodel.outputs.forward_targets`` with that
        micro-batch's targets (split as the schedule splits them: into equal row blocks)."""
        inner = stage.forward_one_chunk

        def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
            chunks = self._target_chunks
            if chunks is None:  # shape inference: no real batch
                return inner(fwd_chunk_id, *args, **kwargs)
            self._chunk = fwd_chunk_id  # the schedule computes this micro-batch's loss next
            per_token = self._pmodel.outputs.objective is not None
            with self._pmodel.outputs.forward_targets(chunks[fwd_chunk_id], per_token=per_token):
                return inner(fwd_chunk_id, *args, **kwargs)

        stage.forward_one_chunk = functools.wraps(inner)(forward_one_chunk)

    def _time_compute(self, stage) -> None:
        """Count the time this rank spends computing (forward, input-grad and weight-grad chunks); the rest of
        a step is bubble or communication."""
        @contextlib.contextmanager
        def timed():
            start = time.perf_counter()
            try:
                yield
            finally:
                self._busy += time.perf_counter() - start

        _around(stage, ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"), timed)

    def _init_tie_group(self):
        """Ranks holding the first and the last stage with the same data/tensor coordinates sum the tied
        embedding/head gradient. With V-shaped schedules both stages live on pp rank 0: summed locally."""
        mesh = self.ctx.mesh
        if self.ctx.config.pp_schedule in V_SHAPED:
            return
        grid = mesh.mesh  # pp is the outermost axis
        firsts, lasts = grid[0].flatten().tolist(), grid[-1].flatten().tolist()
        me = dist.get_rank()
        for a, b in zip(firsts, lasts):
            group = dist.new_group([a, b], timeout=_timeout())
            if me in (a, b):
                self.tie_group = group

    def causal_lm(self, stage: nn.Module) -> nn.Module:
        return stage.get_submodule(self.root) if self.root else stage

    def tied_params(self) -> list[nn.Parameter]:
        out = []
        for m in self.stages:
            sid, lm = m.pipeline_stage[0], self.causal_lm(m)
            embed = lm.get_input_embeddings()
            if sid == 0 and not isinstance(embed, Absent):
                out.append(embed.weight)
            elif sid == self.n_stages - 1 and not isinstance(lm.lm_head, Absent):
                out.append(lm.lm_head.weight)
        return out

    def sync_tied_grads(self):
        if not self.tied:
            return
        params = [p for p in self.tied_params() if p.grad is not None]
        if not params:
            return
        for p in params:  # an embedding's gradient may come back replicated: give it the weight's layout
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(placements=p.placements)
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        total = torch.stack(local).sum(0) if len(local) > 1 else local[0].clone()
        if self.tie_group is not None:
            dist.all_reduce(total, group=self.tie_group)
        for g in local:
            g.copy_(total)

    @torch.no_grad()
    def _forward_only(self, ids, mask, positions, targets, count) -> torch.Tensor:
        """Validation pass: the whole local batch through the stages in order, hidden states (and, with the router
        auxiliary loss on, the router logits so far) sent point to point. Written here because torch's
        ``schedule.eval()`` replays the training action list (with its backward actions) on the multi-stage
        schedules and fails there."""
        from .split import routed_logits_width

        modules = dict(zip(self.stage_ids, self.stages))
        lm = self.causal_lm(self.stages[0])
        held = self._held_dtype()
        hidden_size, width = lm.config.hidden_size, routed_logits_width(lm)
        x, routed, loss_sum = None, None, torch.zeros((), device=ids.device)
        for stage in range(self.n_stages):
            if stage not in modules:
                continue
            if stage == 0:
                x = ids
            elif stage - 1 not in modules:
                src = dist.get_global_rank(self.pp_group, pp_rank_of_stage(self.ctx.config, stage - 1))
                x = torch.empty(*ids.shape, hidden_size, device=ids.device, dtype=held)
                dist.recv(x, src=src, group=self.pp_group)
                if width:
                    rows = torch.zeros(1, dtype=torch.long, device=ids.device)
                    dist.recv(rows, src=src, group=self.pp_group)
                    routed = torch.empty(int(rows), width, device=ids.device)
                    dist.recv(routed, src=src, group=self.pp_group)
            args = (x, mask, positions) if stage == 0 else (x, mask, positions, ids, *((routed,) if width else ()))
            outputs = self._pmodel.outputs
            objective = outputs.objective
            last = stage == self.n_stages - 1
            with outputs.forward_targets(targets, objective is not None) if last else contextlib.nullcontext():
                out = modules[stage](*args)
            if last:
                if objective is not None:  # a trainer's own loss of the whole local batch
                    loss_sum = objective(None, self._token_outputs(out, targets, count=count), 1.0)
                else:
                    loss_sum = self._loss_sum(out, targets, count=count)
                break
            x, routed = out[0], (out[4] if width else None)
            if stage + 1 not in modules:
                dst = dist.get_global_rank(self.pp_group, pp_rank_of_stage(self.ctx.config, stage + 1))
                dist.send(x.to(held).contiguous(), dst=dst, group=self.pp_group)
                if width:
                    dist.send(torch.tensor([routed.shape[0]], device=ids.device), dst=dst, group=self.pp_group)
                    dist.send(routed.float().contiguous(), dst=dst, group=self.pp_group)
        return loss_sum

    # ---- the Runtime interface ------------------------------------------------------------------------
    def train_step(self, pmodel, batch, loss_scale: float) -> torch.Tensor:
        return self.step(pmodel, batch, train=True, loss_scale=loss_scale)

    def eval_step(self, pmodel, batch) -> torch.Tensor:
        return self.step(pmodel, batch, train=False)

    def norm_parameters(self, params):
        if self.has_last and self.tied:
            head = self.tied_params()[-1]  # the head's copy of the tied weight: count it once
            return [p for p in params if p is not head]
        return params

    def norm_group(self):
        return self.pp_group

    def after_backward(self, pmodel) -> None:
        self.sync_tied_grads()

    def from_last_stage(self, values):
        """``values`` as the last stage's rank holds them, on every stage's: a tensor all-reduced (the others pass
        zeros), any other object gathered."""
        if isinstance(values, torch.Tensor):
            out = values.clone() if self.has_last else torch.zeros_like(values)
            dist.all_reduce(out, group=self.pp_group)
            return out
        parts = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(parts, (self.has_last, values), group=self.pp_group)
        return next(v for last, v in parts if last)

    def gather_full_state(self, state: dict) -> dict:
        parts = [None] * dist.get_world_size(self.pp_group)  # every stage's part, on every rank
        dist.all_gather_object(parts, state, group=self.pp_group)
        return {k: v for part in parts for k, v in part.items()}

    @property
    def stats(self) -> dict | None:
        return self.last_step_stats

    def _stale(self, pmodel, shape: tuple) -> bool:
        """Whether the schedule is rebuilt for a batch of ``shape``: when this rank's or any data-parallel peer's
        shape changed. torch's shape inference runs a real forward and backward, so ZeRO's gathers and reductions
        of a stage run in it: data-parallel peers holding rows of other lengths rebuild together or their
        collectives pair up wrongly (a hang). Their pipeline peers hold the same rows and decide the same."""
        stale = self.schedule is None or shape != self._built_for
        if pmodel.dims.dp == 1:
            return stale
        return bool(value(pmodel.tokens.sum_over_rows(torch.tensor([int(stale)])), stale))  # fake: its own say

    def step(self, pmodel, batch, train: bool, loss_scale: float = 1.0) -> torch.Tensor:
        batch = pmodel.prepare_batch(batch)
        ids, targets = batch["input_ids"], batch["targets"]
        if train and self._stale(pmodel, tuple(ids.shape)):
            # torch's stages infer the shapes they send and receive on their first step and keep them: a batch of
            # another shape (a collator padding each batch to its longest row, as TRL's does) gets a schedule of
            # its own, its shapes inferred again
            self.build(ids)
            self._built_for = tuple(ids.shape)
        mask = batch.get("attention_mask")
        self._pmodel, self._has_mask = pmodel, mask is not None
        for module in self.stages:  # no mask: the stages pass None on, so packed rows keep their document masks
            module.pipeline_options["mask"] = mask is not None
        if mask is None:
            mask = torch.ones_like(ids)  # a stage input must be a tensor
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()
        m = microbatches(self.ctx.config)
        if train and ids.shape[0] % m:
            raise ConfigError(f"pp_microbatches={m}: this rank's batch of {ids.shape[0]} rows does not split into "
                              f"{m} micro-batches. Fix: make the per-rank batch a multiple of {m}")
        count = pmodel.tokens.global_count(targets)
        for module in self.stages:
            module.train(train)
        total = torch.zeros((), dtype=torch.float64, device=ids.device)
        with pmodel.autocast():
            if train:
                # on fake tensors the scale has no value; it sizes nothing, so any stands in
                self.scale = value(pmodel.tokens.loss_share(torch.tensor(loss_scale, dtype=torch.float64), count), 1.0)
                losses: list = []
                kwargs = {"target": targets, "losses": losses} if self.has_last else {}
                if _takes_return_outputs():  # else the last stage keeps every micro-batch's logits to merge them
                    kwargs["return_outputs"] = False
                self._busy, start = 0.0, time.perf_counter()
                self._target_chunks = targets.tensor_split(m) if self.has_last else None
                try:
                    with pmodel.loss_context():  # around the schedule: its loss and its backward
                        self.schedule.step(*((ids, mask, positions) if self.has_first else ()), **kwargs)
                finally:
                    self._target_chunks = None
                elapsed = time.perf_counter() - start
                self.last_step_stats = {"step_s": elapsed, "busy_s": self._busy,
                                        "idle_fraction": max(0.0, 1 - self._busy / elapsed)}
                pmodel.finish_backward()  # off inside pmodel.no_sync(): synced with the window's last step
                if self.has_last:
                    total += sum(value(loss.detach(), 0.0) for loss in losses) / self.scale
            else:
                with pmodel.loss_context():
                    total += value(self._forward_only(ids, mask, positions, targets, count), 0.0)
                # stages keep their parameters gathered between micro-batches and no backward follows to free
                # them: without this the next step could start from a copy older than the optimizer's update
                self.ctx.release_gathered(self.stages)
        for module in self.stages:
            module.train()
        dist.all_reduce(total, group=self.pp_group)  # only the last stage holds it: a sum is a broadcast
        return pmodel.tokens.reduce_loss(total, count)


@functools.cache
def _takes_return_outputs() -> bool:
    """Whether torch's schedules can be told not to merge and return the last stage's outputs (every
    micro-batch's logits, kept to the end of the step): ``return_outputs``, in the releases that have it. The step
    reads only the losses."""
    import inspect

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return "return_outputs" in inspect.signature(PipelineScheduleSingle.step).parameters


def _around(stage, names, context) -> None:
    """Run each of the stage's methods ``names`` (those it has: torch's private helpers change between releases)
    inside ``context()``; nothing else changes."""
    for name in names:
        inner = getattr(stage, name, None)
        if inner is None:
            continue

        def wrapped(*args, _inner=inner, **kwargs):
            with context():
                return _inner(*args, **kwargs)

        setattr(stage, name, functools.wraps(inner)(wrapped))


def _zero_inferred_inputs(stage) -> None:
    """torch (2.13) infers a stage's output shapes by running its forward once on inputs made from metadata with
    ``torch.empty``: token ids, positions and masks full of garbage, which models that index with them (CodeGen's
    sinusoidal position table, GPT-J) turn into an out-of-bounds crash. Zero them instead. Wraps the stage's
    private helper, where it exists; nothing else changes."""
    inner = getattr(stage, "_to_tensor", None)
    if inner is None:
        return

    def to_tensor(arg):
        out = inner(arg)
        if not isinstance(arg, torch.Tensor):  # made from metadata, not a real input
            with torch.no_grad():
                (out.to_local() if isinstance(out, DTensor) else out).zero_()
        return out

    stage._to_tensor = to_tensor


def _timeout():
    from ...distributed.launch import collective_timeout

    return collective_timeout()
