"""Initialize a model built on the meta device shard by shard, with the model's own initialization scheme, so no
rank ever holds the whole model and the same seed gives the same weights in every layout.

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    pmodel = parallelize(model, ParallelConfig(tp=2), init_weights=ModelInit(model))

``ModelInit`` has ``PretrainedWeights``'s interface (``load(ctx, buffers)``): the engine calls it once the layout is
final. Every rank then gives its (sharded) parameters storage and, one *unit* at a time — a module of the
unparallelized model with parameters of its own (an embedding, a projection, a norm) — draws that module's
parameters whole on the CPU, runs the model's ``_init_weights`` on them, copies out only its own shard and frees the
rest. The draws come from the CPU generator seeded with (seed, the unit's name in the unparallelized model), and
they run on a private meta-device twin of the unparallelized model in which only that unit's parameters are real,
so a unit's values depend on nothing but the seed and its name: not on the layout, the ranks, which other units
a rank holds, or the order they come in. Peak host memory is one unit's parameters (the largest is usually the
embedding or the head) plus this rank's shards.

Why by hand: transformers' ``initialize_weights`` walks the whole model, drawing every module from the global RNG
in module order on whole tensors, so it needs the whole model and a module's values depend on every module drawn
before it (a pipeline stage or a shard would get other values). torch has nothing that draws a sharded parameter as
the slice of a seeded whole: DTensor's random ops are layout-consistent only on CUDA-like (Philox) meshes, give
other values than a plain tensor, and do not cover the plain tensors of a pipeline stage; FSDP2 has no init hook.
"""
from __future__ import annotations

import functools
import hashlib

import torch
from torch import nn

from ..interface.meta_copy import meta_copy
from .local_shards import copy_part, give_storage, local_chunk, unwrapped_name
from .meta_build import fill_buffers, init_guard, init_owners, own_init, seeded_cpu_rng


