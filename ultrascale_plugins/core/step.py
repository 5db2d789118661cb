"""Built-in plugin: the training step. It runs the model's runtime (``runtime.Runtime``: forward, the loss share,
backward, gradient averaging; a pipeline's schedule). Registered as the last answer, so a plugin's
``ultrascale_step_run`` replaces it, and a plugin's ``@hookimpl(wrapper=True)`` runs around it."""
from __future__ import annotations

import torch

from ..interface.hookspecs import hookimpl


@hookimpl(trylast=True)
def ultrascale_step_run(pmodel, batch, loss_scale):
    return pmodel.runtime.train_step(pmodel, batch, loss_scale)


@hookimpl
def ultrascale_validate_model(model, plan, config):
    # the causal LM the plan is for: a wrapper's own forward (PEFT's PeftModelForCausalLM) hands labels on to it
    check_loss_convention(plan.causal_lm(model) if plan is not None else model)


def check_loss_convention(model) -> None:
    """The step trains transformers' causal-LM objective: next-token targets (labels shifted inside), the mean
    over valid tokens — what a causal LM's ``self.loss_function`` computes. A few heads compute their own loss on
    unshifted labels (BART-family decoders, XLM, XLNet, TrOCR, CPM-Ant: the caller shifts); training them here
    would not reproduce their own loss, so they are refused."""
    import inspect

    forward = type(model).forward
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):  # no source (a compiled or dynamic class): nothing to judge by
        return
    if "loss_function" not in source and "labels" in inspect.signature(forward).parameters:
        from ..interface.config import ConfigError

        arch = getattr(model.config, "model_type", type(model).__name__)
        raise ConfigError(f"model type '{arch}': {type(model).__name__} computes its own loss on labels it does not "
                          "shift (the caller shifts them), not transformers' causal-LM loss that every layout here "
                          "trains, so a run would not reproduce the model's own loss. Fix: use a causal-LM class "
                          "that computes its loss with transformers' loss_function")


@hookimpl
def ultrascale_state_save(pmodel, state):
    """The random state of this rank (dropout), so a resumed run continues bit for bit."""
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    state.rank_local["rng"] = rng


@hookimpl
def ultrascale_state_load(pmodel, state):
    rng = state.rank_local.get("rng")
    if rng is None:  # another world size: each rank keeps its own stream
        return
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
