"""The recipe's ``peft:`` section (``ultrascale train``): LoRA adapters on the model, its base frozen, declared to
the recipe through ``ultrascale_declare_recipe_sections`` (``interface.recipe_section``). Read and checked before any worker
starts (every bad value one line naming ``peft.<field>``); the worker wraps the model it built on the meta device
with ``peft.get_peft_model`` (``peft_model``) before ``parallelize``; a resume is refused when the checkpoint's
adapters differ from the section's."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ...interface.config import ConfigError, suggest
from ...interface.extras import install_command
from ...interface.hookspecs import hookimpl
from ...interface.recipe_section import RecipeSection, SavedRun

PEFT_METHODS = ("lora",)


@dataclasses.dataclass
class PeftSpec:
    """The recipe's ``peft:`` section: LoRA adapters (``peft.LoraConfig``) on the model, whose base is frozen; the
    worker wraps the model with ``peft.get_peft_model`` on the meta device, before ``parallelize``. Absent: no
    PEFT, every parameter trains."""

    method: str = "lora"  # the adapter kind; DoRA is LoRA with use_dora
    r: int = 16  # the adapters' rank
    alpha: float = 32  # lora_alpha: the update is scaled by alpha / r (alpha / sqrt(r) with use_rslora)
    dropout: float = 0.0  # lora_dropout, on the adapters' input
    # the modules that get adapters: "all-linear" (every linear layer but the output head), a list of module names
    # (a name matches a module whose name is it or ends with "." + it: q_proj, mlp.down_proj), or one regular
    # expression matched against the whole module name, as PEFT reads target_modules
    target_modules: Any = "all-linear"
    modules_to_save: list = dataclasses.field(default_factory=list)  # modules trained whole (e.g. lm_head)
    use_dora: bool = False  # DoRA: a trained magnitude per output feature, from the base weight's norms
    use_rslora: bool = False  # rank-stabilized scaling: alpha / sqrt(r)
    # the frozen base's dtype: bf16 (half the bytes of weights that never train; the adapters stay fp32, as PEFT
    # keeps them), or fp32
    base_dtype: str = "bf16"
    # QLoRA: the adapted linear layers' frozen weights quantized ("nf4": torchao's 4-bit NormalFloat,
    # features/peft/quantized_base), each read whole and quantized whole as it is loaded, every rank keeping only
    # its shard; the matmuls dequantize to base_dtype. "" (the default): not quantized
    quantize_base: str = ""

    @property
    def torch_base_dtype(self):
        import torch

        return torch.bfloat16 if self.base_dtype == "bf16" else torch.float32

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["target_modules"] = (list(self.target_modules) if isinstance(self.target_modules, (list, tuple))
                                 else self.target_modules)
        return out

    def lora_config(self):
        """The ``peft.LoraConfig`` of this section. No ``task_type``: ``get_peft_model`` then returns the plain
        ``PeftModel``, whose forward is the causal LM's (``task_type="CAUSAL_LM"`` trains the same: its wrapper hands
        the labels on to the causal LM)."""
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.target_modules, modules_to_save=list(self.modules_to_save) or None,
                          use_dora=self.use_dora, use_rslora=self.use_rslora)

    def describe(self) -> str:
        kind = "DoRA" if self.use_dora else "LoRA"
        targets = (self.target_modules if isinstance(self.target_modules, str)
                   else ",".join(self.target_modules))
        saved = f", training {','.join(self.modules_to_save)} whole" if self.modules_to_save else ""
        base = f", the base in {self.quantize_base.upper()}" if self.quantize_base else ""
        return (f"{'Q' if self.quantize_base else ''}{kind} r={self.r} alpha={self.alpha:g}"
                f"{' (rsLoRA)' if self.use_rslora else ''} on {targets}{saved}{base}")


def peft_spec(section: Any) -> PeftSpec | None:
    """The recipe's ``peft:`` section checked and typed (None when absent or null); every bad value is refused
    naming the field, the value and a fix, and a section without peft installed says how to install it."""
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ConfigError(f"peft={section!r}: must be a section of fields. Fix: e.g. peft: {{method: lora, r: 16}} "
                          "(or --set peft.method=lora), or leave it out for full fine-tuning")
    names = {f.name for f in dataclasses.fields(PeftSpec)}
    for key in section:
        if key not in names:
            raise ConfigError(f"unknown key 'peft.{key}': {suggest(str(key), names)}")
    spec = PeftSpec(**section)
    if spec.base_dtype not in ("bf16", "fp32"):
        raise ConfigError(f"peft.base_dtype={spec.base_dtype!r}: the frozen base is held in bf16 or fp32. Fix: "
                          "base_dtype: bf16 (the default), or fp32")
    if spec.method not in PEFT_METHODS:
        raise ConfigError(f"peft.method={spec.method!r}: only lora is supported (DoRA is lora with use_dora: true). "
                          "Fix: method: lora")
    if isinstance(spec.r, bool) or not isinstance(spec.r, int) or spec.r < 1:
        raise ConfigError(f"peft.r={spec.r!r}: must be a positive integer (the adapters' rank). Fix: e.g. r: 16")
    if isinstance(spec.alpha, bool) or not isinstance(spec.alpha, (int, float)) or spec.alpha <= 0:
        raise ConfigError(f"peft.alpha={spec.alpha!r}: must be a positive number (lora_alpha; the update is scaled by "
                          "alpha / r). Fix: e.g. alpha: 32 (twice r)")
    if isinstance(spec.dropout, bool) or not isinstance(spec.dropout, (int, float)) or not 0 <= spec.dropout < 1:
        raise ConfigError(f"peft.dropout={spec.dropout!r}: must be at least 0 and below 1. Fix: e.g. dropout: 0.05")
    targets = spec.target_modules
    if isinstance(targets, (list, tuple)):
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigError(f"peft.target_modules={targets!r}: must be module names. Fix: e.g. target_modules: "
                              "[q_proj, k_proj, v_proj, o_proj], or all-linear")
    elif not isinstance(targets, str) or not targets:
        raise ConfigError(f"peft.target_modules={targets!r}: must be all-linear, a list of module names or one "
                          "regular expression. Fix: e.g. target_modules: all-linear")
    saved = spec.modules_to_save
    if saved is None:
        spec.modules_to_save = saved = []
    if not isinstance(saved, (list, tuple)) or not all(isinstance(m, str) and m for m in saved):
        raise ConfigError(f"peft.modules_to_save={saved!r}: must be a list of module names. Fix: e.g. "
                          "modules_to_save: [lm_head]")
    for key in ("use_dora", "use_rslora"):
        if not isinstance(getattr(spec, key), bool):
            raise ConfigError(f"peft.{key}={getattr(spec, key)!r}: must be true or false. Fix: e.g. {key}: false")
    if spec.quantize_base in (None, False):
        spec.quantize_base = ""
    if spec.quantize_base not in ("", "nf4"):
        raise ConfigError(f"peft.quantize_base={spec.quantize_base!r}: the frozen base is quantized to nf4 (QLoRA's "
                          "4-bit NormalFloat, torchao) or not at all. Fix: quantize_base: nf4, or leave it out")
    if spec.quantize_base and spec.use_dora:
        raise ConfigError("peft.use_dora=True: DoRA with a quantized base is not supported (PEFT's DoRA dequantizes "
                          "the base through weight.dequantize(), which torchao's NF4Tensor lacks). Fix: use_dora: "
                          "false, or leave quantize_base out")
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f"the recipe's peft section ({spec.describe()}) needs the peft package, which is not "
                          f"installed. Fix: {install_command('peft')}, or drop the peft section")
    return spec


def _module_matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def peft_model(model, spec: PeftSpec):
    """``model`` (the causal LM, on the meta device as the command line builds it) wrapped by
    ``peft.get_peft_model`` as ``spec`` says. A ``target_modules`` or ``modules_to_save`` name that matches no
    module of the model is refused (ConfigError) before PEFT sees it; so is a target PEFT cannot adapt."""
    import re

    try:
        from peft import get_peft_model
    except ImportError:
        raise ConfigError(f"the recipe's peft section needs the peft package, which is not installed. Fix: "
                          f"{install_command('peft')}, or drop the peft section") from None
    names = [name for name, _ in model.named_modules() if name]
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    leaves = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                     if name and not list(m.children()) and not name.rsplit(".", 1)[-1].isdigit()})
    shown = ", ".join(leaves[:16]) + (", ..." if len(leaves) > 16 else "")
    targets = spec.target_modules
    if isinstance(targets, str) and targets != "all-linear":
        if not any(re.fullmatch(targets, name) for name in names):
            raise ConfigError(f"peft.target_modules={targets!r}: as a regular expression it matches no module name "
                              f"of this {kind} model (whole names, e.g. {names[-2]}). Fix: a list of module names, "
                              f"e.g. target_modules: [q_proj, v_proj] (its modules: {shown}), or all-linear")
    for field, wanted in (("target_modules", targets if isinstance(targets, (list, tuple)) else []),
                          ("modules_to_save", spec.modules_to_save)):
        missing = [t for t in wanted if not any(_module_matches(name, t) for name in names)]
        if missing:
            import difflib

            close = difflib.get_close_matches(missing[0].rsplit(".", 1)[-1], leaves, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"peft.{field}={list(wanted)!r}: {', '.join(repr(m) for m in missing)} names no module "
                              f"of this {kind} model{hint}. Fix: use its module names ({shown})"
                              + (", or all-linear" if field == "target_modules" else ""))
    import contextlib

    import torch

    # a model on the meta device gets its adapters there too: PEFT would otherwise make them on the CPU (and draw
    # them) before moving them to the base's device, holding every adapter in each process's memory for nothing
    on_meta = all(p.is_meta for p in model.parameters())
    try:
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            model = get_peft_model(model, spec.lora_config())
    except (ValueError, TypeError, NotImplementedError) as exc:
        said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        field, fix = next(((f, fix) for word, f, fix in PEFT_REFUSALS if word in said.lower()),
                          ("target_modules", "target other modules, e.g. target_modules: [q_proj, k_proj, v_proj, "
                                             "o_proj]"))
        raise ConfigError(f"peft.{field}={getattr(spec, field)!r}: PEFT cannot adapt this {kind} model as the recipe "
                          f"says: {said}. Fix: {fix}") from None
    if spec.quantize_base:  # on the meta device: parallelize quantizes each weight whole as it loads it
        from .wrapper import LIBRARY  # this family's own wrapper of the PEFT model just made

        LIBRARY.wrap(model).quantize_base(spec.quantize_base)
    return model


# what PEFT's refusals name -> (the recipe field, its fix)
PEFT_REFUSALS = (("dropout", "dropout", "dropout: 0.0, or target_modules without the parameters PEFT wraps (a MoE "
                                        "layer's fused experts), e.g. [q_proj, k_proj, v_proj, o_proj]"),
                 ("dora", "use_dora", "use_dora: false, or target_modules PEFT's DoRA supports"),
                 ("modules_to_save", "modules_to_save", "name modules the adapters do not target"),
                 ("rank", "r", "r: 16"))


PEFT_SHAPES = ("method", "r", "target_modules", "modules_to_save", "use_dora")  # what decides the parameters


def check_resume(peft: PeftSpec | None, saved: SavedRun, init_from: str | None) -> None:
    """Refuse (ConfigError) resuming a checkpoint with a ``peft`` section that builds other parameters than the one
    it was trained with (its recipe is saved with it); checkpoints without a saved recipe are not compared. Without
    ``init_from`` a PEFT run's frozen base is read again from the directory the checkpoint records: it must be
    there."""
    path, base = saved.path, saved.init_from
    if peft is not None and not init_from and base and not (Path(base) / "config.json").is_file():
        raise ConfigError(f"--resume {path}: the run's frozen base is read again from the directory it started from, "
                          f"'{base}' (its --init-from), which is not a save_pretrained directory here. Fix: pass the "
                          "base with --init-from DIR")
    if not isinstance(saved.recipe, dict):
        return
    theirs, mine = saved.recipe.get("peft"), peft.to_dict() if peft is not None else None
    if (theirs is None) != (mine is None):
        how = (f"with adapters (peft: {theirs})" if theirs is not None else "without adapters (no peft section)")
        raise ConfigError(f"--resume {path}: the checkpoint was trained {how}, the recipe "
                          f"{'has none' if mine is None else f'adds peft: {mine}'}, so its parameters differ. Fix: "
                          "resume with the peft section the run was started with"
                          + (f" (e.g. --set peft.r={theirs.get('r')})" if theirs is not None else
                             " (drop it: --set peft=null)"))
    if theirs is not None:
        differ = {k: (mine.get(k), theirs.get(k)) for k in PEFT_SHAPES if mine.get(k) != theirs.get(k)}
        if differ:
            what = ", ".join(f"peft.{k}={v!r} (checkpoint: {w!r})" for k, (v, w) in differ.items())
            raise ConfigError(f"--resume {path}: the recipe's {what} builds other adapters than the checkpoint "
                              "holds. Fix: set the checkpoint's values to resume it")


class PeftSection(RecipeSection):
    """``peft:``: adapters on the meta-device model, its base in ``base_dtype``; a checkpoint holds the adapters
    only, so a resume reads the base again from the run's ``--init-from``."""

    name = "peft"
    example = "{method: lora, r: 16}"

    def read(self, value):
        return peft_spec(value)

    def to_dict(self, spec):
        return spec.to_dict()

    def describe(self, spec):
        return spec.describe()

    def model_kwargs(self, spec):
        return {"dtype": spec.torch_base_dtype}

    def apply(self, model, spec):
        return peft_model(model, spec)

    def checkpoint_holds_whole_model(self, spec):
        return False

    def check_resume(self, spec, saved, init_from):
        check_resume(spec, saved, init_from)


@hookimpl
def ultrascale_declare_recipe_sections():
    return [PeftSection()]
