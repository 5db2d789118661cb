"""float8 training through torchao (the optional extra ``float8``: ``pip install ".[float8]"`` in a clone).

``float8: tensorwise`` or ``rowwise`` (torchao's ``Float8LinearConfig.from_recipe_name`` recipes) swaps the decoder
layers' ``nn.Linear`` modules for torchao's ``Float8Linear``: their three matmuls (output, input gradient, weight
gradient) cast both operands to float8 with dynamic scales and run ``torch._scaled_mm``. Weights, gradients and
optimizer states keep their own precision (fp32, or bf16 compute under ``mixed_precision: bf16``), so a checkpoint
is the same with float8 on or off.

The swap keeps every parameter object and name (``Float8Linear.from_float`` reuses them), so it runs on a
meta-device model and the engine's materialization by name still finds them; it runs first inside each part of
the model (a pipeline stage, or the whole), before FSDP/DDP and activation checkpointing wrap what it made.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
from torch import nn

from ...interface.extras import install_command
from ...interface.facts import layout_facts
from ...interface.fields import field_error
from ...interface.hookspecs import hookimpl
from ...interface.stages import Stage
from ...models.plan import layers_present

RECIPES = ("none", "tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer: the first GPUs with float8 tensor cores (cuBLAS float8 matmul)


@hookimpl
def ultrascale_declare_fields(fields):
    fields.add("float8", str, "none", "float8 matmuls in the decoder layers' Linear modules through torchao "
               "(the float8 extra: torchao): tensorwise (one scale per tensor) or rowwise (one "
               "per row: more accurate); weights and optimizer states keep their precision; needs a GPU "
               "of compute capability 8.9+ or a CPU torch that runs float8 matmuls", choices=RECIPES,
               dry_run="float8's scaled matmuls have not been checked against a real step on fake tensors")
    # the facts this plugin decides for the others (answered in ultrascale_declare_facts), with their defaults
    fields.fact("float8", "none", "the float8 recipe the linear layers run (none: they do not)")


@hookimpl
def ultrascale_declare_facts(config, degrees):
    return {"float8": config.float8}


def _import_torchao():
    """torchao's float8 module. Its import logs a warning for each of its compiled kernels that does not load on
    this machine (CUDA-only kernels on a CPU build) and torch logs a deprecation of how torchao registers its enums;
    the float8 training path uses none of them and users cannot act on either, so both are silenced while it
    imports (once per process)."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
    return float8


def _cuda_in_use() -> bool:
    # launch.device_for_rank's choice, without its side effect (it sets the current CUDA device)
    return torch.cuda.is_available() and os.environ.get("ULTRASCALE_DEVICE", "") != "cpu"


@functools.cache
def _cpu_float8_problem(recipe: str) -> str | None:
    """Why this torch cannot run ``recipe``'s float8 matmuls on the CPU, or None: each operand pair of the recipe
    (tensorwise: e4m3 x e4m3 forward, e5m2 gradients in backward; rowwise: e4m3 with per-row scales) through
    ``torch._scaled_mm`` on a tiny input, the result checked."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    pairs = ((e4, e4), (e5, e4), (e4, e5)) if recipe == "tensorwise" else ((e4, e4),)
    for a_dtype, b_dtype in pairs:
        a = torch.ones(16, 32).to(a_dtype)
        b = torch.ones(16, 32).to(b_dtype).t()  # _scaled_mm wants its second operand column-major
        if recipe == "rowwise":
            scale_a, scale_b = torch.ones(16, 1), torch.ones(1, 16)
        else:
            scale_a = scale_b = torch.tensor(1.0)
        try:
            out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"torch {torch.__version__} runs no {recipe} float8 matmul on the CPU ({first})"
        if not torch.equal(out.float(), torch.full((16, 16), 32.0)):
            return f"torch {torch.__version__}'s CPU float8 matmul gives wrong results"
    return None


@hookimpl
def ultrascale_validate_config(config, model_config, world_size):
    recipe = config.float8
    if recipe == "none":
        return
    try:
        _import_torchao()
    except ImportError:
        raise field_error("float8", recipe, "torchao is not installed",
                          f"{install_command('float8')}, or float8: none") from None
    if layout_facts(config).degree("tp") > 1:
        # torchao converts TP shards with its own Float8ColwiseParallel / Float8RowwiseParallel styles (the cast and
        # its amax reduction have to happen on the whole activation); this package's TP plans use torch's styles
        raise field_error("float8", recipe, f"float8 with tensor parallel (tp={layout_facts(config).degree('tp')}) is not supported: "
                          "torchao's float8 needs its own tensor-parallel styles", "use tp: 1 (FSDP, pipeline and "
                          "context parallel work with float8), or float8: none")
    if _cuda_in_use():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < MIN_CAPABILITY:
            raise field_error("float8", recipe, f"this GPU ({torch.cuda.get_device_name()}, compute capability "
                              f"{major}.{minor}) has no float8 matmul: it needs compute capability "
                              f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell)",
                              "use float8: none (mixed_precision: bf16 is the fast path on this GPU)")
        return
    problem = _cpu_float8_problem(recipe)
    if problem:
        raise field_error("float8", recipe, problem, "use float8: none, or a torch build whose torch._scaled_mm "
                          "runs float8 on the CPU")


def convertible(module: nn.Module, fqn: str = "") -> bool:
    """A Linear torchao converts: both its dimensions multiples of 16. ``torch._scaled_mm`` requires every matrix
    dimension to be a multiple of 16 (cuBLAS's float8 kernels), and a Linear's features are the contracted
    dimension of one of its matmuls each: in_features in the forward, out_features in the input gradient's. Others
    stay in high precision (torchao's own automatic filter skips them too)."""
    return (isinstance(module, nn.Linear) and module.in_features % 16 == 0
            and module.out_features % 16 == 0)


@hookimpl
def ultrascale_validate_model(model, plan, config):
    """A layout asking for float8 on a model where it would change nothing (no Linear of the right shape in its
    decoder layers, e.g. GPT-2's Conv1D projections) is refused rather than silently run in high precision."""
    if config.float8 == "none":
        return
    if not any(convertible(m) for fqn in layers_present(model, plan) for m in model.get_submodule(fqn).modules()):
        raise field_error("float8", config.float8, f"{type(model).__name__}'s decoder layers have no nn.Linear "
                          "whose in and out features are multiples of 16, so nothing would run in float8",
                          "use float8: none")


@hookimpl
def ultrascale_transform_stages(config, model_config):
    return [Stage("float8", convert_layers, after=("split",), active=config.float8 != "none",
                  does=f"every convertible Linear of the decoder layers to float8 training ({config.float8})")]


def convert_layers(model, ctx):
    """First inside each model part: tensor parallel would be next (refused with float8), then activation
    checkpointing and FSDP/DDP wrap the converted modules."""
    recipe = ctx.config.float8
    if recipe == "none":
        return
    float8 = _import_torchao()
    # Only the decoder layers convert: the output head stays in high precision, as in torchtitan (its logits feed
    # the loss directly), and so do the embeddings and anything else outside the layers.
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    for fqn in ctx.plan_layers(model):
        # in place: children are swapped on their parents, the layer module itself is kept
        float8.convert_to_float8_training(model.get_submodule(fqn), module_filter_fn=convertible, config=config)
