"""``ultrascale train RECIPE --dry-run``: the recipe's step run once at its full size and world on fake tensors.

The recipe is loaded as for training (its ``layout: auto`` chosen, its batch split derived for ``nproc`` x
``--nnodes`` processes), then ``us.dry_run`` runs one optimizer step of it in this process — no worker starts, no
weight or data is read — and prints the report: live bytes at the peak by category per rank role, where the peak
falls, bytes per mesh axis, and the planner's estimate beside each. Nothing the recipe asks is skipped in silence:
what the dry run does not run is refused in one line before any work.
"""
from __future__ import annotations

import json

from ..interface.config import ConfigError


def refusal(recipe) -> str | None:
    """One line naming the first part of ``recipe`` the dry run does not run, or None (the layout's own fields
    are the dry run's to refuse: ``core.dry_run.refusal``)."""
    t = recipe.train
    if recipe.sections:
        names = ", ".join(sorted(recipe.sections))
        return (f"{names}: the dry run does not run a recipe's model sections yet (it runs the model built from its "
                f"config, every parameter trained). Fix: dry-run the recipe without its {names} section, or price "
                "it with ultrascale plan --peft")
    if t.optimizer != "adamw" or t.bf16_stochastic_round:
        said = f"train.optimizer={t.optimizer}" if t.optimizer != "adamw" else "train.bf16_stochastic_round=true"
        return f"{said}: the dry run steps AdamW only. Fix: dry-run with train.optimizer=adamw"
    return None


def run(args, recipe, nodes: int) -> int:
    """Dry-run ``recipe`` at ``nproc`` x ``nodes`` processes; print the report (and write its JSON to
    ``--metrics`` when given). Exit 0; a ``ConfigError`` (exit 2) for what it does not run."""
    from ..core.dry_run import dry_run

    reason = refusal(recipe)
    if reason:
        raise ConfigError(reason)
    t = recipe.train
    report = dry_run(recipe.model_config(), recipe.parallel, world_size=recipe.nproc * nodes,
                     seq_len=recipe.data.seq_len, micro_batch_size=t.micro_batch_size or 1,
                     grad_accum=t.grad_accum or 1, max_grad_norm=t.max_grad_norm, lr=t.lr)
    print(report.table(), flush=True)
    if args.metrics:
        with open(args.metrics, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return 0
