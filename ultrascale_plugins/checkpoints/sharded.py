"""Sharded checkpoints: every rank writes its own shards (PyTorch distributed checkpoint), keyed by the
unparallelized model's parameter names, so a checkpoint saved in one layout loads in any other (DCP reshards
DTensors by their global shape).

A checkpoint directory ``step-00000042`` holds the DCP shards of the model (less what a plugin leaves out: a PEFT
model's frozen base, which the model being resumed supplies), the optimizer and the plugins' shared state, one
file per rank of the plugins' rank-local state (the step's RNG) and ``ultrascale.json`` (step, layout, optimizer
hyper-parameters, caller's extra state, the plugins' JSON values, every file's size and CRC-32). It is written under
a temporary name and renamed when every rank has finished, so a crash during a save leaves the previous checkpoints
untouched and no partial directory ever looks complete. A load verifies the files before it reads them, each rank
its share (``checksums``: who hashes and who verifies what). Loading never unpickles objects:
tensors come from DCP and ``torch.load(weights_only=True)``, the rest from JSON, and DCP's own ``.metadata``
(a pickle that torch's reader loads with plain ``pickle.load``) is read by ``SafeReader``, whose unpickler admits
only DCP's metadata classes: a checkpoint from an untrusted source runs no code.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from ..core.plugin_state import PluginState
from ..interface.config import ConfigError
from .errors import CheckpointError

META = "ultrascale.json"
PREFIX = "step-"


# What a DCP ``.metadata`` pickle may name (torch 2.11 to 2.13): DCP's metadata records, the filesystem storage's
# index, torch sizes, dtypes and layouts, and the paths torch records. Nothing else is looked up, so a pickle that
# names any other callable (os.system, builtins.eval, ...) fails before it is called.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "TensorProperties", "MetadataIndex", "StorageMeta",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "torch": {"Size"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Python's documented way to restrict what a pickle may load (``find_class`` answers only the names above
    and torch's dtypes). torch's weights-only unpickler would be the natural tool, but it rejects the protocol-4
    opcodes DCP writes."""

    def find_class(self, module: str, name: str):
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"'{module}.{name}' is not allowed in checkpoint metadata")


