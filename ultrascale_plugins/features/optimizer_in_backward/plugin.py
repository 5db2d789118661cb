"""The optimizer step inside the backward (``optimizer_in_backward: true``): each parameter is stepped as soon as
its gradient is complete and reduced, and that gradient is freed, so no rank ever holds more than one FSDP2
group's gradients at a time (torchtune's ``optimizer_in_bwd``).

FSDP2 runs a sharded parameter's post-accumulate-grad hooks once its reduce-scatter is done (and, with HSDP, the
all-reduce over the replicas). The hook steps the user's own optimizer on that one parameter: its group's
settings (the learning rate a scheduler sets), its state and its step count stay where they were, so the
optimizer's ``state_dict``, a resume and the schedulers work as before. Why by hand: torch's
``_apply_optimizer_in_backward`` is private and builds an optimizer per parameter, whose states a checkpoint of
the user's optimizer does not hold.

Refused where it would be wrong: gradient accumulation (the first micro-batch's gradient would be stepped
alone), global-norm clipping (no step ever sees every gradient), a layout whose gradients are not reduced by
FSDP2 (ZeRO-0/1, a pipeline: its micro-batches accumulate; gradient axes the engine averages after the backward).
"""
from __future__ import annotations

import functools

import torch

from ...interface.config import ConfigError, field_error
from ...interface.facts import layout_facts
from ...interface.hookspecs import hookimpl

WHY = ("optimizer_in_backward=true steps each parameter inside the backward, as soon as its gradient is reduced, "
       "and frees the gradient")


@hookimpl
def ultrascale_declare_fields(fields):
    fields.add("optimizer_in_backward", bool, False, "step the optimizer inside the backward, each parameter as "
               "soon as its gradient is reduced, and free that gradient: a rank holds one FSDP2 group's gradients "
               "at a time. ZeRO-2/3 only, one micro-batch per step, no pipeline, no global-norm clipping",
               dry_run="the dry run's step clips to the global norm, which this leaves none of")
    # the facts this plugin decides for the others (answered in ultrascale_declare_facts), with their defaults
    fields.fact("grads_freed_in_backward", False, "the optimizer steps each parameter inside the backward and frees "
                                                  "its gradient there, so no rank holds the step's gradients at once")


@hookimpl
def ultrascale_declare_facts(config, degrees):
    return {"grads_freed_in_backward": bool(config.optimizer_in_backward)}


@hookimpl
def ultrascale_validate_config(config, model_config, world_size, loop):
    if not config.optimizer_in_backward:
        return
    if loop is not None:
        check_loop(loop)
    facts = layout_facts(config)
    if not facts.fsdp_units:
        raise field_error("optimizer_in_backward", True, f"{WHY}, which needs FSDP2 to reduce each gradient in "
                          "the backward (ZeRO-2/3); this layout reduces them after it",
                          "use zero_stage: 2 or 3, or optimizer_in_backward: false")
    if facts.degree("pp") > 1:
        raise field_error("optimizer_in_backward", True, f"{WHY}, and a pipeline accumulates the gradients of its "
                          f"micro-batches (pp={facts.degree('pp')})", "use pp: 1, or optimizer_in_backward: false")


def check_loop(loop) -> None:
    """The loop a front end will run (a ``TrainingLoop``): one micro-batch per optimizer step, no clipping."""
    micro_batches, max_grad_norm = loop.micro_batches, loop.max_grad_norm
    if micro_batches > 1:
        raise ConfigError(f"optimizer_in_backward=true with {micro_batches} micro-batches per optimizer step "
                          "(gradient accumulation): the optimizer would step on the first micro-batch's gradient "
                          "alone. Fix: one micro-batch per step (gradient accumulation 1; a larger micro-batch "
                          "instead), or optimizer_in_backward: false")
    if max_grad_norm:
        raise ConfigError(f"optimizer_in_backward=true with gradient clipping to a global norm of {max_grad_norm:g}: "
                          "each parameter is stepped before the others' gradients exist, so no step sees the "
                          "global norm. Fix: turn clipping off (max_grad_norm: 0; the Trainer's max_grad_norm=0, "
                          "Lightning's gradient_clip_val=None), or optimizer_in_backward: false")


@hookimpl
def ultrascale_step_optimizer(pmodel, optimizer):
    if not pmodel.config.optimizer_in_backward:
        return None
    unclaimed = pmodel.gradients.unclaimed_axes
    if unclaimed:
        raise ConfigError(f"optimizer_in_backward=true: the gradients over {', '.join(unclaimed)} "
                          "are averaged after the backward, so a step inside it would see them unreduced. Fix: "
                          "optimizer_in_backward: false with this layout")
    pmodel.gradients.consumed = WHY
    return StepInBackward(optimizer)


@hookimpl
def ultrascale_step_no_sync(pmodel):
    if not pmodel.config.optimizer_in_backward:
        return None
    raise ConfigError("optimizer_in_backward=true: gradient accumulation (no_sync before a step's last micro-batch) "
                      "would step each micro-batch's gradient alone. Fix: one micro-batch per step, or "
                      "optimizer_in_backward: false")


class StepInBackward(torch.optim.Optimizer):
    """Fronts ``optimizer``: its parameters' post-accumulate-grad hooks step it one parameter at a time inside the
    backward; ``step()`` then steps only what no hook did (a gradient set by hand, as DCP does to create the
    states of an optimizer before a load). Groups, states and ``state_dict`` are ``optimizer``'s."""

    def __init__(self, optimizer: torch.optim.Optimizer):  # not Optimizer.__init__: nothing of its own to hold
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks
        # by the group's index: ``load_state_dict`` (Accelerate's device placement, a resume) replaces the group
        # dicts, and the learning rate a scheduler sets is in the current ones
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(self._step_one, index))
                         for index, group in enumerate(optimizer.param_groups) for p in group["params"]
                         if p.requires_grad]

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @torch.no_grad()
    def _step_one(self, index: int, param: torch.Tensor) -> None:
        groups = self.optimizer.param_groups
        group = groups[index]
        params = group["params"]
        group["params"] = [param]
        self.optimizer.param_groups = [group]
        try:
            self.optimizer.step()
        finally:
            self.optimizer.param_groups, group["params"] = groups, params
        param.grad = None

    def step(self, closure=None):
        loss = None
        if closure is not None:  # Lightning's: forward and backward, during which the hooks step
            with torch.enable_grad():
                loss = closure()
        if any(p.grad is not None for g in self.optimizer.param_groups for p in g["params"]):
            self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        raise ConfigError("optimizer_in_backward=true: a parameter group added after the optimizer was prepared "
                          "would not be stepped in the backward. Fix: give every group before training starts")

    def __repr__(self) -> str:
        return f"StepInBackward({self.optimizer!r})"
