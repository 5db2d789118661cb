"""Load a pretrained Hugging Face model (``save_pretrained`` directory: ``config.json`` + safetensors, one file or
sharded) into any layout without any rank holding the whole model.

The model is built on the meta device (parameters without storage; buffers such as rotary frequencies are then
computed by the model's own ``_init_weights``, as transformers does after its own meta build), parallelized —
pipeline split, TP, FSDP — while still empty, then every rank allocates only its own shards and reads exactly those
slices from the safetensors files (PyTorch distributed checkpoint's ``HuggingFaceStorageReader`` plans the reads
from each DTensor's local chunk and reads them with ``safe_open(...).get_slice``). Names are matched, tied weights
resolved and shapes checked before any process group exists, so a wrong directory fails fast with the offending
key named.

    pmodel = ultrascale_plugins.from_pretrained("my-model/", ParallelConfig(tp=2))   # engine.from_pretrained
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .checkpoint import CheckpointError

SUFFIX = ".safetensors"


@dataclasses.dataclass
class PretrainedWeights:
    """Where each of the model's state-dict entries comes from in an HF directory."""

    path: Path
    sources: dict[str, str]  # model key -> key in the safetensors files
    unexpected: list[str]  # keys in the files no model entry reads

    def load(self, ctx, buffers: dict[str, torch.Tensor]) -> None:
        """Give this rank's (sharded) parameters storage and their pretrained values; restore the buffers
        computed at construction (``to_empty`` leaves them uninitialised)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        from .initialize import to_empty_tied

        for module in ctx.modules:
            to_empty_tied(module, ctx.device)  # plain to_empty would untie a tied head from its embedding
            with torch.no_grad():
                for name, buf in module.named_buffers():
                    if name in buffers:
                        buf.copy_(buffers[name])
        for module in ctx.modules:
            state = get_model_state_dict(module)
            # one read per file key; a second local tensor wanting the same key (a tied weight held by two
            # stages of this rank) is copied from the first after the read
            reads: dict[str, torch.Tensor] = {}
            copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            for key, tensor in state.items():
                source = self.sources.get(key)
                if source is None:
                    continue  # a buffer the files do not hold (checked before the process group existed)
                if source in reads:
                    copies.append((tensor, reads[source]))
                else:
                    reads[source] = tensor
            try:
                dcp.load(reads, storage_reader=HuggingFaceStorageReader(str(self.path)))
            except Exception as exc:
                raise CheckpointError(f"pretrained weights in '{self.path}' could not be read: "
                                      f"{exc}".splitlines()[0]) from exc
            with torch.no_grad():
                for dst, src in copies:
                    dst.copy_(src)
            set_model_state_dict(module, state)


def read_config(path: str | Path, trust_remote_code: bool = False):
    """The model config of an HF directory (never runs repository code unless asked to)."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"'{path}' is not a Hugging Face model directory (no config.json). Fix: pass the "
                              "directory written by save_pretrained")
    return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)


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


def match_weights(model, path: str | Path) -> PretrainedWeights:
    """Map every entry of ``model``'s state dict to a key of the files: the same name, the name without the
    base-model prefix (a checkpoint of the bare decoder), or, for a tied head/embedding, the other one's name.
    Missing keys and shape mismatches are errors; keys nothing reads are reported as unexpected."""
    path = Path(path)
    found = file_tensors(path)
    prefix = getattr(model, "base_model_prefix", "") + "."
    tied = {}
    for target, source in (getattr(model, "_tied_weights_keys", None) or {}).items():
        if isinstance(target, str) and isinstance(source, str) and getattr(model.config, "tie_word_embeddings",
                                                                             True):
            tied[target], tied[source] = source, target
    sources, missing, mismatched = {}, [], []
    for key, tensor in model.state_dict().items():
        names = [key, tied.get(key)]
        candidates = [n for name in names if name for n in (name, name.removeprefix(prefix))]
        source = next((c for c in candidates if c in found), None)
        if source is None:
            missing.append(key)
            continue
        if tuple(tensor.shape) != found[source][0]:
            mismatched.append(f"{key}: model {tuple(tensor.shape)}, file {found[source][0]} in {found[source][1]}")
        sources[key] = source
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"'{path}' lacks weights the model needs (missing keys: {shown}). Fix: check that "
                              "config.json matches the weights, or save the model again with save_pretrained")
    if mismatched:
        raise CheckpointError(f"'{path}': shapes differ from the model's config ({'; '.join(mismatched[:4])}). "
                              "Fix: use the config.json saved with these weights")
    read = set(sources.values())
    return PretrainedWeights(path=path, sources=sources, unexpected=sorted(k for k in found if k not in read))


def empty_model(model_config):
    """The causal LM on the meta device (tied weights stay tied), with its buffers computed."""
    from transformers import AutoModelForCausalLM

    from .initialize import fill_buffers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    fill_buffers(model)  # the buffers the meta build left empty, from the model's own _init_weights
    return model


def prepare(path: str | Path, trust_remote_code: bool = False):
    """(weights, empty model) for ``path``: every check that needs no process group."""
    model = empty_model(read_config(path, trust_remote_code))
    return match_weights(model, path), model


def computed_buffers(model_config) -> dict[str, torch.Tensor]:
    """The buffers a model computes at construction (rotary frequencies, ...), for a model built entirely on the
    meta device (``torch.device("meta")``), which leaves them empty."""
    return {name: buf for name, buf in empty_model(model_config).named_buffers()}


def weights_for(model, init_from: str | Path | None):
    """What a front end should load into ``model`` once parallelized: the weights of ``init_from`` if given; for a
    model built on the meta device (``empty_init``, ``torch.device("meta")``), those of the directory its config was
    read from (``AutoConfig.from_pretrained(DIR)`` records it), else a ``ModelInit`` that initializes it shard by
    shard with the model's own scheme (seeded by ``torch.initial_seed()``); for a real model, none. Buffers a meta
    build left empty are computed first."""
    from .initialize import ModelInit, fill_buffers

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
    if source is None:
        return ModelInit(model)
    return match_weights(model, source)
