"""Export a sharded checkpoint (any layout) to a Hugging Face directory: safetensors shards, config.json and
generation_config.json, streamed tensor by tensor so memory stays bounded by one output shard. The tensors are
named as transformers' own ``save_pretrained`` names them (a MoE model's fused experts written per expert:
``saved_format_groups``).

    ultrascale export runs/ckpt/step-00000040 out/my-model
    ultrascale export runs/ckpt/step-00000040 out/adapter --adapter          # a PEFT model's: PEFT's own files
    ultrascale export runs/ckpt/step-00000040 out/merged --merged [--base DIR]  # adapters folded into the base

The forms a model's own library defines (``--adapter``, ``--merged``) are written by that library, as its plugin
declares it (``WrapperLibrary.export``; PEFT's: ``features/peft/checkpoints.py``), from the tensors read here.
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..interface.config import ConfigError
from .errors import CheckpointError
from .sharded import SafeReader, read_meta, saved_model_config

MODEL_PREFIX = "model."
FORMS = ("adapter", "merged")


def _meta_model(config):
    """The causal LM of ``config`` on the meta device (nothing allocated), or None when transformers cannot build
    it from the config alone (then the checkpoint is exported as saved)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001
        return None


def _check_names(names: list[str], model, checkpoint: Path) -> None:
    """Refuse a checkpoint whose tensors are not the model's own (a PEFT model's: its wrapper's names and its
    adapters): written out, transformers would skip them and load random weights in their place."""
    if model is None:
        return
    config = model.config
    expected = set(model.state_dict())
    unknown = [n for n in names if n not in expected]
    if unknown:
        raise CheckpointError(f"checkpoint '{checkpoint}': {len(unknown)} tensor(s) are not parameters of a "
                              f"{config.model_type} model (e.g. '{unknown[0]}'): it was saved from a wrapped model "
                              "(a PEFT model: its adapters, without the frozen base). Fix: `ultrascale export "
                              "--adapter` writes the adapters in PEFT's files (as save_pretrained does), `ultrascale "
                              "export --merged [--base DIR]` a plain model with the adapters merged into the base")


def verify_contents(checkpoint: Path, meta: dict) -> None:
    """Every file of the checkpoint against its checksum (export is one process and reads every shard), before
    anything is written."""
    from .checksums import check, say_once, unverified_note

    say_once(unverified_note(checkpoint, meta))
    check(checkpoint, meta, meta.get("files", {}))


class SavedCheckpoint:
    """A sharded checkpoint as a wrapper library's ``export`` sees it: ``path``, ``meta`` (its
    ``ultrascale.json``), ``config`` (the transformers config it was saved with), ``names`` (the model tensors it
    holds, sorted) and ``read(names)``: those tensors, whole, on the CPU (every rank's shards gathered by DCP, in
    this one process)."""

    def __init__(self, path: Path):
        self.path = path
        self.meta = read_meta(path)
        verify_contents(path, self.meta)
        self.config = saved_model_config(self.meta, path)
        self._md = SafeReader(str(path)).read_metadata()  # refuses a forged .metadata before anything is written
        self.names = sorted(k[len(MODEL_PREFIX):] for k, v in self._md.state_dict_metadata.items()
                            if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata))

    def read(self, names) -> dict[str, torch.Tensor]:
        missing = [n for n in names if MODEL_PREFIX + n not in self._md.state_dict_metadata]
        if missing:
            raise CheckpointError(f"checkpoint '{self.path}' holds no tensor '{missing[0]}'")
        out = {}
        for n in names:
            tmd = self._md.state_dict_metadata[MODEL_PREFIX + n]
            out[n] = torch.empty(tmd.size, dtype=tmd.properties.dtype)
        with warnings.catch_warnings():  # no_dist=True is the intent here; DCP warns about it on every call
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({MODEL_PREFIX + n: t for n, t in out.items()}, storage_reader=SafeReader(str(self.path)),
                     no_dist=True)
        return out


def export_form(checkpoint: str | Path, out_dir: str | Path, form: str, *, base: str | Path | None = None,
                max_shard_bytes: int = 2 * 2**30, pm=None) -> Path:
    """Write ``out_dir`` in a form the checkpoint's model defines (``"adapter"``: a PEFT model's adapters in PEFT's
    files, for ``PeftModel.from_pretrained(base, out_dir)``; ``"merged"``: a plain transformers model with the
    adapters merged into the frozen base, read from ``base`` or the base the checkpoint records). Runs in one
    process; the first library whose ``WrapperLibrary.export`` answers writes it. Nothing is left behind on
    failure."""
    if form not in FORMS:
        raise CheckpointError(f"export form '{form}' is not one of {', '.join(FORMS)}")
    checkpoint, out = Path(checkpoint), Path(out_dir)
    saved = SavedCheckpoint(checkpoint)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"export target '{out}' is not empty. Fix: pass a new directory (nothing is "
                              "overwritten)")
    from ..core.registry import given_or_default  # the command line's ``ultrascale export``, a front end

    pm = given_or_default(pm)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        base_dir = None if base is None else str(base)
        done = next((a for a in (library.export(saved, form, out, base_dir, max_shard_bytes)
                                 for library in pm.wrapper_libraries()) if a is not None), None)
        if not done:
            raise CheckpointError(f"checkpoint '{checkpoint}' has no --{form} form: it was not saved from a model "
                                  "that defines one (a PEFT model). Fix: export it without --adapter / --merged")
    except ConfigError as exc:
        _clear(out, created)
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(str(exc)) from None
    except BaseException:
        _clear(out, created)
        raise
    _copy_tokenizer(checkpoint, out)
    return out


