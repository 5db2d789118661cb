"""A model and its weights, read once, top to bottom: ``us.from_pretrained`` and ``us.parallelize``.

    read the config        hf_config.read_config                   (from_pretrained)
    build on meta          meta_build.empty_model: no storage, the buffers computed
    plan the layout        engine.validate: every check before any process group
    plan the reads         read_plan.plan_reads: each entry's source in the files, names and shapes checked
                           (the model's wrapper asked of the plugins once, here, and handed down)
    place                  engine.place: the process group, the mesh, the stages in their order
    fill from the files    pretrained.PretrainedWeights.load: this rank's shards only
    initialize the rest    initialize.ModelInit: what no file holds (a PEFT model's adapters), drawn per shard;
                           made here, before the model is placed, and handed to the loader

Here, above the engine, because the engine never reads a file: it is handed the loader (``init_weights``) and
calls it once the layout is final. Every front end builds its model through ``parallelize``."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..core.engine import ParallelModel, place, registry_of, validate
from ..core.initialize import ModelInit
from ..core.meta_build import empty_model, fill_buffers
from ..core.registry import given_or_default
from ..distributed import launch
from ..interface.config import ParallelConfig
from .hf_config import read_config
from .pretrained import PretrainedWeights
from .read_plan import plan_reads


def from_pretrained(path, config: ParallelConfig | dict | None = None, *, device=None,
                    trust_remote_code: bool = False) -> ParallelModel:
    """Build the model of the Hugging Face directory ``path`` in the layout ``config`` and load its weights, each
    rank reading only its own shards (names, tied weights and shapes are checked before any process group
    exists)."""
    model_config = read_config(path, trust_remote_code)
    model = empty_model(model_config)
    return parallelize(model, config, device=device, init_from=path)


def parallelize(model, config: ParallelConfig | dict | None = None, *, device=None, init_from=None,
                init_weights=None) -> ParallelModel:
    """Shard ``model`` (a Hugging Face causal LM) over the current process group according to ``config``.

    ``init_from``: a Hugging Face directory whose weights the model takes, each rank reading only its own shards
    (what the files do not hold, a PEFT model's adapters, is drawn from the seed; rank 0 warns of keys the model
    does not use). ``model`` may live on the meta device (built under ``torch.device("meta")``): then every rank
    gives only its own shards storage and values once the layout is final — from ``init_from``, else from
    ``init_weights`` (an object with ``load(ctx, buffers)``, e.g. ``pretrained.PretrainedWeights``), else from the
    directory its config was read from, else with the model's own initialization — so no rank ever holds the
    whole model. The command line, Lightning, Accelerate and the Trainer all build their model here."""
    pm, config = registry_of(config)  # the registry the layout was made under (a dict or None: the process's)
    resolved = validate(config, model.config, launch.world_size(), pm, model=model)  # no group yet
    if init_weights is None:
        init_weights = weights_for(model, init_from, pm=pm)
        if init_from is not None:
            warn_unused(init_from, init_weights.unexpected)
    return place(model, resolved, device=device, init_weights=init_weights, pm=pm)


def weights_for(model, init_from: str | Path | None, seed: int | None = None, pm=None):
    """What ``model`` should be loaded with once parallelized: the weights of ``init_from`` if given; for a model
    built on the meta device (``empty_init``, ``torch.device("meta")``), those of the directory its config was
    read from (``AutoConfig.from_pretrained(DIR)`` records it), else a ``ModelInit`` that initializes it shard by
    shard with the model's own scheme; for a real model, none. Buffers a meta build left empty are computed first.
    ``seed`` (default ``torch.initial_seed()`` now, i.e. the last ``torch.manual_seed``) draws what no file holds:
    the whole model without weights, a wrapper's introduced entries (a PEFT model's adapters) with them; the same
    seed gives the same values in every layout. The plugins are asked what the model's wrapper is once (``pm``:
    the registry, default the process's), for the names and the initializer alike."""
    source = init_from
    meta = any(p.is_meta for p in model.parameters())
    if source is None and meta:
        origin = getattr(model.config, "_name_or_path", "")
        if origin and Path(origin, "config.json").is_file():
            source = origin
    if source is None and not meta:
        return None
    if any(b.is_meta for b in model.buffers()):  # a meta build's buffers (rotary frequencies): no file holds them
        fill_buffers(model)
    pm = given_or_default(pm)
    wrapper = pm.wrapper_of(model)
    plan = None if source is None else plan_reads(model, source, wrapper)
    # what no file holds, drawn: the whole model without files, a wrapper's introduced entries with them
    init = ModelInit(model, seed, wrapper=wrapper) if plan is None or plan.introduced else None
    return init if plan is None else PretrainedWeights(**vars(plan), init=init, wrapper=wrapper, pm=pm)


def prepare(path: str | Path, trust_remote_code: bool = False, dtype=torch.float32):
    """(weights, empty model in ``dtype``) for ``path``: every check that needs no process group."""
    model = empty_model(read_config(path, trust_remote_code), dtype=dtype)
    return weights_for(model, path), model


def warn_unused(path, unexpected: list[str]) -> None:
    """Rank 0's warning of the keys in a pretrained directory's files that the model does not read."""
    if unexpected and launch.global_rank() == 0:
        warnings.warn(f"'{path}': {len(unexpected)} key(s) in the files are not used by the model: "
                      f"{', '.join(unexpected[:8])}", stacklevel=3)
