"""Built-in plugin: a mixture of experts' router auxiliary (load-balancing) loss, as transformers adds it when the
model's config has ``output_router_logits`` on, over the global batch (``global_loss``: the router statistics of
every rank that holds other tokens gathered, the gradient kept on this rank's own). It reaches the step through
``ultrascale_step_loss_terms``; a model whose causal-LM head computes the loss another way is refused before launch."""
from __future__ import annotations

from ...interface.hookspecs import hookimpl
from .global_loss import aux_loss_function, router_aux_loss


@hookimpl
def ultrascale_validate_model(model, plan, config):
    lm = plan.causal_lm(model) if plan is not None else model
    if getattr(lm.config, "output_router_logits", False):
        aux_loss_function(lm)  # a ConfigError when the model's auxiliary loss cannot be reproduced


@hookimpl
def ultrascale_step_loss_terms(pmodel, output, batch):
    logits = getattr(output, "router_logits", None)
    if not logits:  # output_router_logits off, or no mixture of experts
        return None
    lm = pmodel.ctx.plan.causal_lm(pmodel.module) if pmodel.ctx.plan is not None else pmodel.module
    rows = batch.get("input_ids", batch.get("attention_mask"))  # a pipeline's last stage has the mask only
    return [router_aux_loss(lm, logits, batch.get("attention_mask"), pmodel.tokens.group,
                            tuple(rows.shape) if rows is not None else None)]
