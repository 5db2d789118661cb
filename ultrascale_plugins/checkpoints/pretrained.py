"""Load a pretrained Hugging Face model (``save_pretrained`` directory: ``config.json`` + safetensors, one file or
sharded) into any layout without any rank holding the whole model.

The model is built on the meta device (parameters without storage; buffers such as rotary frequencies are then
computed by the model's own ``_init_weights``, as transformers does after its own meta build), parallelized —
pipeline split, TP, FSDP — while still empty, then every rank allocates only its own shards and reads exactly those
slices from the safetensors files (PyTorch distributed checkpoint's ``HuggingFaceStorageReader`` plans the reads
from each DTensor's local chunk and reads them with ``safe_open(...).get_slice``). Names are matched, tied weights
resolved and shapes checked before any process group exists, so a wrong directory fails fast with the offending
key named.

Checkpoint names are those of transformers' own loader: its conversion mapping (``transformers.conversion_mapping``)
renames keys and assembles the parameters it fuses — transformers >= 5 holds a MoE layer's experts as 3-D
parameters (``mlp.experts.gate_up_proj``) while the hub's checkpoints, and its own ``save_pretrained``, store
them per expert (``mlp.experts.<e>.gate_proj.weight``) — so such a parameter is built from exactly the tensors
its ``WeightConverter`` names, by the converter's own operations (``FusedSource``).

    pmodel = ultrascale_plugins.from_pretrained("my-model/", ParallelConfig(tp=2))   # checkpoints.load
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from pathlib import Path

import torch

from ..core.registry import given_or_default
from .errors import CheckpointError

SUFFIX = ".safetensors"


@dataclasses.dataclass
class FusedSource:
    """A parameter that transformers' conversion mapping builds from several tensors of the files (e.g. a MoE
    layer's ``experts.gate_up_proj`` from every expert's ``gate_proj``/``up_proj``): the ``WeightConverter``
    transformers would use and the keys it collects, in transformers' order (expert 0, 1, ..., 10)."""

    converter: object  # transformers.core_model_loading.WeightConverter, nothing collected
    first: str  # the model key the checkpoint keys are renamed to (the converter's first target)
    target: str  # the model key this entry fills (one of the converter's outputs)
    parts: dict[str, list[tuple[str, str]]]  # converter source pattern -> [(file key, file name)]

    def by_rows(self) -> bool:
        """Whether row i of the parameter comes from the i-th key of each part only (experts stacked on dim 0,
        then joined along another dim), so that a shard of rows needs only those keys."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        first, *rest = self.converter.operations
        return (isinstance(first, MergeModulelist) and first.dim == 0
                and all(isinstance(op, Concatenate) and op.dim != 0 for op in rest))

    def assemble(self, read, rows: list[int] | None = None) -> dict[str, torch.Tensor]:
        """The converter's outputs from ``read((key, file))`` of its keys (only the ``rows``-th of each part if
        given: then the output holds those rows of the parameter, see ``by_rows``)."""
        converter = copy.deepcopy(self.converter)
        for pattern, items in self.parts.items():
            for item in (items if rows is None else [items[i] for i in rows]):
                converter.add_tensor(self.first, item[0], pattern, functools.partial(read, item))
        return converter.convert(self.first)

    @torch.no_grad()
    def load_into(self, tensor: torch.Tensor, read) -> None:
        """Fill this rank's shard of ``tensor`` (a DTensor or a whole tensor), reading only the keys of the rows
        it holds where the converter allows (``by_rows``), else all of this one parameter's keys."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        from ..core.initialize import local_chunk

        try:
            from torch.distributed.tensor.placement_types import _StridedShard
        except ImportError:  # pragma: no cover
            _StridedShard = Shard
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel() == 0:
            return
        rows = None
        if isinstance(tensor, DTensor):
            placements = list(tensor.placements)
            if self.by_rows():  # which rows (experts) this rank holds: its chunk of an index vector along dim 0
                on_rows = [isinstance(p, (Shard, _StridedShard)) and p.dim % tensor.ndim == 0 for p in placements]
                index = torch.arange(tensor.shape[0]).view(-1, *[1] * (tensor.ndim - 1))
                rows = local_chunk(index, tensor.device_mesh,
                                   [p if r else Replicate() for p, r in zip(placements, on_rows)]).flatten().tolist()
                placements = [Replicate() if r else p for p, r in zip(placements, on_rows)]
            value = local_chunk(self.assemble(read, rows)[self.target], tensor.device_mesh, placements)
        else:
            value = self.assemble(read)[self.target]
        if tuple(value.shape) != tuple(local.shape):
            raise RuntimeError(f"{self.target}: local shard {tuple(local.shape)} but the layout gives "
                               f"{tuple(value.shape)}")
        local.copy_(value)


