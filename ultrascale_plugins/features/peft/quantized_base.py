"""A quantized frozen base (QLoRA): the LoRA-wrapped linear layers of a PEFT model keep their frozen weight as
torchao's 4-bit ``NF4Tensor`` (``pip install torchao``, imported only when used), while the adapters train in
their own precision.

``quantize_base(peft_model, "nf4")`` replaces, in place, the ``weight`` of every LoRA layer's ``base_layer``
(an ``nn.Linear``) with a frozen ``nn.Parameter`` holding ``to_nf4(weight)``: the same module, the same parameter
name, so plans, state dicts and PEFT's adapter files are unchanged. ``nn.Linear`` then computes through torchao's
``F.linear`` override (``linear_nf4``: the weight is dequantized to the input's dtype for the matmul and for the
input gradient; it never gets a gradient). Call it after ``get_peft_model`` and before ``parallelize``, on every
rank, on the same base weights.

How it composes with the layouts:

- ZeRO-3 / ZeRO-2 / HSDP (FSDP2 ``fully_shard``): torchao implements FSDP2's extension points on ``NF4Tensor``
  (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), so each rank keeps its dim-0 shard of the packed 4-bit data
  and of the block scales, and the all-gather moves the 4-bit bytes; the gathered weight is the unsharded one, bit
  for bit. A shard must hold whole scale blocks: checked before any process group (``dp_shard`` must divide the
  weight's rows and its number of ``scaler_block_size`` blocks).
- DDP (ZeRO-1, plain data parallel): DDP broadcasts rank 0's parameters when it wraps the model, and writing a
  broadcast float tensor into an ``NF4Tensor`` re-quantizes it (torchao's ``copy_``): a different base. The NF4
  weights are therefore registered as DDP's ignored parameters (frozen, never reduced); every rank already holds
  the same ones.
- Gradient clipping sees only the adapters' gradients; ``save_pretrained`` writes only the adapters. The sharded
  checkpoints of a PEFT model leave the frozen base out and fingerprint it (``peft_checkpoints``), whose sums do
  not read an ``NF4Tensor`` yet (see docs/peft.md, "Quantized base (QLoRA)").

Refused before any process group (``ultrascale_validate_model``): tensor parallel (NF4Tensor splits only along
dim 0), pipeline parallel (the stage copy cannot rebuild an NF4Tensor), float8 (Float8Linear cannot read it), DoRA
(PEFT's DoRA calls ``weight.dequantize()``), and FSDP shards that would split a scale block.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from ...interface.facts import layout_facts
from ...interface.extras import install_command
from ...interface.fields import ConfigError, field_error
from ...interface.hookspecs import hookimpl
from .adapters import is_peft_model

SCHEMES = ("nf4",)
# where torchao keeps NF4Tensor: its current module, then the older torchao.dtypes.nf4tensor
_NF4_MODULES = ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor")


def _torchao_nf4():
    """torchao's ``(NF4Tensor, to_nf4)``, imported on first use."""
    import importlib

    errors = []
    for name in _NF4_MODULES:
        try:
            module = importlib.import_module(name)
            return module.NF4Tensor, module.to_nf4
        except (ImportError, AttributeError) as exc:
            errors.append(f"{name}: {exc}")
    raise ConfigError(f"quantize_base(..., 'nf4') needs torchao's NF4Tensor, which could not be imported "
                      f"({'; '.join(errors)}). Fix: {install_command('float8')}")


def nf4_class():
    """``NF4Tensor`` if torchao's NF4 module is already imported, else None (then no model holds one)."""
    for name in _NF4_MODULES:
        cls = getattr(sys.modules.get(name), "NF4Tensor", None)
        if cls is not None:
            return cls
    return None


def quantized_weights(model: nn.Module) -> dict[str, object]:
    """``{parameter name: NF4Tensor}`` of ``model`` (empty when none)."""
    cls = nf4_class()
    if cls is None:
        return {}
    return {name: p for name, p in model.named_parameters() if isinstance(p, cls)}


