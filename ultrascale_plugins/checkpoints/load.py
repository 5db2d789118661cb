"""A model and its weights, read once, top to bottom: ``us.from_pretrained`` and ``us.parallelize``.

    read the config        pretrained.read_config                  (from_pretrained)
    build on meta          pretrained.empty_model: no storage, the buffers computed
    plan the layout        engine.validate: every check before any process group
    plan the reads         pretrained.weights_for: each entry's source in the files, names and shapes checked
    place                  engine.place: the process group, the mesh, the stages in their order
    fill from the files    PretrainedWeights.load: this rank's shards only
    initialize the rest    initialize.ModelInit: what no file holds (a PEFT model's adapters), drawn per shard

Here, above the engine, because the engine never reads a file: it is handed the loader (``init_weights``) and
calls it once the layout is final. Every front end builds its model through ``parallelize``."""
from __future__ import annotations

import warnings

from ..core.engine import ParallelModel, place, registry_of, validate
from ..distributed import launch
from ..interface.config import ParallelConfig
from .pretrained import empty_model, read_config, weights_for


def from_pretrained(path, config: ParallelConfig | dict | None = None, *, device=None,
                    trust_remote_code: bool = False) -> ParallelModel:
    """Build the model of the Hugging Face directory ``path`` in the layout ``config`` and load its weights, each
    rank reading only its own shards (names, tied weights and shapes are checked before any process group
    exists)."""
    model = empty_model(read_config(path, trust_remote_code))
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


def warn_unused(path, unexpected: list[str]) -> None:
    """Rank 0's warning of the keys in a pretrained directory's files that the model does not read."""
    if unexpected and launch.global_rank() == 0:
        warnings.warn(f"'{path}': {len(unexpected)} key(s) in the files are not used by the model: "
                      f"{', '.join(unexpected[:8])}", stacklevel=3)