@dataclasses.dataclass
class PretrainedWeights:
    """Where each of the model's state-dict entries comes from in an HF directory."""

    path: Path
    sources: dict[str, str]  # model key -> key in the safetensors files
    unexpected: list[str]  # keys in the files no model entry reads
    fused: dict[str, FusedSource] = dataclasses.field(default_factory=dict)  # model key -> several file keys
    # the entries a plugin introduced into a wrapper (a PEFT model's adapters), which no file holds, and the
    # initializer that draws them (initialize.ModelInit: the plugin's own scheme, seeded by the entry's name)
    introduced: list[str] = dataclasses.field(default_factory=list)
    init: object = None
    wrapper: object = None  # the model's ``ModelWrapper``: the values computed from others (DoRA's magnitude)
    pm: object = None  # the registry: the dimensions' views of the tensors they placed in pieces

    def load(self, ctx, buffers: dict[str, torch.Tensor]) -> None:
        """Give this rank's (sharded) parameters storage and their pretrained values; restore the buffers
        computed at construction (``to_empty`` leaves them uninitialised); draw the entries a plugin introduced
        (``introduced``), then set the values computed from others (``ModelWrapper.init_dependent``: DoRA's
        magnitude, from the loaded base)."""
        import torch.distributed.checkpoint as dcp
        from safetensors import safe_open
        from torch.distributed.checkpoint import HuggingFaceStorageReader
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             set_model_state_dict)

        from ..core.initialize import give_storage

        give_storage(ctx, buffers)  # tied parameters kept tied, where the layout holds them; the computed buffers
        for module in ctx.modules:
            state = get_model_state_dict(module)
            # one read per file key; a second local tensor wanting the same key (a tied weight held by two
            # stages of this rank) is copied from the first after the read
            reads: dict[str, torch.Tensor] = {}
            copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            fused: list[tuple[FusedSource, torch.Tensor]] = []
            apart: list[tuple[str, str]] = []  # (model key, file key) of entries held in another form: read whole
            for key, tensor in state.items():
                source = self.sources.get(key)
                if source is None:
                    if key in self.fused:
                        fused.append((self.fused[key], tensor))
                    continue  # else a buffer the files do not hold (checked before the process group existed)
                if _held_apart(tensor):
                    apart.append((key, source))
                    continue
                if source in reads:
                    copies.append((tensor, reads[source]))
                else:
                    reads[source] = tensor
            try:
                if reads:  # a TP-packed parameter (GPT-2's c_attn) is read as its true pieces, as checkpoints do
                    from .sharded import dcp_view

                    dcp.load({k: dcp_view(v, self.pm) for k, v in reads.items()},
                             storage_reader=HuggingFaceStorageReader(str(self.path)))
                with contextlib.ExitStack() as files:  # one parameter at a time, each file opened once
                    opened = {}

                    def read(item: tuple[str, str]) -> torch.Tensor:
                        key, name = item
                        if name not in opened:
                            opened[name] = files.enter_context(safe_open(str(self.path / name), framework="pt"))
                        return opened[name].get_tensor(key)

                    for source, tensor in fused:
                        source.load_into(tensor, read)
                    files_of = file_tensors(self.path) if apart else {}
                    for key, source in apart:
                        self._load_apart(module.get_parameter(key), read((source, files_of[source][1])))
            except Exception as exc:
                raise CheckpointError(f"pretrained weights in '{self.path}' could not be read: "
                                      f"{exc}".splitlines()[0]) from exc
            with torch.no_grad():
                for dst, src in copies:
                    dst.copy_(src)
            for key, _ in apart:  # written into the parameters themselves
                state.pop(key)
            set_model_state_dict(module, state, options=StateDictOptions(strict=not apart))
        with torch.no_grad():
            if self.init is not None:
                self.init.fill(ctx.modules, only=set(self.introduced))
            if self.wrapper is not None:
                self.wrapper.init_dependent(list(ctx.modules))


    @torch.no_grad()
    def _load_apart(self, param: torch.Tensor, full: torch.Tensor) -> None:
        """One parameter held in another form than the files' (a quantized base): its whole value as the model's
        wrapper holds it (``ModelWrapper.held_value``: quantized whole), then this rank's part of that."""
        from torch.distributed.tensor import DTensor

        from ..core.initialize import copy_part, local_chunk

        local = param.to_local() if isinstance(param, DTensor) else param
        held = full if self.wrapper is None else self.wrapper.held_value(local, full)
        part = local_chunk(held, param.device_mesh, param.placements) if isinstance(param, DTensor) else held
        if tuple(part.shape) != tuple(local.shape):
            raise RuntimeError(f"local shard {tuple(local.shape)} but the layout gives {tuple(part.shape)}")
        copy_part(param, local, part)


