"""Sharded checkpoints and exports of PEFT models (``peft.get_peft_model``: LoRA, DoRA, ...).

**Adapter-only checkpoints.** A checkpoint of a PEFT model holds what trains (the adapters, a ``modules_to_save``
copy), their optimizer state and the caller's extra state (the data position); the frozen base is left out
(``PluginState.left_out``): on load it comes from the model the caller built. So that a run is never resumed onto
another base by mistake, the checkpoint records a fingerprint of the frozen base and a load compares it with the
base it is about to train on, before anything is read.

**The fingerprint** of each frozen entry (parameter or buffer, by its unparallelized name): its dtype and shape,
and three float64 sums over its elements, each rank summing only the elements it holds, whole (no gather):
``sum x * w(index)``, ``sum |x| * w(index)`` and ``sum x**2``, where ``w`` is a fixed positive weight of the
element's global index (a product of one weight per dimension, so a shard's sum is a vector-matrix product with no
index tensor). Which global indices a shard holds is found by sharding an index vector with the tensor's own
placements (as ``dims.tensor.styles.checkpoint_view`` does; local, no communication), so the same numbers come out of
ZeRO-3, DDP, TP or a pipeline's stages; a shard held by several ranks (replicas) counts once. The ranks exchange
only these numbers (one ``all_gather_object``). Two fingerprints agree when the dtypes and shapes are equal and each
sum agrees within ``1e-9`` relative to ``sum |x| * w`` (resp. ``sum x**2``): summation order alone moves them by
about 1e-16, while a base that differs anywhere (another checkpoint, a cast to another dtype, a single weight moved
by 1e-4) moves them by orders of magnitude more (the weights also make a permuted or transposed tensor differ).

**Exports** (``ultrascale export --adapter`` / ``--merged``, through ``wrapper.PeftLibrary.export``): the checkpoint
also records each adapter's ``PeftConfig``, so PEFT's own files (``adapter_config.json``, ``adapter_model.safetensors``)
are written from the checkpoint alone; a merged model takes the frozen base from a directory (``--base``, by
default the command line's ``--init-from`` or the ``base_model_name_or_path`` PEFT recorded), checks it against
the fingerprint, and folds the adapters in with PEFT's own ``merge_and_unload`` (LoRA ``W + scaling * B @ A``,
rsLoRA's scaling, DoRA's magnitude, LoRA on the embedding; a ``modules_to_save`` copy replaces its module).
"""
from __future__ import annotations

import json
import math
import os

from ...interface.fields import ConfigError
from ...interface.hookspecs import hookimpl
from .adapters import is_peft_model

KEY = "peft"  # the plugin's entry in a checkpoint's metadata (``ultrascale.json``'s "plugins")
FORMAT = 1
REL_TOL = 1e-9  # fingerprints agree within this, relative (summation order moves them by ~1e-16)
_CHUNK = 1 << 22  # elements summed at once in float64
# PeftConfig fields that change what the saved adapters compute: a checkpoint resumes only onto the same ones
_CONFIG_FIELDS = ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "target_modules", "exclude_modules",
                  "modules_to_save", "rank_pattern", "alpha_pattern", "fan_in_fan_out", "bias",
                  "layers_to_transform", "layers_pattern", "target_parameters")


# ---- the frozen base and its fingerprint ----------------------------------------------------------------------
def _trainable_names(part) -> set[str]:
    """The checkpoint names (``get_model_state_dict``'s: wrappers' prefixes removed) of ``part``'s trainable
    parameters, found with torch's own name mapping."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    names: set[str] = set()
    for name, param in part.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            names |= set(_get_fqns(part, name))
    return names


def frozen_state(pmodel) -> dict:
    """This rank's frozen entries of the model state a checkpoint holds (parameters that do not train and
    buffers), by name: DTensors where sharded."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    out = {}
    for part in pmodel.modules:
        state = get_model_state_dict(part)
        trainable = _trainable_names(part)
        missing = trainable - set(state)
        if missing:  # the name mapping is torch's own, so this cannot happen unless torch changes it
            raise ConfigError(f"the trainable parameter '{sorted(missing)[0]}' is not in the model's state dict: "
                              "an adapter-only checkpoint would lose it. Fix: report this with your torch version")
        out.update({k: v for k, v in state.items() if k not in trainable})
    return out


def _index_weights(size: int, dim: int, device):
    """A fixed weight in [0.5, 1.5) for each global index along ``dim`` (float64)."""
    import torch

    j = torch.arange(1, size + 1, dtype=torch.float64, device=device)
    return 0.5 + torch.frac(j * 0.6180339887498949 + 0.3819660112501051 * dim)