def _clear(out: Path, created: bool) -> None:
    if created:
        shutil.rmtree(out, ignore_errors=True)
    else:
        for f in out.iterdir():
            shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink()


def _copy_tokenizer(checkpoint: Path, out: Path) -> None:
    tokenizer = checkpoint / "tokenizer"  # the tokenizer (and chat template) the run trained with
    if tokenizer.is_dir():
        for f in tokenizer.iterdir():
            if f.is_file():
                shutil.copy2(f, out / f.name)


def saved_format_groups(model, names: list[str]) -> list[tuple[list[str], object]]:
    """``names`` (the model's parameters) in groups that convert to the checkpoint format transformers'
    ``save_pretrained`` writes, each with the function doing it (None: written as they are, under their names).
    transformers >= 5 fuses some parameters at load (a MoE layer's experts into ``mlp.experts.gate_up_proj`` /
    ``down_proj``) and ``save_pretrained`` splits them again (``mlp.experts.<e>.gate_proj.weight``, ...), with the
    reverse of the model's conversion mapping (``core_model_loading.revert_weight_conversion``). That function
    reverts a whole state dict at once; here the names are grouped as it groups them (the parameters one reversed
    converter takes together), so each group is read, reverted by transformers' own function and written on its
    own, and memory stays bounded by one group."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (PrefixChange, WeightConverter, apply_converters,
                                                     dot_natural_key, revert_weight_conversion)
    except ImportError:  # pragma: no cover - a transformers without conversion mappings stores what it holds
        return [([n], None) for n in names]
    if model is None:
        return [([n], None) for n in names]
    # as revert_weight_conversion picks them for a model not loaded with from_pretrained
    conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                   if not isinstance(c, PrefixChange)]
    if not conversions:
        return [([n], None) for n in names]
    converters = [c.reverse_transform() for c in conversions[::-1]]
    converters = [c for c in converters if isinstance(c, WeightConverter)]
    grouped: dict[tuple[str, str], list[str]] = {}
    for name in sorted(names, key=dot_natural_key):
        target, pattern = apply_converters(name, converters)
        # what a reversed converter takes together, by its target; any other name alone (renamed, if at all)
        grouped.setdefault(("converted", target) if pattern is not None else ("alone", name), []).append(name)

    def revert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return revert_weight_conversion(model, tensors)

    return [(group, revert) for group in grouped.values()]


def export_hf(checkpoint: str | Path, out_dir: str | Path, *, max_shard_bytes: int = 2 * 2**30,
              dtype: torch.dtype | None = None, verify: bool = True) -> Path:
    """Write ``out_dir`` so that ``AutoModelForCausalLM.from_pretrained(out_dir)`` gives the trained model.
    Runs in one process, no process group needed. ``verify=False``: the caller has just written the checkpoint
    (``save_pretrained``'s staging), its files are not re-read for their checksums."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    checkpoint, out = Path(checkpoint), Path(out_dir)
    meta = read_meta(checkpoint)
    if verify:
        verify_contents(checkpoint, meta)
    config = saved_model_config(meta, checkpoint)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"export target '{out}' is not empty. Fix: pass a new directory (nothing is "
                              "overwritten)")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    md = SafeReader(str(checkpoint)).read_metadata()  # refuses a forged .metadata before anything is written
    names = sorted(k[len(MODEL_PREFIX):] for k, v in md.state_dict_metadata.items()
                   if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata))
    model = _meta_model(config)
    _check_names(names, model, checkpoint)
    if tied:  # transformers stores a tied head once, under the embedding's name
        names = [n for n in names if n != "lm_head.weight"] if any("embed" in n or "wte" in n for n in names) \
            else names
    out.mkdir(parents=True, exist_ok=True)
    written: list[list[str]] = []  # tensor names per shard file; tensors leave memory once written
    current: dict[str, torch.Tensor] = {}
    size = 0

    def write_shard() -> None:
        nonlocal current, size
        save_file(current, str(out / f"part-{len(written)}.safetensors"), metadata={"format": "pt"})
        written.append(list(current))
        current, size = {}, 0

    for group, revert in saved_format_groups(model, names):
        tensors = {}
        for name in group:
            tmd = md.state_dict_metadata[MODEL_PREFIX + name]
            tensors[name] = torch.empty(tmd.size, dtype=tmd.properties.dtype)
        with warnings.catch_warnings():  # no_dist=True is the intent here; DCP warns about it on every call
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({MODEL_PREFIX + n: t for n, t in tensors.items()}, storage_reader=SafeReader(str(checkpoint)),
                     no_dist=True)
        for name, tensor in (revert(tensors) if revert is not None else tensors).items():
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            tensor = tensor.contiguous()
            if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                tensor = tensor.clone()  # a piece of a split parameter: safetensors refuses shared storage
            nbytes = tensor.numel() * tensor.element_size()
            if current and size + nbytes > max_shard_bytes:
                write_shard()
            current[name] = tensor
            size += nbytes
        del tensors
    if current:
        write_shard()
    index = {}
    for i, tensor_names in enumerate(written):
        final = "model.safetensors" if len(written) == 1 else f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        (out / f"part-{i}.safetensors").rename(out / final)
        index.update({name: final for name in tensor_names})
    if len(written) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index},
                                                                      indent=1))
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    _copy_tokenizer(checkpoint, out)
    return out
