"""Built-in plugin: the training step for every layout without a pipeline (registered last, so a pipeline
plugin's step takes over when it answers).

Data-parallel wrappers average gradients over the ``dp`` ranks, so the local loss sum is scaled by
``dp / global_tokens``: after averaging, the gradient is that of the mean over every valid token of the
global batch.
"""
from __future__ import annotations

from .hookspecs import hookimpl


@hookimpl(trylast=True)
def ultrascale_train_step(pmodel, batch, loss_scale):
    loss_sum, count = pmodel.loss_terms(batch)
    with pmodel.loss_context():
        (loss_sum * (loss_scale * pmodel.data_parallel_size / count)).backward()
    return pmodel.reduce_loss(loss_sum, count)


@hookimpl
def ultrascale_validate_model(model, plan, config):
    if getattr(model.config, "output_router_logits", False):
        from .router_loss import aux_loss_function

        aux_loss_function(model)  # a ConfigError when the model's auxiliary loss cannot be reproduced