def _lora_linears(model: nn.Module):
    """``(name, LoRA layer, its nn.Linear base layer)`` for every LoRA-wrapped linear layer."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            if type(base) is nn.Linear:
                yield name, module, base


def _uses_dora(layer) -> bool:
    return any(bool(v) for v in getattr(layer, "use_dora", {}).values())


def quantize_base(model: nn.Module, scheme: str = "nf4", *, block_size: int = 64,
                  scaler_block_size: int = 256) -> nn.Module:
    """Quantize the frozen weight of every LoRA-wrapped ``nn.Linear`` of the PEFT model ``model`` to ``scheme``
    (``"nf4"``: torchao's NF4Tensor, QLoRA's 4-bit NormalFloat with double-quantized block scales: ``block_size``
    weights per absmax scale, ``scaler_block_size`` scales per int8 re-quantization block). In place; returns
    ``model``. Parameter names do not change; biases, embeddings, norms, the head and the adapters keep their
    dtype. Idempotent: a weight already quantized is left as it is.

    On the meta device (a model built without storage, as the command line builds one) it records the quantization
    only: ``parallelize`` gives each weight its value (read from ``init_from``, or drawn from the seed) whole, one
    at a time, quantizes it whole and keeps this rank's part (``requantized``), so every rank's shard is the
    shard of the whole weight's quantization, the same in every layout, and no rank holds the whole base."""
    from torch.nn.parallel import DistributedDataParallel

    if scheme not in SCHEMES:
        raise ConfigError(f"quantize_base: scheme={scheme!r} is not available. Fix: use one of {list(SCHEMES)}")
    if not is_peft_model(model):
        raise TypeError(f"quantize_base expects a PEFT model (peft.get_peft_model(base, LoraConfig(...))), got "
                        f"{type(model).__name__}: only a frozen base under trained adapters may be quantized")
    for size, what in ((block_size, "block_size"), (scaler_block_size, "scaler_block_size")):
        if not isinstance(size, int) or size < 2 or size % 2:
            raise ConfigError(f"quantize_base: {what}={size!r} must be an even positive integer. Fix: use the "
                              "QLoRA defaults block_size=64, scaler_block_size=256")
    layers = list(_lora_linears(model))
    if not layers:
        raise ConfigError("quantize_base: the PEFT model has no LoRA-wrapped nn.Linear layer to quantize. Fix: "
                          "target linear layers (LoraConfig(target_modules='all-linear'))")
    dora = [name for name, layer, _ in layers if _uses_dora(layer)]
    if dora:
        raise ConfigError(f"quantize_base: DoRA (use_dora=True, e.g. {dora[0]}) with a quantized base is not "
                          "supported: PEFT's DoRA computes the base weight's norm through weight.dequantize(), "
                          "which torchao's NF4Tensor does not provide. Fix: LoraConfig(use_dora=False)")
    NF4Tensor, to_nf4 = _torchao_nf4()
    todo = []
    for name, _, base in layers:
        weight = base.weight
        if isinstance(weight, NF4Tensor):
            continue
        if weight.requires_grad:
            raise ConfigError(f"quantize_base: {name}.base_layer.weight trains (requires_grad=True); only a frozen "
                              "base may be quantized. Fix: leave the base frozen, as get_peft_model does")
        if weight.dim() != 2 or weight.numel() % (block_size * scaler_block_size):
            raise ConfigError(f"quantize_base: {name}.base_layer.weight {tuple(weight.shape)} ({weight.numel()} "
                              f"values) is not a whole number of block_size x scaler_block_size = {block_size} x "
                              f"{scaler_block_size} blocks. Fix: pass smaller block sizes that divide it")
        todo.append((name, base))
    shapes: dict = {}  # on the meta device: one quantization per shape (torchao's runs its whole loop on meta)
    with torch.no_grad():
        for _, base in todo:
            weight = base.weight.detach()
            if weight.is_meta:
                key = (tuple(weight.shape), weight.dtype)
                if key not in shapes:
                    shapes[key] = to_nf4(weight.contiguous(), block_size, scaler_block_size)
                quantized = torch.empty_like(shapes[key])
            else:
                quantized = to_nf4(weight.contiguous(), block_size, scaler_block_size)
            base.weight = nn.Parameter(quantized, requires_grad=False)
    # DDP's broadcast of rank 0's parameters would re-quantize them (NF4Tensor.copy_ from a float tensor)
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, sorted(ignored | set(quantized_weights(model))))
    return model


def requantized(local, full):
    """``full`` (a parameter's whole value, a plain tensor) in the form of ``local`` (this rank's part of it): an
    ``NF4Tensor`` ``local`` gets ``full`` quantized whole with its block sizes, else ``full`` as it is. Quantizing
    the whole weight, not a part of it, keeps the scales' mean (double quantization's offset) the whole weight's."""
    cls = nf4_class()
    if cls is None or not isinstance(local, cls):
        return full
    _, to_nf4 = _torchao_nf4()
    return to_nf4(full.to(local.dtype).contiguous(), local.block_size, local.scaler_block_size)


# an NF4Tensor's inner tensors that FSDP2 shards along dim 0 (torchao's split: whole scale blocks per shard); the
# others (the scales' mean, the code book) are whole on every rank
_SHARDED_INNER = ("quantized_data", "quantized_scalers", "quantization_factor")