def _held_apart(tensor: torch.Tensor) -> bool:
    """Whether a parameter's local part is a tensor subclass (torchao's NF4Tensor), which a checkpoint reader
    cannot fill in place: it is read whole and converted (``PretrainedWeights._load_apart``)."""
    from torch.distributed.tensor import DTensor

    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return type(local) not in (torch.Tensor, torch.nn.Parameter)


def read_config(path: str | Path, trust_remote_code: bool = False):
    """The model config of an HF directory (never runs repository code unless asked to); a config.json that is not
    JSON or holds a value transformers refuses is one line naming the file, not transformers' traceback."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"'{path}' is not a Hugging Face model directory (no config.json). Fix: pass the "
                              "directory written by save_pretrained")
    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    # transformers says a file that is not JSON with an OSError, a refused value with its strict checks' error
    except (OSError, ValueError, TypeError, StrictDataclassError) as exc:
        said = " ".join(str(exc.__cause__ or exc).split()).rstrip(".")
        raise CheckpointError(f"'{path / 'config.json'}' does not make a model config: {said}. Fix: correct the "
                              "file, or write it again with save_pretrained") from None


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


def plain_entries(model, keys, wrapper=None, pm=None) -> tuple[dict[str, str], list[str], object]:
    """Where each entry of ``model``'s state dict (``keys``) starts from, asked of the plugins
    (``ModelWrapper.pretrained_name``) for a wrapper around a causal LM (a PEFT model): ({key: its name in the plain
    causal LM, as its pretrained files name it}, [keys a plugin introduced, which no file holds], the causal LM the
    plain names are of). A key no plugin answers for is its name without the wrapper's prefix; for a model that
    wraps nothing, every key is its own name. ``wrapper``: ``model``'s, when the caller asked for it already."""
    wrapper = wrapper if wrapper is not None else given_or_default(pm).wrapper_of(model)
    plain, introduced = {}, []
    for key in keys:
        name = wrapper.pretrained_name(key)
        if name == "":
            introduced.append(key)
        else:
            plain[key] = name
    return plain, introduced, wrapper.inner