def _held(tensor):
    """(local tensor, per dim the global indices it holds or None for all of them, the shard's key: equal on the
    ranks that hold the same shard)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    sharded = (Shard, _StridedShard)
    if not isinstance(tensor, DTensor):
        return tensor, [None] * tensor.ndim, ()
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh: it holds none of it
        return None, None, None
    local = tensor.to_local()
    held = []
    for dim, size in enumerate(tensor.shape):
        placements = [p if isinstance(p, sharded) and p.dim % tensor.ndim == dim else Replicate()
                      for p in tensor.placements]
        if all(isinstance(p, Replicate) for p in placements):
            held.append(None)
            continue
        index = torch.arange(size, device=local.device).view([size if d == dim else 1 for d in range(tensor.ndim)])
        held.append(distribute_tensor(index, tensor.device_mesh, placements, src_data_rank=None).to_local()
                    .flatten())
    if any(h is not None and len(h) != n for h, n in zip(held, local.shape)):
        raise ConfigError(f"a frozen tensor is placed as {tensor.placements}, which the base's fingerprint cannot "
                          "follow. Fix: report this layout")
    key = tuple(c if isinstance(p, sharded) else -1 for c, p in zip(coordinate, tensor.placements))
    return local, held, key


def _sums(tensor) -> tuple | None:
    """(shard key, weighted sum, weighted sum of magnitudes, sum of squares) of the elements this rank holds."""
    import torch

    local, held, key = _held(tensor)
    if local is None:
        return None
    x = local.detach()
    if type(x) is not torch.Tensor:  # a tensor subclass (QLoRA's NF4 shard): the values it stands for
        x = x.get_original_weight() if hasattr(x, "get_original_weight") else x.to(torch.float64)
        if type(x) is not torch.Tensor:
            raise ConfigError(f"a frozen tensor is a {type(local).__name__}, whose values the base's fingerprint "
                              "cannot read. Fix: report this tensor type")
    if x.ndim == 0:
        v = float(x.double())
        return key, v, abs(v), v * v
    weights = []
    for dim, size in enumerate(tensor.shape):
        w = _index_weights(size, dim, x.device)
        weights.append(w if held[dim] is None else w[held[dim].to(x.device)])
    total = torch.zeros(3, dtype=torch.float64, device=x.device)
    rows = max(1, _CHUNK // max(1, x[0].numel()))
    for start in range(0, x.shape[0], rows):
        block = x[start:start + rows].double()
        for i, values in ((0, block), (1, block.abs())):
            reduced = values
            for dim in range(x.ndim - 1, 0, -1):
                reduced = reduced @ weights[dim]
            total[i] += reduced @ weights[0][start:start + rows]
        total[2] += (block * block).sum()
    w_sum, a_sum, s2 = total.tolist()
    return key, w_sum, a_sum, s2


def fingerprint(state: dict) -> dict:
    """The fingerprint of ``state`` (name -> tensor, this rank's shards of DTensors): ``{name: [dtype, shape,
    sum x*w, sum |x|*w, sum x**2]}``, the same on every rank and, within rounding, in every layout. Collective when
    a process group exists (every rank calls it); only these numbers travel."""
    import torch.distributed as dist

    mine = {}
    for name, tensor in state.items():
        sums = _sums(tensor)
        if sums is not None:
            mine[name] = (str(tensor.dtype).removeprefix("torch."), list(tensor.shape), *sums)
    gathered = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    shards: dict[str, dict] = {}
    for rank_sums in gathered:
        for name, (dtype, shape, key, *sums) in rank_sums.items():
            entry = shards.setdefault(name, {"dtype": dtype, "shape": shape, "shards": {}})
            entry["shards"].setdefault(tuple(key), sums)  # a replica's copy of a shard counts once
    out = {}
    for name in sorted(shards):
        entry = shards[name]
        parts = [entry["shards"][k] for k in sorted(entry["shards"])]
        out[name] = [entry["dtype"], entry["shape"], *(math.fsum(p[i] for p in parts) for i in range(3))]
    return out


def _sum_differs(a: float, b: float, scale: float) -> bool:
    return not abs(a - b) <= REL_TOL * scale  # NaN differs


def fingerprint_differences(saved: dict, current: dict) -> list[str]:
    """What differs between two fingerprints, one line per tensor (empty when they agree)."""
    out = [f"'{n}' is in the checkpoint's base, not in this model's" for n in sorted(set(saved) - set(current))]
    out += [f"'{n}' is in this model's base, not in the checkpoint's" for n in sorted(set(current) - set(saved))]
    for name in sorted(set(saved) & set(current)):
        (sd, ss, sw, sa, s2), (cd, cs, cw, ca, c2) = saved[name], current[name]
        if (sd, list(ss)) != (cd, list(cs)):
            out.append(f"'{name}' is {cd} {list(cs)} here, {sd} {list(ss)} in the checkpoint")
        elif _sum_differs(sw, cw, max(sa, ca)) or _sum_differs(s2, c2, max(s2, c2)):
            rel = fingerprint_rel_difference({name: saved[name]}, {name: current[name]})
            out.append(f"'{name}' holds other values (its fingerprint differs by {rel:.1e}, relative; rounding "
                       f"alone stays under {REL_TOL:.0e})")
    return out


def fingerprint_rel_difference(saved: dict, current: dict) -> float:
    """The largest difference between two fingerprints' sums of the same tensors, relative to their scale (the
    quantity compared with ``REL_TOL``)."""
    worst = 0.0
    for name in set(saved) & set(current):
        _, _, sw, sa, s2 = saved[name]
        _, _, cw, ca, c2 = current[name]
        for a, b, scale in ((sw, cw, max(sa, ca)), (s2, c2, max(s2, c2))):
            if scale > 0:
                worst = max(worst, abs(a - b) / scale)
    return worst


# ---- what a checkpoint records --------------------------------------------------------------------------------
def _jsonable(value):
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def config_dicts(model) -> dict:
    """Each adapter's ``PeftConfig`` as JSON (what ``adapter_config.json`` holds)."""
    return {name: json.loads(json.dumps(cfg.to_dict(), default=_jsonable)) for name, cfg in model.peft_config.items()}


