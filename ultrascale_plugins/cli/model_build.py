"""A recipe's model, built in every worker: on the meta device, or with a pretrained model's structure whose weights
are read shard by shard, wrapped by PEFT when the recipe asks for adapters, then parallelized, so that no rank ever
holds the whole model."""
from __future__ import annotations

import dataclasses

import torch
from transformers import AutoModelForCausalLM

from ..checkpoints.hf_config import read_config
from ..checkpoints.load import from_pretrained, parallelize
from ..core.engine import ParallelModel
from ..core.meta_build import empty_model
from ..data.recipe import Recipe, recorded_init_from
from ..interface.estimates import meta_model


@dataclasses.dataclass
class BuiltModel:
    """The parallel model and what the opening line says of it: the whole model's parameters (counted before it
    was sharded), the trainable ones of a PEFT model (None without adapters), the pretrained directory its weights
    (a PEFT model's frozen base) were read from."""

    pmodel: ParallelModel
    n_params: int | None  # None: not counted yet (a plain pretrained model, loaded shard by shard)
    trainable: int | None = None
    base_from: str | None = None

    def whole_model_params(self) -> int:
        if self.n_params is None:  # the model's structure on the meta device: no storage
            self.n_params = sum(p.numel() for p in meta_model(self.pmodel.module.config).parameters())
        return self.n_params


def pretrained_source(recipe: Recipe, init_from: str | None, resume: str | None) -> str | None:
    """Where the model's pretrained weights come from: ``--init-from``, or, resuming an adapter-only checkpoint,
    the directory the run it continues started from (the frozen base is not in the checkpoint)."""
    if not init_from and resume and not recipe.checkpoint_holds_whole_model():
        return recorded_init_from(resume) or None
    return init_from


def build_model(recipe: Recipe, device: torch.device, init_from: str | None = None,
                resume: str | None = None) -> BuiltModel:
    """This rank's part of the recipe's model, with its weights: pretrained (``init_from``), or drawn per shard from
    the seed already set."""
    base_from = pretrained_source(recipe, init_from, resume)
    if init_from and not recipe.sections:  # a plain pretrained model: read shard by shard
        return BuiltModel(from_pretrained(init_from, recipe.parallel, device=device), None, base_from=base_from)
    if base_from:  # the pretrained model's structure, its buffers computed; its weights are read per shard
        model = empty_model(read_config(base_from), **recipe.base_dtype())
    else:
        with torch.device("meta"):  # no rank holds the whole model: parallelize initializes each rank's shards
            model = AutoModelForCausalLM.from_config(recipe.model_config(), **recipe.base_dtype())
    trainable = None
    if recipe.sections:  # PEFT's adapters on the meta device too: the engine draws them per shard
        model = recipe.apply_sections(model)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_params = sum(p.numel() for p in model.parameters())
    # the base's weights from base_from, the adapters drawn from train.seed
    pmodel = parallelize(model, recipe.parallel, device=device, init_from=base_from)
    return BuiltModel(pmodel, n_params, trainable, base_from)
