"""A model that wraps the causal LM the plans are for (a PEFT model holds it at ``base_model.model``), described by
the library that makes that kind of wrapper (``WrapperLibrary``, which a plugin declares through
``ultrascale_declare_model_wrapper``). The engine asks the ``ModelWrapper`` of a model, and nothing else, what depends
on the wrapper: where the causal LM sits, where each entry's pretrained value comes from, the initial values of what
the wrapper introduced and of what depends on other values, and its own saved form; it asks the library what its
adapters cost and how its checkpoints are exported, where no model instance is at hand."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .config import ConfigError

if TYPE_CHECKING:
    from .estimates import AdapterFactor, Adapters
    from .protocols import SavedCheckpoint


class ModelWrapper:
    """``model`` wraps ``inner`` (a transformers causal LM) at the submodule path ``prefix`` ("" for a model that
    wraps nothing: ``ModelWrapper(model)``). A ``WrapperLibrary`` returns a subclass from ``wrap``, overriding what
    its wrapper changes; the defaults are those of a wrapper that only nests the model."""

    def __init__(self, model, inner=None, prefix: str = ""):
        self.model, self.inner, self.prefix = model, model if inner is None else inner, prefix

    @property
    def wraps(self) -> bool:
        return self.inner is not self.model

    def describe(self) -> str:
        """What ``us.describe`` says of the wrapper, before the stages."""
        return f"a {type(self.model).__name__} around the {type(self.inner).__name__} at {self.prefix}"

    def pretrained_name(self, name: str) -> str:
        """Where the state-dict entry ``name`` of ``model`` takes its initial value from: its name in the plain
        causal LM, as that model's ``save_pretrained`` files name it; ``""`` for an entry the wrapper introduced,
        which no pretrained file holds (its value comes from ``init_module``). Default: the name without the
        prefix. Asked for every entry before any process group exists (``checkpoints.read_plan.plan_reads``)
        and when a meta-device model is initialized (``initialize.ModelInit``), on the model as handed to
        ``parallelize``."""
        return name[len(self.prefix) + 1:] if self.prefix and name.startswith(self.prefix + ".") else name

    def init_module(self, name: str, module) -> bool:
        """Give ``module`` (the submodule ``name`` of ``model``) the wrapper's own initialization and return True,
        when it holds, or is the layer that owns, entries the wrapper introduced; False leaves it to the model's own
        ``_init_weights``. Called on a meta-device twin of ``model`` in which only one unit's parameters are real,
        inside the CPU generator seeded with (seed, the unit's name): draw with torch's init functions."""
        return False

    def held_value(self, local, full):
        """``full`` (an entry's whole initial value, read or drawn, a plain tensor) as the model holds it, given
        ``local``, this rank's part of the entry as the layout holds it; this rank keeps its part of the result. The
        default: ``full`` itself. A wrapper that holds entries in another form returns that form of the whole value
        (a quantized base: ``full`` quantized whole, so that each part is a part of the whole's quantization)."""
        return full

    def whole_value(self, tensor):
        """An entry's whole value from ``tensor``, this rank's view of it (a DTensor, or a plain tensor that is
        whole already), as ``ParallelModel.full_state_dict`` returns it. Every rank calls it, in the same order. The
        default: ``full_tensor()``. A wrapper that holds entries as tensor subclasses gathers those its own way (a
        quantized base: each NF4 weight's sharded parts)."""
        from torch.distributed.tensor import DTensor

        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    def quantize_base(self, scheme: str) -> None:
        """Hold the wrapped model's frozen base weights quantized (``scheme``: QLoRA's "nf4"), in place; on the meta
        device it marks them, and loading quantizes each weight whole (``held_value``). The default: a wrapper
        without a frozen base cannot."""
        raise ConfigError(f"quantize_base={scheme!r}: {self.describe()} has no frozen base to quantize. Fix: a PEFT "
                          "model (LoRA adapters on a frozen base), or leave quantize_base out")

    def init_dependent(self, modules: list) -> None:
        """Set the initial values that are functions of other parameters' values (DoRA's magnitude), once
        ``modules`` (this rank's model parts, in their final layout) hold their pretrained or drawn values. Every
        rank calls it in the same order, so collectives over a part's mesh pair up."""

    def save_pretrained(self, pmodel, directory: str) -> bool:
        """Write ``pmodel``'s model to ``directory`` as the wrapper's own library would (a PEFT model: its adapters)
        and return True; False leaves it to the whole-model Hugging Face export. Every rank calls it."""
        return False


class WrapperLibrary:
    """A library that wraps causal LMs (PEFT), as its plugin declares it (``ultrascale_declare_model_wrapper``): how
    the engine sees through the library's models, what its adapters cost, and how its checkpoints are exported. The
    registry asks every declared library in turn; each method's default, None, means "not mine"."""

    def wrap(self, model) -> ModelWrapper | None:
        """``model``'s description when it is a model of this library's kind (a PEFT model): a ``ModelWrapper``
        subclass holding the causal LM it wraps; None otherwise (the engine then treats ``model`` as the causal LM
        itself, unless another library answers)."""
        return None

    def adapter_factors(self, model, adapters: Adapters | None) -> list[AdapterFactor] | None:
        """The adapter factors (``estimates.AdapterFactor``) this library's adapters put on ``model``, so the
        estimates count them: with ``adapters`` None, those ``model`` holds (a PEFT model's LoRA layers; every
        library's are counted); with an ``estimates.Adapters`` whose ``method`` this library owns, those it would add
        to a model that has none, with their shapes (the planner's ``--peft lora``; the first library that answers
        prices them). None when it has none or does not own the method."""
        return None

    def export(self, checkpoint: SavedCheckpoint, form: str, out_dir: str, base: str | None,
               max_shard_bytes: int) -> bool | None:
        """Write the sharded ``checkpoint`` (a ``protocols.SavedCheckpoint``: ``path``, ``meta``, ``config``,
        ``names``, ``read(names)``) in a form this library defines (``ultrascale export --adapter`` / ``--merged``:
        ``form`` ``"adapter"``, its own files, or ``"merged"``, a plain transformers model with the adapters folded
        into the frozen base read from ``base``) into the new, empty ``out_dir``, no weights file over
        ``max_shard_bytes``; in one process. True once written; None when the checkpoint is not of its kind (the
        first library that writes it does; none: the export is refused)."""
        return None
