"""Built-in plugin: a mixture of experts' router auxiliary (load-balancing) loss, as transformers adds it when the
model's config has ``output_router_logits`` on, over the global batch (``global_loss``: the router statistics of
every rank that holds other tokens gathered, the gradient kept on this rank's own). It reaches the step as a term
of this plugin's ``LossPart`` (``ultrascale_step_loss``); a model whose causal-LM head computes the loss another way
is refused before launch."""
from __future__ import annotations

from ...interface.hookspecs import hookimpl
from ...interface.loss_part import LossPart
from .global_loss import aux_loss_function, router_aux_loss


@hookimpl
def ultrascale_validate_model(model, plan, config):
    lm = plan.causal_lm(model) if plan is not None else model
    if getattr(lm.config, "output_router_logits", False):
        aux_loss_function(lm)  # a ConfigError when the model's auxiliary loss cannot be reproduced


@hookimpl
def ultrascale_step_loss(pmodel):
    return RouterAuxLoss(pmodel)


class RouterAuxLoss(LossPart):
    """The router auxiliary loss of every forward whose output holds router logits (``output_router_logits``, in
    the model's config or given to one forward); none otherwise."""

    def __init__(self, pmodel):
        self.pmodel = pmodel

    def terms(self, output, batch):
        logits = getattr(output, "router_logits", None)
        if not logits:  # output_router_logits off, or no mixture of experts
            return []
        pmodel = self.pmodel
        lm = pmodel.ctx.plan.causal_lm(pmodel.module) if pmodel.ctx.plan is not None else pmodel.module
        rows = batch.get("input_ids", batch.get("attention_mask"))  # a pipeline's last stage has the mask only
        return [router_aux_loss(lm, logits, batch.get("attention_mask"), pmodel.tokens.group,
                                tuple(rows.shape) if rows is not None else None)]