class SafeReader(dcp.FileSystemReader):
    """torch's ``FileSystemReader`` whose ``read_metadata`` unpickles with ``_MetadataUnpickler``, allowing only
    DCP's metadata classes; a checkpoint whose metadata names anything else (code to run) is refused. Every load of a
    sharded checkpoint goes through it (resume, export, the front ends' loads). Bytes entries are refused too:
    DCP reads them with ``torch.load(weights_only=False)``, and this package writes none."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, AttributeError, EOFError, TypeError, ValueError, IndexError,
                KeyError) as exc:
            raise CheckpointError(f"checkpoint '{self.path}': its DCP metadata holds more than tensor descriptions "
                                  f"({str(exc).splitlines()[0][:160]}); it was not loaded, and nothing in it ran. "
                                  "Fix: use a checkpoint from a source you trust, written by ultrascale-plugins"
                                  ) from None
        entries = getattr(metadata, "state_dict_metadata", None)
        if not isinstance(entries, dict) or any(isinstance(v, BytesStorageMetadata) for v in entries.values()):
            raise CheckpointError(f"checkpoint '{self.path}': its DCP metadata is not one this package writes "
                                  "(pickled objects where tensors belong); it was not loaded. Fix: use a checkpoint "
                                  "written by ultrascale-plugins")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _model_state(pmodel) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for part in pmodel.modules:
        state.update(get_model_state_dict(part))
    return state


def dcp_view(tensor, pm):
    """``tensor`` as DCP must see it: a dimension that placed it in pieces DCP cannot describe (a packed
    tensor-parallel parameter such as a fused gate|up, and its optimizer states) lists them
    (``ultrascale_state_checkpoint_view``: views, so a load fills the tensor itself); any other tensor as it is."""
    if not torch.is_tensor(tensor):
        return tensor
    view = pm.hook.ultrascale_state_checkpoint_view(tensor=tensor)
    return tensor if view is None else view


def _dcp_view(state: dict[str, dict[str, Any]], pm) -> dict[str, dict[str, Any]]:
    """The state as DCP must see it (``dcp_view`` of every tensor)."""
    return {group: {k: dcp_view(v, pm) for k, v in tensors.items()} for group, tensors in state.items()}


def _param_names(pmodel) -> dict[int, list[str]]:
    """Every name of every parameter: a tied embedding/head weight is stored under both names, so a layout that
    holds only one of them (a pipeline's first or last stage) finds its state."""
    names: dict[int, list[str]] = {}
    for part in pmodel.modules:
        for name, p in part.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
    return names


def _local_optimizer(optimizer):
    """Where this rank's optimizer state lives: ZeroRedundancyOptimizer (ZeRO-1) keeps each rank's partition in
    its inner optimizer, so every rank writes the states of the parameters it owns, whole; a load into another
    layout (or another partition) reads them from there."""
    return optimizer.optim if type(optimizer).__name__ == "ZeroRedundancyOptimizer" else optimizer


def _optimizer_state(pmodel, optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Optimizer state keyed by parameter name (``<fqn>.<exp_avg|...>``), and the hyper-parameters per group."""
    names = _param_names(pmodel)
    tensors: dict[str, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        groups.append({k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float, bool, str,
                                                                                         type(None), list, tuple))})
    local = _local_optimizer(optimizer)
    for group in local.param_groups:
        for p in group["params"]:
            for key, value in local.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    for name in names[id(p)]:
                        tensors[f"{name}.{key}"] = value
    return tensors, groups


def _init_optimizer_state(optimizer) -> None:
    """Allocate the optimizer's state tensors (in this layout) with a zero-gradient, zero-lr step, so DCP can
    load into them. The values are overwritten by the load. Frozen parameters (a PEFT model's base) get none:
    they never had a gradient, so the saved run holds no state for them either."""
    zero1 = _local_optimizer(optimizer) is not optimizer  # its step is collective: every rank takes it
    if not zero1 and all(optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"]
                         if p.requires_grad):
        return
    saved = [(g["lr"], g.get("weight_decay")) for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        if "weight_decay" in g:
            g["weight_decay"] = 0.0
        for p in g["params"]:
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, (lr, wd) in zip(optimizer.param_groups, saved):
        g["lr"] = lr
        if wd is not None:
            g["weight_decay"] = wd


def _plugin_state(pmodel, loading: dict | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any], set[str]]:
    """(shared tensors, shared JSON values, rank-local state, model entries left out) of every plugin."""
    state = PluginState(loading=loading)
    pmodel.pm.hook.ultrascale_state_save(pmodel=pmodel, state=state)
    tensors = {k: v for k, v in state.shared.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in state.shared.items() if not isinstance(v, torch.Tensor)}
    try:
        json.dumps(values)
    except TypeError as exc:
        raise ConfigError(f"a plugin's ultrascale_state_save returned a value that is neither a tensor nor JSON "
                          f"({exc}). Fix: return tensors, numbers, strings, lists or dicts") from None
    return tensors, values, state.rank_local, set(state.left_out)


def _rank_file(path: Path, rank: int) -> Path:
    return path / "rank_local" / f"rank{rank:05d}.pt"


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    recover(d)
    found = [p for p in d.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / META).is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve_checkpoint(path: str | Path) -> Path:
    """``path`` when it is a checkpoint, else the newest checkpoint in it (a save_dir); ``path`` itself when it
    holds none (reading it then says what is wrong)."""
    path = Path(path)
    if (path / META).is_file():
        return path
    found = list_checkpoints(path)
    return found[-1] if found else path


def save_checkpoint(pmodel, optimizer, directory: str | Path, *, step: int, extra: dict | None = None,
                    keep_last_n: int | None = None, assets: dict[str, Any] | None = None,
                    asynchronous: bool = False):
    """Write a sharded checkpoint of model, optimizer, RNG and ``extra`` (JSON: data position, scheduler, ...)
    as ``directory/step-XXXXXXXX``, keeping the newest ``keep_last_n``. ``assets``: name -> an object with
    ``save_pretrained`` (the tokenizer), written by rank 0 into that subdirectory. Returns the checkpoint's path,
    or with ``asynchronous`` a ``PendingCheckpoint`` (see ``write_checkpoint``)."""
    directory = Path(directory)

    def rotate(final: Path) -> None:
        if keep_last_n and dist.get_rank() == 0:
            for old in list_checkpoints(directory)[:-keep_last_n]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    return write_checkpoint(pmodel, optimizer, directory / f"{PREFIX}{step:08d}", step=step, extra=extra,
                            assets=assets, asynchronous=asynchronous, after_commit=rotate)


REPLACED = ".replaced-"  # an earlier checkpoint of the same name, moved aside until its replacement is in place


def recover(directory: str | Path) -> None:
    """Finish what a crash inside ``commit`` left in ``directory``: an earlier checkpoint moved aside whose
    replacement never arrived goes back to its name; one whose replacement did arrive is deleted. Every reader
    calls it first (ranks may race: whoever comes second finds it done)."""
    d = Path(directory)
    if not d.is_dir():
        return
    for aside in d.glob(REPLACED + "*"):
        final = d / aside.name[len(REPLACED):]
        try:
            if final.exists():
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(aside, final)
        except FileNotFoundError:
            pass


def commit(tmp: Path, final: Path) -> None:
    """Put the complete directory ``tmp`` at ``final``: the one commit every checkpoint goes through (the command
    line's, Accelerate's ``save_state``, Lightning's, the Trainer's ``checkpoint-N`` with its own files). A
    directory cannot be replaced in one rename, so an earlier ``final`` is first renamed aside, the new one renamed
    in, and the old one deleted; a crash between any two steps leaves either checkpoint complete under ``final``
    or the old one aside, which ``recover`` puts back."""
    recover(final.parent)
    aside = final.parent / f"{REPLACED}{final.name}"
    if final.exists():
        os.replace(final, aside)
    os.replace(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)


def write_checkpoint(pmodel, optimizer, final: str | Path, *, step: int, extra: dict | None = None,
                     files: dict[str, Any] | None = None, assets: dict[str, Any] | None = None,
                     before_commit=None, asynchronous: bool = False, after_commit=None):
    """Write a sharded checkpoint at exactly ``final`` (complete, or not there at all). ``files`` are more
    objects to store beside it (name -> tensors/containers/numbers), read back with ``torch.load(weights_only)``
    by ``read_file``. ``before_commit(directory)`` runs on every rank once the state is captured, to add a front
    end's own files (Trainer's state, scheduler, RNG), before the directory is committed (``commit``);
    ``after_commit(final)`` runs on every rank after it.

    ``asynchronous``: the tensors are copied to host memory now and written by a background thread (DCP's
    ``async_save``) while training goes on; the call returns a ``PendingCheckpoint`` and the checkpoint appears
    at ``final`` only when every rank's write has finished and ``PendingCheckpoint.poll()`` or ``.wait()``
    commits it, through the same commit as a blocking save. Returns ``final`` otherwise."""
    rank = dist.get_rank()
    final = Path(final)
    directory = final.parent
    tmp = directory / f".tmp-{final.name}"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        (tmp / "rank_local").mkdir()
    dist.barrier()
    plugin_tensors, plugin_values, rank_local, left_out = _plugin_state(pmodel)
    model_state = {k: v for k, v in _model_state(pmodel).items() if k not in left_out}
    optim_tensors, groups = _optimizer_state(pmodel, optimizer) if optimizer is not None else ({}, [])
    tensors = _dcp_view({"model": model_state, "optim": optim_tensors, "plugins": plugin_tensors}, pmodel.pm)
    from .checksums import HashingWriter, digests_of, gather_digests, record

    writer = HashingWriter(tmp)  # hashes this rank's shards as they are written (in the background thread if async)
    writing = None
    if asynchronous:
        # the background thread's collectives (DCP's save plan) get a process group of their own: on the training
        # group they would interleave with the step's collectives in a different order on each rank
        writing = dcp.async_save(tensors, storage_writer=writer, process_group=_background_group())
    else:
        dcp.save(tensors, storage_writer=writer)
    torch.save(rank_local, _rank_file(tmp, rank))
    own = [_rank_file(tmp, rank)]  # the files this rank writes, hashed by it (its shards: by the writer)
    if rank == 0:
        for name, obj in (files or {}).items():
            torch.save(obj, tmp / name)
            own.append(tmp / name)
        for name, obj in (assets or {}).items():
            obj.save_pretrained(str(tmp / name))
            own.append(tmp / name)
    own_digests = digests_of(tmp, own)
    if before_commit is not None:
        before_commit(tmp)
    meta = {"format": 1, "step": step, "world_size": dist.get_world_size(), "layout": pmodel.config.to_dict(),
            "optimizer": {"class": type(optimizer).__name__ if optimizer else None, "param_groups": groups},
            "extra": extra or {}, "plugins": plugin_values,
            "model_config": json.loads(pmodel.modules[0].config.to_json_string(use_diff=False))}

    def finish() -> Path:
        claimed = gather_digests({**own_digests, **writer.digests})  # every rank's files are written by now
        if rank == 0:
            meta["files"] = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*"))
                             if p.is_file()}
            meta["checksums"] = record(tmp, claimed, meta["files"])
            (tmp / META).write_text(json.dumps(meta, indent=1))
        dist.barrier()
        if rank == 0:
            commit(tmp, final)
        dist.barrier()
        if after_commit is not None:
            after_commit(final)
        return final

    if writing is None:
        return finish()
    return PendingCheckpoint(final, getattr(writing, "upload_completion", writing), finish, pmodel.device)


class PendingCheckpoint:
    """A checkpoint being written in the background (``write_checkpoint(asynchronous=True)``). Every rank calls
    ``poll()`` at the same points (after each step): once every rank's write has finished it commits the
    checkpoint and returns True. ``wait()`` blocks until then (before the next save, and at the end)."""

    def __init__(self, final: Path, future, finish, device: torch.device):
        self.final = final
        self._device = device
        self._future = future
        self._finish = finish
        self.committed = False

    def poll(self) -> bool:
        """Commit if every rank's write is done (one small all-reduce on the training group, where the ranks
        call it in step; the background group is the writer's); True once committed."""
        if self.committed:
            return True
        done = torch.tensor([1 if self._future.done() else 0], device=self._device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if int(done):
            self.wait()
        return self.committed

    def wait(self) -> Path:
        if not self.committed:
            self._future.result()  # a failed write raises here, and the directory stays uncommitted
            self._finish()
            self.committed = True
        return self.final


_BACKGROUND: dict = {}


def _background_group():
    """A gloo process group over every rank for checkpoint writes in the background (made once, by every rank at
    its first asynchronous save: making a group is itself collective)."""
    world = dist.group.WORLD
    if world not in _BACKGROUND:
        _BACKGROUND[world] = dist.new_group(backend="gloo")
    return _BACKGROUND[world]


def read_file(path: str | Path, name: str) -> Any:
    """An object stored with ``write_checkpoint(files=...)``; never unpickles anything but tensors and
    containers of them."""
    try:
        return torch.load(Path(path) / name, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint '{path}': '{name}' could not be read safely ({exc})".splitlines()[0]
                              ) from exc


def read_meta(path: str | Path, check_files: bool = True) -> dict:
    """A checkpoint's ``ultrascale.json``, refused in one line when it is missing or malformed; with
    ``check_files``, every file it lists is checked to be there at the size written (a stat each: cheap; contents
    are verified by ``load_checkpoint`` and ``export``, see ``checksums``)."""
    path = Path(path)
    recover(path.parent)
    meta_file = path / META
    if not path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' does not exist. Fix: pass a step-XXXXXXXX directory")
    if not meta_file.is_file():
        if (path / "config.json").is_file():
            raise CheckpointError(f"'{path}' is a Hugging Face model directory, not a sharded checkpoint. Fix: start "
                                  f"from it with --init-from {path}; export and resume take a step-XXXXXXXX "
                                  "directory that `ultrascale train` saved")
        raise CheckpointError(f"checkpoint '{path}' is incomplete (no {META}: the save did not finish). Fix: "
                              "resume from an earlier checkpoint")
    meta = _parse_meta(path, meta_file)
    if check_files:
        from .checksums import problem_with

        for name in meta.get("files", {}):
            problem = problem_with(path, meta, name, None)
            if problem:
                raise CheckpointError(problem)
    return meta


def _parse_meta(path: Path, meta_file: Path) -> dict:
    """``ultrascale.json`` as this package writes it (the entries a load relies on, of the right types)."""
    fix = f"Fix: restore {META} from a copy, or use another checkpoint"
    try:
        meta = json.loads(meta_file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"checkpoint '{path}': {META} is not valid JSON ({str(exc).splitlines()[0][:160]}). "
                              f"{fix}") from None
    wrong = _malformed(meta)
    if wrong:
        raise CheckpointError(f"checkpoint '{path}': {META} is malformed ({wrong}). {fix}")
    return meta


def _malformed(meta) -> str | None:
    """What in a parsed ``ultrascale.json`` is not as written, or None."""
    if not isinstance(meta, dict):
        return f"a JSON {type(meta).__name__}, not an object"
    for key in ("step", "world_size"):
        if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool):
            return f"'{key}' is {meta.get(key)!r}, not an integer"
    for key in ("extra", "optimizer", "files"):
        if key in meta and not isinstance(meta[key], dict):
            return f"'{key}' is {type(meta[key]).__name__}, not an object"
    if not isinstance(meta.get("optimizer", {}).get("param_groups", []), list):
        return "'optimizer.param_groups' is not a list"
    if not all(isinstance(k, str) and isinstance(v, int) for k, v in meta.get("files", {}).items()):
        return "'files' maps names to something other than sizes"
    checksums = meta.get("checksums")
    if checksums is not None and not (isinstance(checksums, dict) and isinstance(checksums.get("files"), dict)
                                      and all(isinstance(v, str) for v in checksums["files"].values())):
        return "'checksums' is not an algorithm with a digest per file"
    return None


def saved_model_config(meta: dict, path: str | Path = ""):
    """The transformers config a checkpoint was saved with (``meta``: its ``read_meta``)."""
    from transformers import AutoConfig

    if "model_config" not in meta:
        raise CheckpointError(f"checkpoint '{path}' carries no model config. Fix: save it with this version of "
                              "ultrascale-plugins")
    cfg_dict = dict(meta["model_config"])
    return AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)


def _verify_before_loading(path: Path, meta: dict, device: torch.device) -> None:
    """Every file of the checkpoint at its size and (when recorded, unless skipped) its checksum, before anything is
    read: each rank its share, then all agree, so every rank refuses alike, naming the file (``checksums``)."""
    from .checksums import agree, say_once, share, unverified_note, verify

    say_once(unverified_note(path, meta))
    mine = share(meta.get("files", {}), dist.get_rank(), dist.get_world_size())
    problem = agree(verify(path, meta, mine), device)
    if problem:
        raise CheckpointError(problem)


def _first_failure(exc: BaseException) -> BaseException:
    """The error behind DCP's ``CheckpointException`` (which lists every failing rank's traceback): the first
    rank's."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return exc


def load_checkpoint(pmodel, optimizer, path: str | Path | None = None, *, directory: str | Path | None = None
                    ) -> dict:
    """Restore model, optimizer (and RNG when the world size is unchanged) in the current layout, whatever the
    layout it was saved in. ``path`` is a checkpoint, or ``directory`` holds them (the newest is used).
    Returns the checkpoint's metadata (``step``, ``extra``, ...)."""
    if path is None:
        found = list_checkpoints(directory) if directory is not None else []
        if not found:
            raise CheckpointError(f"no complete checkpoint in '{directory}'. Fix: pass a checkpoint path")
        path = found[-1]
    path = Path(path)
    meta = read_meta(path, check_files=False)  # the files: each rank checks its share, below
    _verify_before_loading(path, meta, pmodel.device)
    SafeReader(str(path)).read_metadata()  # a forged .metadata is refused here, with its own message
    try:  # this layout's tensors, filled in place by the load; a plugin may refuse the checkpoint here
        plugin_tensors, _, _, left_out = _plugin_state(pmodel, loading=meta)
    except CheckpointError:
        raise
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint '{path}': {exc}") from None
    model_state = {k: v for k, v in _model_state(pmodel).items() if k not in left_out}
    state: dict[str, Any] = {"model": model_state, "plugins": plugin_tensors}
    if optimizer is not None:
        _init_optimizer_state(optimizer)
        state["optim"], _ = _optimizer_state(pmodel, optimizer)
    try:
        # in place: the views write into ``state``
        dcp.load(_dcp_view(state, pmodel.pm), storage_reader=SafeReader(str(path)))
    except (Exception, CheckpointException) as exc:  # DCP reports the failing rank's error; say which checkpoint
        raise CheckpointError(f"checkpoint '{path}' could not be read: {_first_failure(exc)}".splitlines()[0]
                              ) from exc
    for part in pmodel.modules:
        own = set(get_model_state_dict(part))
        set_model_state_dict(part, {k: v for k, v in model_state.items() if k in own},
                             options=StateDictOptions(strict=not left_out))  # what is left out stays as built
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, meta["optimizer"]["param_groups"]):
            group.update(saved)
    rank_local, rank_file = {}, _rank_file(path, dist.get_rank())
    if meta["world_size"] == dist.get_world_size() and rank_file.is_file():
        rank_local = read_file(path, str(rank_file.relative_to(path)))
    state = PluginState({**plugin_tensors, **meta.get("plugins", {})}, rank_local)
    pmodel.pm.hook.ultrascale_state_load(pmodel=pmodel, state=state)
    return meta
