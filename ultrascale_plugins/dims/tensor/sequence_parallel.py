"""Where the sequence is split under Megatron-style sequence parallel, read from the model's structure.

Between TP regions (``models.plan``) a decoder layer's hidden states are sharded over the sequence. A module
there is right on a shard only if it acts token by token. Norms do, whatever their number and place, and so do
vectors held by the decoder layer itself (per-feature scales of the residual). Any other
module that holds parameters outside the regions — an attention block or MLP the TP plan leaves whole, a Mamba
mixer, a router — may mix tokens, so it becomes a *gathered region*: the outermost module around it, inside its
decoder layer, that holds no TP region; it all-gathers its input over the sequence, runs replicated, and hands
back this rank's shard. Its parameters then see the whole sequence on every rank and need no reduction.

A model the rules cannot cover is refused before any worker starts: a decoder layer that holds matrices
directly, or a module whose only unsharded ancestors are containers. What the module tree cannot show —
a parameter-free op that mixes tokens outside the regions, a region called with something other than the hidden
states — is found by running the model once on the meta device with its sequence split the same way
(``dry_run``): it must run, every region must receive and return hidden states of the split length, and every
gathered region must be called.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from ...models.plan import _natural


def _is_norm(module: nn.Module) -> bool:
    return bool(re.search(r"norm", type(module).__name__, re.I))


def _per_feature(layer: nn.Module) -> bool:
    """A decoder layer's own parameters that are vectors or scalars (Doge's residual scales, Dory's lambdas)
    scale features, the same for every token, like a norm's weight."""
    return all(p.dim() <= 1 for p in layer.parameters(recurse=False))


def _within(fqn: str, roots) -> bool:
    return any(fqn == r or fqn.startswith(r + ".") for r in roots)


def sequence_shard_modules(model: nn.Module, plan) -> list[tuple[str, nn.Module]]:
    """Modules with parameters that see sequence shards under SP: inside decoder layers, outside regions and
    plan entries."""
    inside = set(plan.regions) | set(plan.matches(model))
    return [(fqn, m) for fqn, m in model.named_modules()
            if any(True for _ in m.parameters(recurse=False))
            and not _within(fqn, inside) and _within(fqn, plan.layers)]


def gathered_regions(model: nn.Module, plan) -> tuple[list[str], list[str]]:
    """(gathered regions, modules no gathered region can cover)."""
    inside = set(plan.regions) | set(plan.matches(model))
    found: set[str] = set()
    stuck: list[str] = []
    for fqn, module in sequence_shard_modules(model, plan):
        layer = next(layer for layer in plan.layers if _within(fqn, [layer]))
        if _is_norm(module) or (fqn == layer and _per_feature(module)):
            continue
        chosen = None
        if fqn != layer:
            parts = fqn[len(layer) + 1:].split(".")
            for i in range(1, len(parts) + 1):
                candidate = f"{layer}.{'.'.join(parts[:i])}"
                if isinstance(model.get_submodule(candidate), (nn.ModuleList, nn.ModuleDict)):
                    continue  # containers are never called: hooks on them would not run
                if not any(x == candidate or x.startswith(candidate + ".") for x in inside):
                    chosen = candidate
                    break
        if chosen is None:
            stuck.append(fqn)
        else:
            found.add(chosen)
    regions = sorted((g for g in found if not any(g.startswith(h + ".") for h in found)), key=_natural)
    return regions, stuck


def summed_shard_modules(model: nn.Module, plan, gathered) -> list[tuple[str, nn.Module]]:
    """The modules that run on sequence shards with parameters (norms, per-feature scales): their gradients are
    summed over TP."""
    return [(fqn, m) for fqn, m in sequence_shard_modules(model, plan) if not _within(fqn, gathered)]


def dry_run(model: nn.Module, plan, gathered, tp: int) -> None:
    """Run a meta-device twin of ``model`` with its sequence split as SP splits it: the first decoder layer
    takes a 1/tp slice, every region (TP or gathered) checks and 'gathers' its input (repeats it to the full
    length) and slices its output, the last layer 'gathers'. Raises what the model raises, or ValueError when a
    region is handed something that is not the split hidden states."""
    from ...models.dataflow import meta_inputs, meta_twin

    twin = meta_twin(model)
    local = 7  # a length no hidden size or head count is likely to share
    full = local * tp

    def first_input(args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            return args[0]
        return kwargs.get("hidden_states")

    def replace_first(args, kwargs, x):
        if args and isinstance(args[0], torch.Tensor):
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    def split_input(m, args, kwargs):
        x = first_input(args, kwargs)
        return replace_first(args, kwargs, x.narrow(1, 0, local)) if x is not None else (args, kwargs)

    fired: set[str] = set()

    def region_input(name):
        def hook(m, args, kwargs):
            fired.add(name)
            x = first_input(args, kwargs)
            if x is None or x.dim() < 2 or x.shape[1] != local:
                raise ValueError(f"'{name}' is called with {None if x is None else tuple(x.shape)}, not the "
                                 f"hidden states split over the sequence (length {local} of {full})")
            return replace_first(args, kwargs, torch.cat([x] * tp, dim=1))
        return hook

    def region_output(name):
        def hook(m, args, out):
            x = out if isinstance(out, torch.Tensor) else (out[0] if isinstance(out, tuple) and out else None)
            if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[1] != full:
                raise ValueError(f"'{name}' returns {type(out).__name__}, not hidden states of the full sequence")
            sliced = x.narrow(1, 0, local)
            return sliced if isinstance(out, torch.Tensor) else (sliced, *out[1:])
        return hook

    def gather_output(m, args, out):
        if isinstance(out, torch.Tensor):
            return torch.cat([out] * tp, dim=1)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (torch.cat([out[0]] * tp, dim=1), *out[1:])
        return out

    hooks = []
    for name in list(plan.regions) + list(gathered):
        module = twin.get_submodule(name)
        hooks.append(module.register_forward_pre_hook(region_input(name), with_kwargs=True))
        hooks.append(module.register_forward_hook(region_output(name)))
    if plan.layers:
        hooks.append(twin.get_submodule(plan.layers[0]).register_forward_pre_hook(split_input, with_kwargs=True))
        hooks.append(twin.get_submodule(plan.layers[-1]).register_forward_hook(gather_output))
    try:
        with torch.no_grad():
            twin(**meta_inputs(full))
    finally:
        for h in hooks:
            h.remove()
    unused = [g for g in gathered if g not in fired]
    if unused:  # its parameters are read by other code, which would see the shards
        raise ValueError(f"{unused[:3]} hold parameters but are never called")
