"""Built-in plugin: ``chunked_loss: N`` computes the head and the cross-entropy N tokens at a time inside the
model's forward (``head_loss``), so the logits of a micro-batch never exist whole: the loss's peak
memory is one chunk's, whatever the vocabulary.

The head's ``forward`` is replaced in place (parameter names unchanged, so checkpoints load across settings) after
tensor parallel has placed it and before data parallel wraps it, and the model's loss head becomes this family's
(``ChunkedHead``, an ``interface.loss_head.LossHead`` set on the context): it hands the head the micro-batch's
targets (the built-in step and a pipeline's last stage give them) and the step takes the token-loss sum the head
returns as the loss. Called without targets (generation, a front end's own forward) the head returns the whole
logits as before.

Under tensor parallel the head's weight is a vocabulary-sharded DTensor: the loss reduces its per-token statistics
over the ranks holding the other rows, and the hidden states' gradient is left partial for the reduction tensor
parallel placed there (a plain input: the region before the head reduces it; a DTensor input: its own
redistribution does). A model that changes the logits after its head (Gemma's soft-capping, Cohere's and Granite's
scaling) cannot be computed this way and is refused before launch.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .head_loss import VocabShard, chunked_head_loss, chunked_token_losses, chunked_token_stats
from ...distributed.loss import IGNORE_INDEX, TokenOutputs
from ...interface.config import ConfigError
from ...interface.facts import layout_facts
from ...interface.hookspecs import hookimpl
from ...interface.loss_head import LossHead
from ...interface.stages import Stage, step

MARK = "_ultrascale_loss_sum"  # set on the tensor the head returns: the step takes it as the loss sum


class ChunkedHead(LossHead):
    """The model's loss head while its head computes the loss in chunks: the micro-batch's targets for the head's
    forward (``value``, ``per_token``), and what the forward left where the logits would be."""

    value: torch.Tensor | None = None
    per_token: bool = False  # each token's figures wanted (pmodel.outputs.token_outputs), not the loss's sum
    stats: tuple | None = None  # (entropy, top-1, mean logits) of the last per-token forward

    @contextlib.contextmanager
    def targets(self, targets, per_token: bool = False):
        self.value, self.per_token, self.stats = targets, per_token, None
        try:
            yield
        finally:
            self.value, self.per_token = None, False

    def loss_sum(self, logits, targets):
        if not getattr(logits, MARK, False):
            raise RuntimeError("chunked_loss: the model's output is not the loss its head computed in chunks (the "
                               "model changed it after the head). Set chunked_loss: 0 for this model")
        return logits

    def token_outputs(self, logits, targets):
        if not getattr(logits, MARK, False) or self.stats is None:
            raise RuntimeError("chunked_loss: the model's output is not the per-token loss its head computed in "
                               "chunks (the model changed it after the head). Set chunked_loss: 0 for this model")
        losses = logits.to_local() if isinstance(logits, DTensor) else logits
        entropy, top1, mean_logits = self.stats
        self.stats = None
        return TokenOutputs(-losses, entropy, top1, targets != IGNORE_INDEX, mean_logits=mean_logits)


@hookimpl
def ultrascale_declare_fields(fields):
    fields.add("chunked_loss", int, 0, "compute the head and the loss this many tokens at a time, so no rank holds a "
               "micro-batch's logits (0: the whole micro-batch at once)", minimum=0,
               dry_run="each chunk's count of labelled tokens is a data-dependent shape")
    # the facts this plugin decides for the others (answered in ultrascale_declare_facts), with their defaults
    fields.fact("loss_chunk", 0, "the head and the loss run this many tokens at a time (0: the whole logits at once)")


@hookimpl
def ultrascale_declare_facts(config, degrees):
    return {"loss_chunk": config.chunked_loss}


@hookimpl
def ultrascale_validate_config(config, model_config, world_size):
    if config.chunked_loss and layout_facts(config).vocab_sharded_loss:
        raise ConfigError(f"chunked_loss={config.chunked_loss}: the chunked loss is vocabulary-parallel itself and "
                          "returns no logits for loss_parallel to keep sharded. Fix: set loss_parallel: false")


@hookimpl
def ultrascale_validate_model(model, plan, config):
    if not config.chunked_loss:
        return
    name = head_name(model, plan)
    if name is None:
        raise ConfigError(f"chunked_loss={config.chunked_loss}: no output head found in model type "
                          f"'{_model_type(model)}'. Fix: set chunked_loss: 0")
    head = model.get_submodule(name)
    if type(head) is not nn.Linear:
        raise ConfigError(f"chunked_loss={config.chunked_loss}: the head '{name}' is a "
                          f"{type(head).__module__}.{type(head).__name__}, not a torch Linear (an adapter on it, or "
                          "the model's own head), so it cannot be run in chunks. Fix: set chunked_loss: 0, or leave the "
                          "head out of the adapters")
    root = plan.root if plan is not None else ""
    changed = _changes_logits(model.get_submodule(root) if root else model, name[len(root) + 1:] if root else name)
    if changed:
        raise ConfigError(f"chunked_loss={config.chunked_loss}: model type '{_model_type(model)}' changes the logits "
                          "after its head (e.g. soft-capping or scaling them), which the chunked loss does not "
                          "apply. Fix: set chunked_loss: 0 for this model")


def head_name(model: nn.Module, plan) -> str | None:
    """The output head's name in ``model``: the plan's, or (a model without a plan) the module its
    ``get_output_embeddings`` returns."""
    if plan is not None and plan.lm_head:
        return plan.lm_head
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((n for n, m in model.named_modules() if m is head), None) if head is not None else None


def _changes_logits(lm: nn.Module, head_name: str) -> bool:
    """Whether the model's forward returns something other than what its head returned, from one forward of a
    meta twin (no memory, no values) whose head hands back a marked tensor. A model that runs on the meta device
    neither way is let through: the step refuses its first output if the head's loss is not what it returns."""
    from ...models.dataflow import meta_inputs, meta_twin

    twin = meta_twin(lm)
    head = twin.get_submodule(head_name)
    returned = []

    def forward(x):
        returned.append(torch.empty(*x.shape[:-1], head.out_features, device="meta", dtype=x.dtype))
        return returned[-1]

    head.forward = forward
    ids = torch.zeros(1, 4, dtype=torch.long, device="meta")
    for inputs in (meta_inputs(4), {"input_ids": ids, "use_cache": False}):  # a 4-D mask, else the ids alone
        try:
            with torch.no_grad():
                out = twin(**inputs)
        except Exception:  # noqa: BLE001 - this model does not run so on the meta device
            returned.clear()
            continue
        return not returned or out.logits is not returned[-1]
    return False  # unknown here: the step checks the first forward's output (ultrascale_loss_sum)