def unit_seed(seed: int, name: str) -> int:
    """The CPU generator seed of one unit: a hash of (seed, the unit's name in the unparallelized model)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class ModelInit:
    """Initial values for a meta-device model's parameters, drawn shard by shard with the model's own
    ``_init_weights``; the same ``seed`` gives the same weights in every layout. ``seed`` defaults to
    ``torch.initial_seed()`` when the object is made (the CLI and ``seed_everything`` seed before building).
    Make it before ``parallelize`` (it keeps a meta-device twin of the unparallelized model).

    A wrapper around a causal LM (a PEFT model) is initialized through the plugins: each of its entries that starts
    from an entry of the plain model (``ModelWrapper.pretrained_name``: a LoRA layer's ``base_layer``, a
    ``modules_to_save`` copy) is seeded by that entry's name in the plain model, so it gets the plain model's
    values for the seed; the entries a plugin introduced (the adapters) are seeded by their own names and drawn by
    that plugin (``ModelWrapper.init_module``); values computed from others (DoRA's magnitude) are set once every
    shard holds its values (``ModelWrapper.init_dependent``)."""

    def __init__(self, model: nn.Module, seed: int | None = None, *, pm=None, wrapper=None):
        self.seed = torch.initial_seed() if seed is None else int(seed)
        self.twin = meta_copy(model)
        # the plugin's description of a wrapper (a PEFT model): the caller's, asked of the model once per load
        # (``load.weights_for``; its answers go by name, the same for the twin), else asked of the twin here,
        # of the registry ``pm`` (one of the two is given)
        if wrapper is None and pm is None:
            raise TypeError("ModelInit(model, seed, pm=registry) or ModelInit(model, seed, wrapper=...): the registry "
                            "says what the model's wrapper is (us.get_plugin_manager() is the process's)")
        self.wrapper = wrapper if wrapper is not None else pm.wrapper_of(self.twin)

    # What follows is read only when values are drawn (``load``, ``fill``, once the layout is final), so it is
    # worked out then, once: making the initializer while the reads are planned asks the twin nothing more.
    @functools.cached_property
    def owners(self) -> dict:
        """{module name: the function the model's own initialization runs for that module} of the twin."""
        return init_owners(self.twin)

    @functools.cached_property
    def _table(self) -> tuple[dict[str, list[str]], dict[int, tuple[str, str]]]:
        """({unit: its parameters' names within it}, {id of a parameter: (its unit, its name there)}): every
        parameter of the unparallelized model is drawn by the module where it first appears, so a tied head takes
        the embedding's values."""
        units: dict[str, list[str]] = {}
        unit_of: dict[int, tuple[str, str]] = {}
        for mname, module in self.twin.named_modules():
            for pname, p in module._parameters.items():
                if p is not None and id(p) not in unit_of:
                    unit_of[id(p)] = (mname, pname)
                    units.setdefault(mname, []).append(pname)
        return units, unit_of

    @property
    def units(self) -> dict[str, list[str]]:
        return self._table[0]

    @functools.cached_property
    def _naming(self) -> tuple[set[str], dict[str, str]]:
        """(the parameters a plugin introduced into a wrapper, which no pretrained file holds; each unit's seed
        name: the plain model's module it starts from when all its parameters do, else its own name)."""
        introduced: set[str] = set()
        seed_names: dict[str, str] = {}
        for unit, pnames in self.units.items():
            plain = [self.wrapper.pretrained_name(_join(unit, p)) for p in pnames]
            introduced.update(_join(unit, p) for p, name in zip(pnames, plain) if name == "")
            owners = {name[:-len(p)].rstrip(".") for p, name in zip(pnames, plain)
                      if name and (name == p or name.endswith("." + p))}
            whole = all(name and (name == p or name.endswith("." + p)) for p, name in zip(pnames, plain))
            seed_names[unit] = owners.pop() if whole and len(owners) == 1 else unit
        return introduced, seed_names

    @property
    def introduced(self) -> set[str]:
        return self._naming[0]

    @property
    def seed_names(self) -> dict[str, str]:
        return self._naming[1]

    def unit_of(self, name: str) -> tuple[str, str]:
        """(unit, parameter within it) drawing the parameter ``name`` of the unparallelized model."""
        try:
            p = self.twin.get_parameter(unwrapped_name(name))
        except AttributeError:
            raise KeyError(f"'{name}' is not a parameter of the model this initializer was made from. Fix: make "
                           "ModelInit(model) from the model passed to parallelize, before parallelizing it") from None
        return self._table[1][id(p)]

    @torch.no_grad()
    def unit_values(self, unit: str) -> dict[str, torch.Tensor]:
        """The initial values of one unit's parameters, whole, on the CPU: the unit's parameters made real in the
        twin, then the model's ``_init_weights`` on the unit and on each of its ancestors (as ``initialize_weights``
        visits them, children first: GPT-2's attention block rescales its ``c_proj`` after the Conv1D's own init),
        or the plugin's own initialization where a plugin introduced the module (``ModelWrapper.init_module``: a LoRA
        layer and its adapters), from the generator seeded for this unit (by its ``seed_names`` entry). Everything
        else in the twin is meta, so those calls touch nothing else and draw nothing else."""
        module = self.twin.get_submodule(unit)
        saved = dict(module._parameters)
        for pname in self.units[unit]:
            p = saved[pname]
            # a parameter held in another form (an NF4 base) is drawn as a plain one: ``fill`` converts it whole
            kind = type(p) if isinstance(p, nn.Parameter) else nn.Parameter
            module._parameters[pname] = kind(torch.empty(p.shape, dtype=p.dtype, device="cpu"), p.requires_grad)
        chain = [unit]
        while chain[-1]:
            chain.append(chain[-1].rpartition(".")[0])
        try:
            with torch.device("cpu"), seeded_cpu_rng(unit_seed(self.seed, self.seed_names[unit])), init_guard():
                for name in chain:
                    sub = self.twin.get_submodule(name)
                    if not self.wrapper.init_module(name, sub):
                        own_init(self.owners.get(name), sub)
            return {pname: module._parameters[pname].detach() for pname in self.units[unit]}
        finally:
            module._parameters.update(saved)

    @torch.no_grad()
    def load(self, ctx, buffers: dict[str, torch.Tensor]) -> None:
        """Give this rank's (sharded) parameters storage and their initial values; restore the buffers computed at
        construction (``to_empty`` leaves them uninitialised); then the values computed from others
        (``ModelWrapper.init_dependent``). The buffers the engine does not hand over (a meta build left them empty)
        are computed on the twin, here, where they are read."""
        fill_buffers(self.twin)
        give_storage(ctx, buffers, dict(self.twin.named_buffers()))
        self.fill(ctx.modules)
        self.wrapper.init_dependent(list(ctx.modules))

    @torch.no_grad()
    def fill(self, modules, only: set[str] | None = None) -> None:
        """Write the initial values of the parameters of ``modules`` (this rank's parts, with storage; only those
        named in ``only``, names of the unparallelized model, when given): each unit this rank holds a parameter
        of is drawn whole, one at a time, and this rank's part of it copied."""
        from torch.distributed.tensor import DTensor

        # this rank's parameters by unit (a parameter shared by two names of one stage is written once)
        targets: dict[str, list[tuple[str, torch.Tensor]]] = {}
        seen: set[int] = set()
        for module in modules:
            for name, p in module.named_parameters(remove_duplicate=False):
                if id(p) in seen or (only is not None and unwrapped_name(name) not in only):
                    continue
                seen.add(id(p))
                unit, pname = self.unit_of(name)
                targets.setdefault(unit, []).append((pname, p))
        for unit in self.units:  # the twin's module order: the same on every rank
            if unit not in targets:
                continue
            values = self.unit_values(unit)
            for pname, p in targets[unit]:
                local = p.to_local() if isinstance(p, DTensor) else p
                full = self.wrapper.held_value(local, values[pname])  # as the model holds it (a quantized base)
                chunk = local_chunk(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full
                if tuple(chunk.shape) != tuple(local.shape):
                    raise RuntimeError(f"{unit}.{pname}: local shard {tuple(local.shape)} but the layout gives "
                                       f"{tuple(chunk.shape)}")
                copy_part(p, local, chunk)
            del values


def _join(module: str, entry: str) -> str:
    return f"{module}.{entry}" if module else entry


def init_introduced(model: nn.Module, seed: int | None = None, *, pm) -> list[str]:
    """Give the parameters a plugin introduced into ``model`` (a PEFT model's adapters) the values the engine gives
    them when the same model is built on the meta device and parallelized with ``seed`` (default
    ``torch.initial_seed()``), then recompute what depends on them and on the base (DoRA's magnitude); returns the
    names set. For a model built in one process from real weights (``get_peft_model`` of a loaded base, whose
    adapters ``get_peft_model`` drew from the global generator): with it, that model starts exactly where
    ``ultrascale train`` (``train.seed``) or ``parallelize`` of the meta-device model start, in any layout."""
    init = ModelInit(model, seed, pm=pm)
    init.fill([model], only=init.introduced)
    with torch.no_grad():
        init.wrapper.init_dependent([model])
    return sorted(init.introduced)