def peft_config(values: dict):
    """A ``PeftConfig`` from ``config_dicts``' JSON."""
    from peft import PeftConfig

    return PeftConfig.from_peft_type(**values)


def _config_differences(saved: dict, current: dict) -> list[str]:
    out = []
    for name in sorted(set(saved) | set(current)):
        if name not in saved or name not in current:
            out.append(f"adapter '{name}' is {'not ' if name not in current else ''}in this model and "
                       f"{'not ' if name not in saved else ''}in the checkpoint")
            continue
        for field in _CONFIG_FIELDS:
            a, b = saved[name].get(field), current[name].get(field)
            if isinstance(a, list) and isinstance(b, list) and all(isinstance(v, str) for v in a + b):
                a, b = sorted(a), sorted(b)
            if a != b:
                out.append(f"adapter '{name}': {field} is {b!r} here, {a!r} in the checkpoint")
    return out


@hookimpl
def ultrascale_state_save(pmodel, state):
    model = pmodel.module
    if not is_peft_model(model):
        return
    if state.loading is not None:
        saved = state.loading.get("plugins", {}).get(KEY)
        if saved is None:  # a checkpoint written before adapter-only checkpoints: it holds the base, loaded from it
            return
        _check_checkpoint(model, saved, frozen_state(pmodel), state.loading)
        state.left_out.update(saved["base"])
        return
    frozen = frozen_state(pmodel)
    state.left_out.update(frozen)
    state.shared[KEY] = {"format": FORMAT, "adapters": config_dicts(model), "active": list(model.active_adapters),
                         "base": fingerprint(frozen)}


def _check_checkpoint(model, saved: dict, frozen: dict, loading: dict) -> None:
    """Refuse, before anything is read, a checkpoint whose adapters differ from this model's or whose frozen base
    is not the one this model holds (every rank decides alike: the fingerprints are gathered)."""
    problems = _config_differences(saved["adapters"], config_dicts(model))
    if problems:
        raise ConfigError(f"it holds other adapters than this PEFT model: {'; '.join(problems[:3])}. Fix: build "
                          "the model with the PeftConfig the checkpoint was saved with")
    problems = fingerprint_differences(saved["base"], fingerprint(frozen))
    if problems:
        source = _recorded_base(loading, saved)
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(f"it was saved from a PEFT model on another frozen base: {problems[0]}{more}. It holds "
                          "the adapters only, which would resume on weights they were not trained with; nothing was "
                          "loaded. Fix: build the model on the same pretrained base"
                          + (f" ({source})" if source else "") + ", in the same dtype, before loading")


# ---- export --------------------------------------------------------------------------------------------------
def _saved(checkpoint) -> dict | None:
    saved = checkpoint.meta.get("plugins", {}).get(KEY)
    if saved is None and any(n.startswith("base_model.model.") for n in checkpoint.names):
        raise ConfigError(f"checkpoint '{checkpoint.path}' holds a PEFT model's tensors but not its PeftConfig (it "
                          "was written before adapter-only checkpoints). Fix: resume it with this version and save "
                          "again, or write the adapters with the front end's save_model / save_pretrained")
    if saved is not None and len(saved["adapters"]) != 1:
        raise ConfigError(f"checkpoint '{checkpoint.path}' was saved from a PEFT model with {len(saved['adapters'])} "
                          f"adapters ({', '.join(saved['adapters'])}); export takes a model with one. Fix: write "
                          "them with the front end's save_model / save_pretrained")
    return saved