def _model_type(model) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", type(model).__name__)


@hookimpl
def ultrascale_transform_stages(config, model_config):
    return [Stage("chunked_loss", run_head_in_chunks, after=("split", "tp"), before=("dp",),
                  active=config.chunked_loss > 0,
                  does=f"the head and the loss run {config.chunked_loss} tokens at a time (no whole logits)")]


def run_head_in_chunks(model, ctx):
    name = head_name(model, ctx.plan) if ctx.config.chunked_loss else None
    if name is None:
        return
    try:
        head = model.get_submodule(name)
    except AttributeError:  # a pipeline stage without the head
        return
    if not isinstance(head, nn.Linear):  # a pipeline stage without the head holds a stand-in
        return
    if not isinstance(ctx.loss_head, ChunkedHead):  # one per model: a rank's pipeline stages share it
        ctx.loss_head = ChunkedHead()
    slot = ctx.loss_head
    chunk = ctx.config.chunked_loss

    def forward(hidden):
        # a DTensor input comes through torch's ColwiseParallel, whose output hook wants a DTensor back
        wrap = isinstance(hidden, DTensor)
        weight, bias, vocab, hidden = _local(head, hidden)
        targets = slot.value
        if targets is None and ctx.stand_in:  # a pipeline's shape inference: the output's kind is what counts
            targets = torch.full(hidden.shape[:-1], -100, dtype=torch.long, device=hidden.device)
        if targets is None:  # not a training or evaluation step: the whole logits, as the head would give
            return _whole_logits(hidden, weight, bias, head, wrap)
        if slot.per_token:  # each token's loss (its gradient flowing) and, without gradient, its statistics
            loss = chunked_token_losses(hidden, weight, bias, targets, chunk, vocab)
            slot.stats = chunked_token_stats(hidden.detach(), weight.detach(),
                                             bias.detach() if bias is not None else None, targets, chunk, vocab)
        else:
            loss = chunked_head_loss(hidden, weight, bias, targets, chunk, vocab)
        if wrap:
            mesh = head.weight.device_mesh
            return DTensor.from_local(loss, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return loss

    head.forward = forward
    # after tensor parallel's hooks: marks what the model gets
    head.register_forward_hook(lambda module, args, out: _mark(out, slot))


def _mark(out, slot: ChunkedHead):
    if isinstance(out, torch.Tensor) and (out.dim() == 0 or slot.per_token):
        setattr(out, MARK, True)
    return out


def _local(head, hidden):
    """The head's weight and bias as this rank's local tensors, its vocabulary shard (or None), and the hidden
    states as a plain tensor whose gradient stays partial where the weight is vocabulary-sharded."""
    weight, bias = head.weight, head.bias
    if not isinstance(weight, DTensor):
        if isinstance(hidden, DTensor):
            hidden = hidden.full_tensor()
        return weight, bias, None, hidden
    mesh, placements = weight.device_mesh, weight.placements
    dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    if any(not isinstance(p, Replicate) for i, p in enumerate(placements) if i not in dims) or len(dims) > 1:
        raise ConfigError(f"chunked_loss: the head's weight is placed {placements}, not split by vocabulary rows "
                          "over one mesh axis. Fix: set chunked_loss: 0")
    vocab = None
    if dims:
        d = dims[0]
        size, rank = mesh.size(d), mesh.get_local_rank(d)
        # torch's Shard(0) gives every rank ceil(V / size) rows, the last ones fewer
        vocab = VocabShard(mesh.get_group(d), min(rank * -(-weight.shape[0] // size), weight.shape[0]))
    if isinstance(hidden, DTensor):  # replicated (tensor parallel gathered it): its gradient is this rank's part
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
        hidden = hidden.to_local(grad_placements=[Partial() if vocab is not None and i == dims[0] else Replicate()
                                                  for i in range(hidden.device_mesh.ndim)])
    return weight.to_local(), bias.to_local() if isinstance(bias, DTensor) else bias, vocab, hidden


def _whole_logits(hidden, weight, bias, head, wrap: bool):
    """The head's logits over the whole vocabulary (gathered where the weight holds this rank's rows only), or,
    for torch's ColwiseParallel (``wrap``), this rank's as a vocabulary-sharded DTensor its output hook gathers."""
    logits = nn.functional.linear(hidden, weight, bias)
    if not isinstance(head.weight, DTensor):
        return logits
    mesh = head.weight.device_mesh
    placements = [Shard(logits.dim() - 1) if isinstance(p, Shard) else Replicate() for p in head.weight.placements]
    full = DTensor.from_local(logits, mesh, placements, run_check=False)
    return full if wrap else full.redistribute(placements=[Replicate()] * mesh.ndim).to_local()


# tokens per chunk the planner tries: one chunk of a 128k vocabulary's fp32 logits is 0.5 GB
SEARCHED_CHUNK = 1024


@hookimpl
def ultrascale_cost_search(config, model_config, world_size):
    """A memory saver (one more head matmul a step, the same numbers): the planner tries it only when nothing
    fits without it. Not offered for a model whose head it cannot run (a meta-device forward says, once per
    model)."""
    from ...interface.search_offer import SearchOffer

    if model_config is None or config.chunked_loss or not _runs_in_chunks(model_config):
        return None
    return SearchOffer(savers={"chunked_loss": [SEARCHED_CHUNK]})


_RUNS: dict = {}


def _runs_in_chunks(model_config) -> bool:
    from ...interface.estimates import meta_model

    key = model_config.to_json_string(use_diff=False)
    if key not in _RUNS:
        try:
            model = meta_model(model_config)
            name = head_name(model, None)
            _RUNS[key] = type(model.get_submodule(name)) is nn.Linear and not _changes_logits(model, name)
        except Exception:  # noqa: BLE001 - a model the check cannot run (or without a head): not offered
            _RUNS[key] = False
    return _RUNS[key]


@hookimpl
@step("chunked_loss")
def ultrascale_cost_estimate(config, model_config, shape, estimate):
    """The head's matmul once more per micro-batch (backward recomputes each chunk's logits). Its memory, one
    chunk's logits in place of the micro-batch's, is priced with the other activations (the loss's peak and a
    recomputed layer's are never alive together)."""
    if not config.chunked_loss or not shape.holds_head:
        return
    mc = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    rows = mc.vocab_size / shape.head_split(config)
    estimate.factors["extra_flops"] = (estimate.factors.get("extra_flops", 0.0)
                                       + 2 * shape.tokens_per_micro_batch * mc.hidden_size * rows)

