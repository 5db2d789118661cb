"""The reads of a pretrained Hugging Face directory (``save_pretrained``: safetensors, one file or sharded) planned
before any process group exists: each entry of the model's state dict matched to the key of the files it starts
from, and what no file holds named.

Names are those of transformers' own loader: the same name, the name without the base-model prefix (a checkpoint of
the bare decoder), for a tied head or embedding the other one's name, or what transformers' conversion mapping
(``transformers.conversion_mapping``) renames it from or assembles it from (``fused_source.FusedSource``). A wrapper
around a causal LM (a PEFT model) is matched through its plain names, asked of the plugins (its ``ModelWrapper``,
handed in: the caller asks for it once). Only the files' headers are read; missing keys and shapes that differ are
errors naming the offending key, so a wrong directory fails before any weight is read.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .errors import CheckpointError
from .fused_source import FusedSource

SUFFIX = ".safetensors"


@dataclasses.dataclass
class ReadPlan:
    """Where each of the model's state-dict entries comes from in an HF directory."""

    path: Path
    sources: dict[str, str]  # model key -> key in the safetensors files
    unexpected: list[str]  # keys in the files no model entry reads
    fused: dict[str, FusedSource] = dataclasses.field(default_factory=dict)  # model key -> several file keys
    # the entries a plugin introduced into a wrapper (a PEFT model's adapters), which no file holds
    introduced: list[str] = dataclasses.field(default_factory=list)
    files: dict[str, str] = dataclasses.field(default_factory=dict)  # file key of ``sources`` -> its file's name


def file_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, file name)} from the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    files = sorted(p for p in path.iterdir() if p.name.endswith(SUFFIX))
    if not files:
        pickled = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = (f" ({', '.join(pickled)} would need unpickling, which is never done)" if pickled else "")
        raise CheckpointError(f"'{path}' holds no *.safetensors weights{hint}. Fix: save the model with "
                              "save_pretrained(..., safe_serialization=True)")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as reader:
            for key in reader.keys():
                out[key] = (tuple(reader.get_slice(key).get_shape()), f.name)
    return out