def _peft_model(config, saved: dict, base=None):
    """The checkpoint's PEFT model (its one adapter, named as saved) on ``base``, or on the meta device."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if base is None:
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(config)
    (name, values), = saved["adapters"].items()
    return PeftModel(base, peft_config(values), adapter_name=name)


def _adapter_tensors(checkpoint, saved: dict) -> dict:
    names = [n for n in checkpoint.names if n not in saved["base"]]
    if not names:
        raise ConfigError(f"checkpoint '{checkpoint.path}' holds no adapter tensors")
    return checkpoint.read(names)


def _base_dtype(saved: dict):
    """The dtype most of the frozen base's floating tensors had in the run."""
    import torch

    counts: dict[str, int] = {}
    for dtype, shape, *_ in saved["base"].values():
        if getattr(torch, dtype).is_floating_point:
            counts[dtype] = counts.get(dtype, 0) + math.prod(shape)
    return getattr(torch, max(counts, key=counts.get)) if counts else None


def _write_adapter(checkpoint, saved: dict, out_dir: str) -> None:
    """PEFT's files, named and written by PEFT itself (as a PEFT model's ``save_pretrained``) from the
    checkpoint's adapters, on a model built on the meta device (no base weights are read)."""
    _peft_model(checkpoint.config, saved).save_pretrained(out_dir, state_dict=_adapter_tensors(checkpoint, saved))


def _recorded_base(meta: dict, saved: dict) -> str | None:
    """The pretrained base a checkpoint records: the command line's ``--init-from`` (``extra["init_from"]``), else
    the ``base_model_name_or_path`` PEFT recorded when the model was built on a ``from_pretrained`` base."""
    init_from = (meta.get("extra") or {}).get("init_from")
    if isinstance(init_from, str) and init_from:
        return init_from
    return next((c.get("base_model_name_or_path") for c in saved["adapters"].values()
                 if c.get("base_model_name_or_path")), None)


def _write_merged(checkpoint, saved: dict, out_dir: str, base: str | None, max_shard_bytes: int) -> None:
    from transformers import AutoModelForCausalLM

    source = base or _recorded_base(checkpoint.meta, saved)
    if not source:
        raise ConfigError(f"checkpoint '{checkpoint.path}' holds the adapters only and records no pretrained base "
                          "(neither --init-from nor a base loaded with from_pretrained). Fix: pass the base model's "
                          "directory with --base DIR")
    if not os.path.isdir(source) and (os.path.isabs(source) or source.startswith(".")):  # a path, not a Hub id
        recorded = "" if base else f"recorded with checkpoint '{checkpoint.path}' "
        raise ConfigError(f"the base {recorded}('{source}') is not a directory here. Fix: pass the base model's "
                          "directory with --base DIR")
    adapters = _adapter_tensors(checkpoint, saved)
    pretrained = AutoModelForCausalLM.from_pretrained(source, dtype=_base_dtype(saved))
    model = _peft_model(checkpoint.config, saved, pretrained)
    problems = fingerprint_differences(saved["base"], fingerprint({k: v for k, v in model.state_dict().items()
                                                                   if k not in adapters}))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(f"'{source}' is not the frozen base checkpoint '{checkpoint.path}' was trained on: "
                          f"{problems[0]}{more}; nothing was written. Fix: pass the base the run started from "
                          "with --base DIR")
    unexpected = model.load_state_dict(adapters, strict=False).unexpected_keys
    if unexpected:
        raise ConfigError(f"checkpoint '{checkpoint.path}': '{unexpected[0]}' is not a tensor of its PEFT model")
    merged = model.merge_and_unload(safe_merge=True)
    merged.save_pretrained(out_dir, max_shard_size=max_shard_bytes)


def export(checkpoint, form, out_dir, base, max_shard_bytes) -> bool | None:
    """Write ``checkpoint``, saved from a PEFT model, as PEFT's files (``form`` "adapter") or a merged transformers
    model (``"merged"``, the base from ``base``) into ``out_dir``; True once written, None for another checkpoint."""
    saved = _saved(checkpoint)
    if saved is None:
        return None
    if form == "adapter":
        _write_adapter(checkpoint, saved, str(out_dir))
    elif form == "merged":
        _write_merged(checkpoint, saved, str(out_dir), base, max_shard_bytes)
    else:
        return None
    return True