def gathered(tensor):
    """The whole value of a parameter held as a DTensor (``full_tensor()``); for an ``NF4Tensor`` shard, the whole
    ``NF4Tensor``, its sharded inner tensors gathered here with one blocking all-gather each over the mesh
    dimension that shards it. Written by hand because torchao's own path (DTensor's all-gather dispatched to
    ``NF4Tensor``) issues them as asynchronous functional collectives and leaves its block count the shard's; over
    gloo it corrupted the heap in about one 2-process launch in four (tests/qlora_worker.py; torch 2.13, torchao
    0.18)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return tensor
    local = tensor.to_local()
    cls = nf4_class()
    if cls is None or not isinstance(local, cls):
        return tensor.full_tensor()
    dims = [i for i, p in enumerate(tensor.placements) if p.is_shard()]
    if len(dims) > 1 or (dims and tensor.placements[dims[0]] != Shard(0)):
        raise ConfigError(f"an NF4 weight placed as {tensor.placements} cannot be gathered: only FSDP's dim-0 "
                          "shards of whole scale blocks are (quantize_base's layouts)")
    if not dims:
        return local
    group = tensor.device_mesh.get_group(dims[0])
    n = dist.get_world_size(group)
    whole = {}
    for name in _SHARDED_INNER:
        part = getattr(local, name).contiguous()
        whole[name] = part.new_empty((n * part.shape[0], *part.shape[1:]))
        dist.all_gather_into_tensor(whole[name], part, group=group)
    size = torch.Size((local.shape[0] * n, *local.shape[1:]))
    whole.update(size=size, stride=torch.empty(size, device="meta").stride(), n_blocks=local.n_blocks * n)
    return cls(*sys.modules[cls.__module__].construct_nf4_args(local, whole))


def quantized_bytes(model_or_params) -> int:
    """Bytes this rank holds for its NF4 weights (their local shards under FSDP2): packed 4-bit data, int8 block
    scales, the scales' factors and mean, and the 16-entry code book."""
    from torch.distributed.tensor import DTensor

    params = (model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params)
    cls = nf4_class()
    total = 0
    for p in params:
        local = p.to_local() if isinstance(p, DTensor) else p
        if cls is not None and isinstance(local, cls):
            names, _ = local.__tensor_flatten__()
            total += sum(getattr(local, n).numel() * getattr(local, n).element_size() for n in names)
    return total


@hookimpl
def ultrascale_validate_model(model, plan, config):
    weights = quantized_weights(model)
    if not weights:
        return
    what = "a quantized (NF4) base"
    facts = layout_facts(config)
    if facts.degree("tp") > 1:
        # row-wise layers shard the weight's dim 1: aten.split(NF4Tensor, dim=1) raises NotImplementedError
        raise field_error("tp", facts.degree("tp"), f"{what} under tp > 1 is not supported (torchao's NF4Tensor splits only "
                          "along its rows, and row-wise layers shard the columns)", "use tp: 1 with data parallel "
                          "(ZeRO-1/2/3, HSDP, DDP) or context parallel")
    if facts.degree("pp") > 1:
        # the stage copy rebuilds each parameter as type(param)(...): NF4Tensor.__new__ takes its blocks
        raise field_error("pp", facts.degree("pp"), f"{what} under pp > 1 is not supported (the pipeline's stage copy cannot "
                          "rebuild an NF4Tensor)", "use pp: 1 with data parallel (ZeRO-1/2/3, HSDP, DDP) or context "
                          "parallel")
    if facts.float8 != "none":
        raise field_error("float8", facts.float8, f"float8 would swap the linear layers of {what} for torchao's "
                          "Float8Linear, which cannot read an NF4 weight", "use float8: none")
    dora = [name for name, layer, _ in _lora_linears(model) if _uses_dora(layer)
            and name + ".base_layer.weight" in weights]
    if dora:
        raise ConfigError(f"{dora[0]}: DoRA with {what} is not supported (PEFT's DoRA dequantizes the base with "
                          "weight.dequantize(), which NF4Tensor does not provide). Fix: use_dora=False")
    shards = facts.fsdp_shards
    if shards > 1:
        for name, w in weights.items():
            scale_blocks = w.quantization_factor.numel()
            if w.shape[0] % shards or scale_blocks % shards:
                raise field_error("dp_shard", shards, f"FSDP2 would split {name} {tuple(w.shape)} into "
                                  f"{shards} row shards, and its {scale_blocks} NF4 scale blocks of "
                                  f"{w.block_size * w.scaler_block_size} values do not divide evenly (a shard must "
                                  "hold whole blocks)", "use a dp_shard that divides both, zero_stage: 1 or 0 "
                                  "(DDP keeps the whole base on every rank), or quantize_base with a smaller "
                                  "scaler_block_size")