def conversions(model, found: dict, state: dict) -> tuple[dict[str, str], dict[str, FusedSource]]:
    """transformers' conversion mapping for ``model`` applied to the file keys ``found``, as its own loader does
    (``core_model_loading.convert_and_load_state_dict_in_model``): ({model key: file key} of the renamed keys,
    {model key: FusedSource} of the keys its converters collect)."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    if not isinstance(model, PreTrainedModel):
        return {}, {}
    mapping = get_model_conversion_mapping(model)
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    renamings = [m for m in mapping if not isinstance(m, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    renamed: dict[str, str] = {}
    groups: dict[str, FusedSource] = {}
    for key in sorted(found, key=dot_natural_key):  # the order the converter stacks them in
        new, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if new not in state:
            continue
        if pattern is None:
            renamed.setdefault(new, key)
        else:
            group = groups.setdefault(new, FusedSource(by_pattern[pattern], new, new, {}))
            group.parts.setdefault(pattern, []).append((key, found[key][1]))
    return renamed, groups


def plain_entries(keys, wrapper) -> tuple[dict[str, str], list[str], object]:
    """Where each entry of a model's state dict (``keys``) starts from, asked of the plugins through the model's
    ``wrapper`` (``ModelWrapper.pretrained_name``) for a wrapper around a causal LM (a PEFT model): ({key: its name
    in the plain causal LM, as its pretrained files name it}, [keys a plugin introduced, which no file holds], the
    causal LM the plain names are of). A key no plugin answers for is its name without the wrapper's prefix; for a
    model that wraps nothing, every key is its own name."""
    plain, introduced = {}, []
    for key in keys:
        name = wrapper.pretrained_name(key)
        if name == "":
            introduced.append(key)
        else:
            plain[key] = name
    return plain, introduced, wrapper.inner


def tied_names(model) -> dict[str, str]:
    """{key: the key it is tied to} both ways, for a model whose config ties its head and embedding."""
    tied = {}
    for target, source in (getattr(model, "_tied_weights_keys", None) or {}).items():
        if isinstance(target, str) and isinstance(source, str) and getattr(model.config, "tie_word_embeddings", True):
            tied[target], tied[source] = source, target
    return tied


def plan_reads(model, path: str | Path, wrapper) -> ReadPlan:
    """Map every entry of ``model``'s state dict to a key of the files in ``path``: the same name, the name without
    the base-model prefix, for a tied head/embedding the other one's name, or what transformers' conversion mapping
    renames or assembles it from (``conversions``). Missing keys and shape mismatches are errors; keys nothing reads
    are reported as unexpected. ``wrapper``: ``model``'s ``ModelWrapper`` (the plain names of a PEFT model; the
    entries a plugin introduced, the adapters, are listed for the caller's initializer)."""
    path = Path(path)
    found = file_tensors(path)
    full_state = model.state_dict()
    plain, introduced, inner = plain_entries(list(full_state), wrapper)
    state = {name: full_state[key] for key, name in plain.items()}  # the plain model's entries (shapes)
    renamed, groups = conversions(inner, found, state)
    prefix = getattr(inner, "base_model_prefix", "") + "."
    tied = tied_names(inner)
    sources, unresolved, mismatched = {}, [], []
    for key, tensor in state.items():
        names = [key, tied.get(key)]
        candidates = [n for name in names if name for n in (name, name.removeprefix(prefix))]
        source = next((c for c in candidates if c in found), None) or next(
            (renamed[n] for n in names if n in renamed), None)
        if source is None:
            unresolved.append(key)
            continue
        if tuple(tensor.shape) != found[source][0]:
            mismatched.append(f"{key}: model {tuple(tensor.shape)}, file {found[source][0]} in {found[source][1]}")
        sources[key] = source
    fused = assembled(groups, found, state, set(unresolved), mismatched)
    missing = [key for key in unresolved if key not in fused]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"'{path}' lacks weights the model needs (missing keys: {shown}). Fix: check that "
                              "config.json matches the weights, or save the model again with save_pretrained")
    if mismatched:
        raise CheckpointError(f"'{path}': shapes differ from the model's config ({'; '.join(mismatched[:4])}). "
                              "Fix: use the config.json saved with these weights")
    read = set(sources.values()) | {key for f in fused.values() for items in f.parts.values() for key, _ in items}
    return ReadPlan(path=path, sources={key: sources[name] for key, name in plain.items() if name in sources},
                    unexpected=sorted(k for k in found if k not in read),
                    fused={key: fused[name] for key, name in plain.items() if name in fused},
                    introduced=introduced, files={key: found[key][1] for key in set(sources.values())})


def assembled(groups: dict[str, FusedSource], found: dict, state: dict, wanted: set[str],
              mismatched: list[str]) -> dict[str, FusedSource]:
    """{model key: FusedSource} for the ``wanted`` keys the converters' outputs provide, their shapes checked
    against the model's (the converters run on meta tensors of the files' shapes: nothing is read)."""
    fused = {}
    for group in groups.values():
        example = f"assembled from {next(iter(group.parts.values()))[0][0]}, ..."
        try:
            outputs = group.assemble(lambda item: torch.empty(found[item[0]][0], device="meta"))
        except Exception as exc:  # e.g. experts of different shapes
            if group.first in wanted:
                fused[group.first] = group
                mismatched.append(f"{group.first}: {exc} ({example})".replace("\n", " "))
            continue
        for name, value in outputs.items():
            if name in wanted:
                fused[name] = dataclasses.replace(group, target=name)
                if tuple(value.shape) != tuple(state[name].shape):
                    mismatched.append(f"{name}: model {tuple(state[name].shape)}, files {tuple(value.shape)} "
                                      f"({example})")
    return fused
