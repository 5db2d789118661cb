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

import contextlib
import copy
import hashlib

import torch
from torch import nn

from ..interface.meta_copy import meta_copy

# wrapper segments torch inserts into parameter names (checkpoint_wrapper, torch.compile, FSDP1); the engine's own
# transforms keep the unparallelized names, these only matter for a model wrapped before it was parallelized
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def unwrapped_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def unit_seed(seed: int, name: str) -> int:
    """The CPU generator seed of one unit: a hash of (seed, the unit's name in the unparallelized model)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_owners(model: nn.Module) -> dict[str, object]:
    """{module name: the ``PreTrainedModel`` whose ``_init_weights`` initializes it}: the nearest one among the
    module and its ancestors — the dispatch of transformers' ``initialize_weights`` (``smart_apply``), which hands
    a composite model's sub-models to their own ``_init_weights``."""
    from transformers import PreTrainedModel

    owners: dict[str, object] = {}

    def visit(module: nn.Module, prefix: str, owner) -> None:
        if isinstance(module, PreTrainedModel):
            owner = module
        owners[prefix] = owner
        for name, child in module.named_children():
            visit(child, f"{prefix}.{name}" if prefix else name, owner)

    visit(model, "", None)
    return owners


def _init_module(owner, module: nn.Module) -> None:
    """The model's own initialization of one module (``owner._init_weights``; a module outside any Hugging Face
    model gets torch's ``reset_parameters``). Not ``_initialize_weights``: its per-module "already initialized"
    flag must not skip a module whose values are being drawn."""
    if owner is not None:
        owner._init_weights(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


@contextlib.contextmanager
def _seeded_cpu_rng(seed: int):
    """The global CPU generator (which ``torch.nn.init`` and ``transformers.initialization`` draw from) seeded with
    ``seed`` inside the block, its state restored after. CUDA generators are left alone."""
    state = torch.get_rng_state()
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(state)


def _guard():
    """transformers' guard around ``initialize_weights`` (torch's init functions honour ``_is_hf_initialized``)."""
    try:
        from transformers.initialization import guard_torch_init_functions
    except ImportError:  # pragma: no cover - older transformers
        return contextlib.nullcontext()
    return guard_torch_init_functions()


def fill_buffers(model: nn.Module) -> None:
    """Give the buffers a meta-device build left empty (rotary frequencies, embedding scales, ...) CPU storage and
    their values, from the model's own ``_init_weights`` — as transformers' ``from_pretrained`` does after building
    on the meta device (its ``_init_weights`` recomputes such buffers: rotary embeddings keep ``original_inv_freq``
    for it). A buffer no ``_init_weights`` sets is zero. Parameters are not touched."""
    owners = init_owners(model)
    with torch.no_grad(), torch.device("cpu"), _guard(), _seeded_cpu_rng(0):
        for name, module in model.named_modules():
            empty = [k for k, b in module._buffers.items() if b is not None and b.is_meta]
            if not empty:
                continue
            for k in empty:
                b = module._buffers[k]
                module._buffers[k] = torch.zeros(b.shape, dtype=b.dtype, device="cpu")
            target = module
            if any(p is not None and not p.is_meta for p in module._parameters.values()):
                # real parameters next to empty buffers: initialize a view of the module whose parameters are
                # meta (writes to them are no-ops) and whose buffers are the module's own
                target = copy.copy(module)
                target._parameters = {k: (None if p is None else nn.Parameter(p.detach().to("meta"), p.requires_grad))
                                      for k, p in module._parameters.items()}
            _init_module(owners.get(name), target)


def to_empty_tied(module: nn.Module, device, param_device=None) -> None:
    """``module.to_empty(device=device)`` that keeps tied parameters tied: ``to_empty`` replaces a plain
    parameter by a new one in every module that holds it (DTensor parameters are swapped in place, so tied ones
    stay one object). Each group of names that held one parameter is pointed back at a single new one.
    ``param_device``: the parameters' storage there instead (the host, when they are offloaded), the buffers'
    on ``device``."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((m, name))
    module.to_empty(device=param_device or device)
    if param_device is not None and param_device != device:
        for m in module.modules():
            for key, buf in m._buffers.items():
                if buf is not None:
                    m._buffers[key] = torch.empty_like(buf, device=device)
    for refs in holders.values():
        keep = refs[0][0]._parameters[refs[0][1]]
        for m, name in refs[1:]:
            m._parameters[name] = keep


@torch.no_grad()
def give_storage(ctx, buffers: dict[str, torch.Tensor], computed: dict[str, torch.Tensor] | None = None) -> None:
    """Give this rank's model parts (``ctx.modules``, in their final layout) storage — the parameters where the
    layout holds them (``ctx.param_device``, when a context has one), tied ones kept tied — and their buffers the
    values computed at construction: ``buffers`` by name, else ``computed`` by the unparallelized name, else zero
    (``to_empty`` leaves them uninitialised). The first step of every loader (``ModelInit.load``,
    ``pretrained.PretrainedWeights.load``), before any value is read or drawn."""
    for module in ctx.modules:
        to_empty_tied(module, ctx.device, getattr(ctx, "param_device", None))  # a context of the caller's own too
        for name, buf in module.named_buffers():
            source = buffers.get(name)
            if source is None and computed is not None:
                source = computed.get(unwrapped_name(name))
            if source is not None and not source.is_meta:
                buf.copy_(source)
            else:
                buf.zero_()


def copy_part(param: torch.Tensor, local: torch.Tensor, part: torch.Tensor) -> None:
    """``local.copy_(part)``, where ``local`` is this rank's part of ``param`` (its ``to_local()``, or ``param``)
    and may be a tensor subclass of several inner tensors (torchao's NF4Tensor). The inner tensors a meta-device
    build left without storage are taken from ``part``: those every part holds whole, which the layout neither
    shards nor moves (FSDP2 and ``to_empty`` carry NF4's scales' mean and code book over from the meta tensor as
    they are). They are set on the tensor the DTensor holds (``_local_tensor``: ``to_local`` of a parameter
    returns a view of it, a separate object, since torch 2.11)."""
    local.copy_(part)
    flatten = getattr(local, "__tensor_flatten__", None)
    if flatten is None or type(local) in (torch.Tensor, nn.Parameter) or type(part) is not type(local):
        return
    holder = getattr(param, "_local_tensor", param)
    for name in flatten()[0]:
        if getattr(local, name).is_meta:
            value = getattr(part, name).detach().to(local.device, copy=True)
            for tensor in {id(holder): holder, id(local): local}.values():
                setattr(tensor, name, value)


def local_chunk(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's part of ``full`` under ``placements`` over ``mesh``, computed locally (no communication): the
    placements are applied left to right, as ``distribute_tensor(..., src_data_rank=None)`` does, but on the CPU
    tensor, so only the local chunk ever reaches the device."""
    from torch.distributed.tensor import Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover
        _StridedShard = Shard
    coordinate = mesh.get_coordinate()
    out = full
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, (Shard, _StridedShard)):
            pieces, _ = placement._split_tensor(out, mesh.size(mesh_dim), with_padding=False, contiguous=False)
            out = pieces[coordinate[mesh_dim]]
        elif placement.is_partial():
            raise RuntimeError(f"a parameter placed {placements} (partial) cannot be initialized")
    return out


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
        # (``pretrained.weights_for``; its answers go by name, the same for the twin), else asked of the twin here,
        # of the registry ``pm`` (one of the two is given)
        if wrapper is None and pm is None:
            raise TypeError("ModelInit(model, seed, pm=registry) or ModelInit(model, seed, wrapper=...): the registry "
                            "says what the model's wrapper is (us.get_plugin_manager() is the process's)")
        self.wrapper = wrapper if wrapper is not None else pm.wrapper_of(self.twin)
        fill_buffers(self.twin)  # the values of buffers the engine does not hand over (left empty by a meta build)
        self.owners = init_owners(self.twin)
        # every parameter of the unparallelized model -> (the unit that draws it, its name in that unit): the
        # module where it first appears, so a tied head takes the embedding's values
        self.units: dict[str, list[str]] = {}
        self._unit_of: dict[int, tuple[str, str]] = {}
        for mname, module in self.twin.named_modules():
            for pname, p in module._parameters.items():
                if p is not None and id(p) not in self._unit_of:
                    self._unit_of[id(p)] = (mname, pname)
                    self.units.setdefault(mname, []).append(pname)
        # the parameters a plugin introduced into a wrapper (no pretrained file holds them), and each unit's seed name
        self.introduced: set[str] = set()
        self.seed_names: dict[str, str] = {}
        for unit, pnames in self.units.items():
            plain = [self.wrapper.pretrained_name(_join(unit, p)) for p in pnames]
            self.introduced.update(_join(unit, p) for p, name in zip(pnames, plain) if name == "")
            owners = {name[:-len(p)].rstrip(".") for p, name in zip(pnames, plain)
                      if name and (name == p or name.endswith("." + p))}
            whole = all(name and (name == p or name.endswith("." + p)) for p, name in zip(pnames, plain))
            self.seed_names[unit] = owners.pop() if whole and len(owners) == 1 else unit

    def unit_of(self, name: str) -> tuple[str, str]:
        """(unit, parameter within it) drawing the parameter ``name`` of the unparallelized model."""
        try:
            p = self.twin.get_parameter(unwrapped_name(name))
        except AttributeError:
            raise KeyError(f"'{name}' is not a parameter of the model this initializer was made from. Fix: make "
                           "ModelInit(model) from the model passed to parallelize, before parallelizing it") from None
        return self._unit_of[id(p)]

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
            with torch.device("cpu"), _seeded_cpu_rng(unit_seed(self.seed, self.seed_names[unit])), _guard():
                for name in chain:
                    sub = self.twin.get_submodule(name)
                    if not self.wrapper.init_module(name, sub):
                        _init_module(self.owners.get(name), sub)
            return {pname: module._parameters[pname].detach() for pname in self.units[unit]}
        finally:
            module._parameters.update(saved)

    @torch.no_grad()
    def load(self, ctx, buffers: dict[str, torch.Tensor]) -> None:
        """Give this rank's (sharded) parameters storage and their initial values; restore the buffers computed at
        construction (``to_empty`` leaves them uninitialised); then the values computed from others
        (``ModelWrapper.init_dependent``)."""
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
