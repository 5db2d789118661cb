"""Pipeline parallel for unmodified Hugging Face decoders, on the ``pp`` axis, through
``torch.distributed.pipelining`` schedules.

Splitting: every stage is a copy of the causal LM in which the modules other stages own are replaced by
``Absent`` placeholders (no parameters, hidden states pass through). Layers keep their index in the
``ModuleList``, so parameter names (FQNs) are those of the unsplit model and a checkpoint from one layout loads in
another. Each stage runs the model's own forward — embeddings (first stage), rotary embeddings, causal and padding
masks, position ids (every stage, on the full sequence), norm and head (last stage) — so nothing about the
architecture is re-implemented here. The padding mask and the position ids travel with the hidden states from
stage to stage.

Loss: the last stage computes the model's causal-LM loss per micro-batch as a sum over valid tokens scaled by
``dp / global_valid_tokens`` (schedules' own 1/m scaling is off), so the gradient is that of the global-mean loss
whatever the micro-batches hold. Tied embeddings: the first stage's embedding and the last stage's head are
separate copies; after backward their gradients are summed, so they stay equal.
"""
from __future__ import annotations

import copy
import functools
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import ConfigError
from ..hookspecs import hookimpl

SINGLE_STAGE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
LOOPED = {"interleaved_1f1b": "ScheduleInterleaved1F1B", "zero_bubble": "ScheduleInterleavedZeroBubble"}
V_SHAPED = {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


class Absent(nn.Module):
    """Placeholder for a module another pipeline stage owns: no parameters, passes its input through."""

    def forward(self, hidden_states=None, *args, **kwargs):
        return hidden_states


def stages_per_rank(config) -> int:
    if config.pp_schedule in V_SHAPED:
        return 2
    if config.pp_schedule in LOOPED:
        return config.pp_virtual_stages
    return 1


def microbatches(config) -> int:
    return config.pp_microbatches or config.pp * stages_per_rank(config)


def stage_ids_for_rank(config, pp_rank: int) -> list[int]:
    p, v = config.pp, stages_per_rank(config)
    if config.pp_schedule in V_SHAPED:
        return [pp_rank, 2 * p - 1 - pp_rank]
    return [pp_rank + k * p for k in range(v)]


def split_layers(n_layers: int, n_stages: int, embed_cost: float = 1.0, head_cost: float = 1.0) -> list[int]:
    """Contiguous layer counts per stage minimising the most loaded stage, where the embedding (first stage) and
    the head (last stage) count as ``embed_cost`` / ``head_cost`` layers of work. Every stage gets a layer."""
    best: dict = {}

    def solve(stage: int, start: int):  # -> (max cost, counts) for stages stage.. over layers start..
        key = (stage, start)
        if key in best:
            return best[key]
        left = n_stages - stage
        extra = (embed_cost if stage == 0 else 0.0) + (head_cost if stage == n_stages - 1 else 0.0)
        if left == 1:
            result = (n_layers - start + extra, [n_layers - start])
        else:
            result = (float("inf"), [])
            for count in range(1, n_layers - start - (left - 1) + 1):
                rest_cost, rest = solve(stage + 1, start + count)
                cost = max(count + extra, rest_cost)
                if cost < result[0]:
                    result = (cost, [count, *rest])
        best[key] = result
        return result

    return solve(0, 0)[1]


def stage_layer_counts(config, n_layers: int) -> list[int]:
    n_stages = config.pp * stages_per_rank(config)
    if config.pp_split:
        return list(config.pp_split)
    return split_layers(n_layers, n_stages)


@hookimpl
def ultrascale_mesh_axes(config):
    return [("pp", config.pp)]


@hookimpl
def ultrascale_validate_config(config, model_config, world_size):
    if config.pp == 1:
        return
    v, m = stages_per_rank(config), microbatches(config)
    n_stages = config.pp * v
    layers = getattr(model_config, "num_hidden_layers", None)
    name = config.pp_schedule
    if name in SINGLE_STAGE and config.pp_virtual_stages != 1:
        raise ConfigError(f"pp_virtual_stages={config.pp_virtual_stages}: schedule '{name}' runs one stage per "
                          "rank. Fix: use pp_virtual_stages: 1, or pp_schedule: interleaved_1f1b")
    if name in LOOPED and v < 2:
        raise ConfigError(f"pp_schedule='{name}' needs pp_virtual_stages >= 2 (stages per rank). Fix: set "
                          "pp_virtual_stages: 2")
    if name in V_SHAPED and config.pp_virtual_stages not in (1, 2):
        raise ConfigError(f"pp_virtual_stages={config.pp_virtual_stages}: '{name}' places exactly 2 stages per "
                          "rank in a V. Fix: use pp_virtual_stages: 2")
    if layers is not None and n_stages > layers:
        raise ConfigError(f"pp={config.pp} x {v} stages per rank = {n_stages} stages but the model has "
                          f"num_hidden_layers={layers}. Fix: use fewer stages")
    if config.pp_split:
        if len(config.pp_split) != n_stages or sum(config.pp_split) != layers or min(config.pp_split) < 1:
            raise ConfigError(f"pp_split={config.pp_split}: needs {n_stages} positive layer counts summing to "
                              f"num_hidden_layers={layers}. Fix: e.g. pp_split: {split_layers(layers, n_stages)}")
    if name in ("1f1b",) and m < config.pp:
        raise ConfigError(f"pp_microbatches={m}: 1f1b needs at least pp={config.pp} micro-batches. Fix: set "
                          f"pp_microbatches: {config.pp} or more")
    if name in LOOPED and m % config.pp:
        raise ConfigError(f"pp_microbatches={m}: '{name}' needs a multiple of pp={config.pp}. Fix: set "
                          f"pp_microbatches: {config.pp * max(1, m // config.pp)}")
    if name in V_SHAPED and m < 2 * config.pp:
        raise ConfigError(f"pp_microbatches={m}: '{name}' needs at least 2*pp={2 * config.pp} micro-batches. "
                          f"Fix: set pp_microbatches: {2 * config.pp}")
    if config.loss_parallel:
        raise ConfigError("loss_parallel=True with pp > 1: the vocab-parallel loss is not available inside a "
                          "pipeline yet. Fix: set loss_parallel: false")


def _base(model):
    return getattr(model, model.base_model_prefix)


def pp_parts(model) -> tuple[list[str], str, list[str]]:
    """(modules before the layers, the layers' ModuleList, modules after) of the base model, read from the
    architecture's ``base_model_pp_plan`` (``embed_tokens``/``layers``/``norm``, ``embed_in``/``emb_dropout``/
    ``layers``/``final_layer_norm``, ...)."""
    plan = getattr(model.config, "base_model_pp_plan", None) or {}
    base = _base(model) if hasattr(model, "base_model_prefix") else None
    names = [n for n in plan if base is not None and hasattr(base, n)]
    lists = [n for n in names if isinstance(getattr(base, n), nn.ModuleList)]
    if len(lists) != 1 or not hasattr(model, "lm_head"):
        raise ConfigError(f"pp>1: model type '{model.config.model_type}' has no usable pipeline plan "
                          "(base_model_pp_plan naming its embeddings, layer list and final norm). Fix: use pp: 1, "
                          "or a model such as Llama, Qwen2, Mistral or GPT-NeoX")
    i = names.index(lists[0])
    return names[:i], lists[0], names[i + 1:]


def build_stage(model, stage_id: int, n_stages: int, layer_range: range) -> nn.Module:
    before, layers_name, after = pp_parts(model)
    stage = copy.deepcopy(model)
    base = _base(stage)
    layers = getattr(base, layers_name)
    for i in range(len(layers)):
        if i not in layer_range:
            layers[i] = Absent()
    first, last = stage_id == 0, stage_id == n_stages - 1
    for name in (before if not first else []) + (after if not last else []):
        setattr(base, name, Absent())
    if not last:
        stage.lm_head = Absent()

    def forward(x, attention_mask, position_ids):
        inputs = {"input_ids": x} if first else {"inputs_embeds": x}
        out = base(**inputs, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state
        if last:
            return stage.lm_head(hidden)
        return hidden, attention_mask, position_ids

    stage.forward = forward  # instance attribute: FSDP/TP hooks on the module still run around it
    stage.pipeline_stage = (stage_id, n_stages)
    return stage


def is_last_stage(module) -> bool:
    sid, n = getattr(module, "pipeline_stage", (0, 1))
    return sid == n - 1


@hookimpl
def ultrascale_transform_model(model, ctx, phase):
    cfg = ctx.config
    if phase != "pipeline" or cfg.pp == 1:
        return
    _, layers_name, _ = pp_parts(model)
    pp_mesh = ctx.sub_mesh("pp")
    pp_rank = pp_mesh.get_local_rank()
    n_layers = len(getattr(_base(model), layers_name))
    counts = stage_layer_counts(cfg, n_layers)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    ids = stage_ids_for_rank(cfg, pp_rank)
    ctx.modules = [build_stage(model, s, len(counts), range(starts[s], starts[s] + counts[s])) for s in ids]
    ctx.extras["pipeline"] = Pipeline(ctx, ids, len(counts), counts)


class Pipeline:
    """The schedule and its stages on this rank; built lazily after every other phase has transformed the
    stage modules (PipelineStage must wrap the final, FSDP-sharded module)."""

    def __init__(self, ctx, stage_ids, n_stages, counts):
        self.ctx, self.stage_ids, self.n_stages, self.counts = ctx, stage_ids, n_stages, counts
        self.schedule = None
        self.scale = 1.0
        pp_mesh = ctx.sub_mesh("pp")
        self.pp_group = pp_mesh.get_group()
        self.pp_rank = pp_mesh.get_local_rank()
        self.has_first = 0 in stage_ids
        self.has_last = n_stages - 1 in stage_ids
        self.tied = bool(ctx.plan is not None and ctx.plan.tied)
        self.tie_group = None
        self.last_step_stats: dict | None = None  # busy/idle time of this rank's last training step
        self._busy = 0.0

    def _loss(self, logits, targets):
        from ..loss import token_loss_sum

        return token_loss_sum(logits, targets) * self.scale

    def build(self):
        from torch.distributed import pipelining

        cfg = self.ctx.config
        stages = [pipelining.PipelineStage(m, sid, self.n_stages, self.ctx.device, group=self.pp_group)
                  for m, sid in zip(self.ctx.modules, self.stage_ids)]
        names = {**SINGLE_STAGE, **LOOPED, **V_SHAPED}
        cls = getattr(pipelining.schedules, names[cfg.pp_schedule])
        for stage in stages:
            self._time_compute(stage)
        arg = stages[0] if cfg.pp_schedule in SINGLE_STAGE else stages
        self.schedule = cls(arg, n_microbatches=microbatches(cfg), loss_fn=self._loss, scale_grads=False)
        if self.tied:
            self._init_tie_group()

    def _time_compute(self, stage) -> None:
        """Count the time this rank spends computing (forward, input-grad and weight-grad chunks); the rest of
        a step is bubble or communication. Wraps the stage's own methods; nothing else changes."""
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            inner = getattr(stage, name, None)
            if inner is None:
                continue

            def timed(*args, _inner=inner, **kwargs):
                start = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    self._busy += time.perf_counter() - start

            setattr(stage, name, functools.wraps(inner)(timed))

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

    def tied_params(self) -> list[nn.Parameter]:
        out = []
        for m in self.ctx.modules:
            sid = m.pipeline_stage[0]
            embed = m.get_input_embeddings()
            if sid == 0 and not isinstance(embed, Absent):
                out.append(embed.weight)
            elif sid == self.n_stages - 1 and not isinstance(m.lm_head, Absent):
                out.append(m.lm_head.weight)
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

    def pp_index_of_stage(self, stage: int) -> int:
        p = self.ctx.config.pp
        if self.ctx.config.pp_schedule in V_SHAPED:
            return stage if stage < p else 2 * p - 1 - stage
        return stage % p

    @torch.no_grad()
    def _forward_only(self, ids, mask, positions, targets) -> torch.Tensor:
        """Validation pass: the whole local batch through the stages in order, hidden states sent point to point.
        Written here because torch's ``schedule.eval()`` replays the training action list (with its backward
        actions) on the multi-stage schedules and fails there."""
        from ..loss import token_loss_sum

        modules = dict(zip(self.stage_ids, self.ctx.modules))
        hidden_size = self.ctx.modules[0].config.hidden_size
        x, loss_sum = None, torch.zeros((), device=ids.device)
        for stage in range(self.n_stages):
            if stage not in modules:
                continue
            if stage == 0:
                x = ids
            elif stage - 1 not in modules:
                x = torch.empty(*ids.shape, hidden_size, device=ids.device)
                dist.recv(x, src=dist.get_global_rank(self.pp_group, self.pp_index_of_stage(stage - 1)),
                          group=self.pp_group)
            out = modules[stage](x, mask, positions)
            if stage == self.n_stages - 1:
                loss_sum = token_loss_sum(out, targets)
                break
            x = out[0]
            if stage + 1 not in modules:
                dist.send(x.float().contiguous(),
                          dst=dist.get_global_rank(self.pp_group, self.pp_index_of_stage(stage + 1)),
                          group=self.pp_group)
        return loss_sum

    def step(self, pmodel, batch, train: bool) -> torch.Tensor:
        from ..loss import shifted_targets

        if self.schedule is None:
            self.build()
        batch = pmodel.to_device(batch)
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(ids)
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()
        m = microbatches(self.ctx.config)
        if train and ids.shape[0] % m:
            raise ConfigError(f"pp_microbatches={m}: this rank's batch of {ids.shape[0]} rows does not split into "
                              f"{m} micro-batches. Fix: make the per-rank batch a multiple of {m}")
        targets = shifted_targets(batch)
        count = pmodel.global_token_count(targets)
        for module in self.ctx.modules:
            module.train(train)
        total = torch.zeros((), dtype=torch.float64, device=ids.device)
        with pmodel.autocast():
            if train:
                self.scale = (pmodel.data_parallel_size / count).item()
                losses: list = []
                kwargs = {"target": targets, "losses": losses} if self.has_last else {}
                self._busy, start = 0.0, time.perf_counter()
                self.schedule.step(*((ids, mask, positions) if self.has_first else ()), **kwargs)
                elapsed = time.perf_counter() - start
                self.last_step_stats = {"step_s": elapsed, "busy_s": self._busy,
                                        "idle_fraction": max(0.0, 1 - self._busy / elapsed)}
                for hook in self.ctx.extras.get("post_backward", []):  # e.g. data-parallel averaging
                    hook()
                self.sync_tied_grads()
                if self.has_last:
                    total += sum(float(loss.detach()) for loss in losses) / self.scale
            else:
                total += float(self._forward_only(ids, mask, positions, targets))
        for module in self.ctx.modules:
            module.train()
        dist.all_reduce(total, group=self.pp_group)  # only the last stage holds it: a sum is a broadcast
        return pmodel.reduce_loss(total, count)


def _timeout():
    from ..launch import collective_timeout

    return collective_timeout()


@hookimpl(tryfirst=True)
def ultrascale_train_step(pmodel, batch):
    pipe = pmodel.ctx.extras.get("pipeline")
    if pipe is None:
        return None
    return pipe.step(pmodel, batch, train=True)