def match_weights(model, path: str | Path, seed: int | None = None, wrapper=None, pm=None) -> PretrainedWeights:
    """Map every entry of ``model``'s state dict to a key of the files: the same name, the name without the
    base-model prefix (a checkpoint of the bare decoder), for a tied head/embedding the other one's name, or what
    transformers' conversion mapping renames or assembles it from (``conversions``). Missing keys and shape
    mismatches are errors; keys nothing reads are reported as unexpected. Buffers a meta-device build left empty
    (rotary frequencies) are computed here, as ``weights_for`` does.

    A wrapper around a causal LM (a PEFT model, possibly on the meta device) is matched through its plain names
    (``plain_entries``); the entries a plugin introduced (the adapters) are drawn at load by a
    ``initialize.ModelInit`` seeded with ``seed`` (default: ``torch.initial_seed()`` now, i.e. the last
    ``torch.manual_seed``): the same seed gives the same adapters in every layout. ``wrapper``: ``model``'s
    ``ModelWrapper``, when the caller asked the plugins already (asked here otherwise, once)."""
    path, pm = Path(path), given_or_default(pm)
    wrapper = wrapper if wrapper is not None else pm.wrapper_of(model)
    found = file_tensors(path)
    if any(b.is_meta for b in model.buffers()):  # a meta build's buffers (rotary frequencies): no file holds them
        from ..core.initialize import fill_buffers

        fill_buffers(model)
    full_state = model.state_dict()
    plain, introduced, inner = plain_entries(model, list(full_state), wrapper, pm)
    state = {name: full_state[key] for key, name in plain.items()}  # the plain model's entries (shapes)
    renamed, groups = conversions(inner, found, state)
    prefix = getattr(inner, "base_model_prefix", "") + "."
    tied = {}
    for target, source in (getattr(inner, "_tied_weights_keys", None) or {}).items():
        if isinstance(target, str) and isinstance(source, str) and getattr(inner.config, "tie_word_embeddings",
                                                                             True):
            tied[target], tied[source] = source, target
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
    init = None
    if introduced:
        from ..core.initialize import ModelInit

        init = ModelInit(model, seed, wrapper=wrapper)
    return PretrainedWeights(path=path, sources={key: sources[name] for key, name in plain.items() if name in sources},
                             unexpected=sorted(k for k in found if k not in read),
                             fused={key: fused[name] for key, name in plain.items() if name in fused},
                             introduced=introduced, init=init, wrapper=wrapper, pm=pm)


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


def empty_model(model_config, dtype=torch.float32):
    """The causal LM on the meta device (tied weights stay tied) with its weights in ``dtype`` (a PEFT recipe's
    frozen base: bf16), its buffers computed."""
    from transformers import AutoModelForCausalLM

    from ..core.initialize import fill_buffers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    fill_buffers(model)  # the buffers the meta build left empty, from the model's own _init_weights
    return model


def prepare(path: str | Path, trust_remote_code: bool = False, dtype=torch.float32):
    """(weights, empty model in ``dtype``) for ``path``: every check that needs no process group."""
    model = empty_model(read_config(path, trust_remote_code), dtype=dtype)
    return match_weights(model, path), model


def computed_buffers(model_config) -> dict[str, torch.Tensor]:
    """The buffers a model computes at construction (rotary frequencies, ...), for a model built entirely on the
    meta device (``torch.device("meta")``), which leaves them empty."""
    return {name: buf for name, buf in empty_model(model_config).named_buffers()}


def weights_for(model, init_from: str | Path | None, seed: int | None = None, pm=None):
    """What a front end should load into ``model`` once parallelized: the weights of ``init_from`` if given; for a
    model built on the meta device (``empty_init``, ``torch.device("meta")``), those of the directory its config was
    read from (``AutoConfig.from_pretrained(DIR)`` records it), else a ``ModelInit`` that initializes it shard by
    shard with the model's own scheme (seeded by ``torch.initial_seed()``); for a real model, none. Buffers a meta
    build left empty are computed first. ``seed`` (default ``torch.initial_seed()``) draws what no file holds: the
    whole model without weights, a wrapper's introduced entries (a PEFT model's adapters) with them. The plugins
    are asked what the model's wrapper is once (``pm``: the registry, default the process's), for the names
    and the initializer alike."""
    from ..core.initialize import ModelInit, fill_buffers

    source = init_from
    meta = any(p.is_meta for p in model.parameters())
    if source is None and meta:
        origin = getattr(model.config, "_name_or_path", "")
        if origin and Path(origin, "config.json").is_file():
            source = origin
    if source is None and not meta:
        return None
    if any(b.is_meta for b in model.buffers()):
        fill_buffers(model)
    pm = given_or_default(pm)
    wrapper = pm.wrapper_of(model)
    if source is None:
        return ModelInit(model, seed, wrapper=wrapper)
    return match_weights(model, source, seed, wrapper, pm)

