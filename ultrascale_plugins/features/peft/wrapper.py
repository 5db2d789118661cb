"""PEFT as the engine sees it (``ultrascale_declare_model_wrapper``: ``PeftLibrary``): a PEFT model's causal LM at
``base_model.model``, the pretrained name of each entry and PEFT's initialization of its adapters (``meta``), its
adapters saved in PEFT's own format (``adapters.save_adapters``) (``PeftWrapper``, per model); what LoRA adds to a
model (``pricing``) and a checkpoint exported in PEFT's files or merged (``checkpoints``)."""
from __future__ import annotations

from ...interface.hookspecs import hookimpl
from ...interface.model_wrapper import ModelWrapper, WrapperLibrary
from . import checkpoints, pricing
from .adapters import is_peft_model, save_adapters
from .meta import entry_plain_name, init_dependent, init_module
from .quantized_base import gathered, quantize_base, requantized


class PeftWrapper(ModelWrapper):
    def describe(self) -> str:
        configs = ", ".join(f"{getattr(c.peft_type, 'value', c.peft_type)} r={getattr(c, 'r', '?')}"
                            for c in self.model.peft_config.values())
        return (f"a PEFT model ({configs}) around the {type(self.inner).__name__}: the base frozen, each adapter "
                "sharded as its base layer by every stage (ultrascale_declare_plan_edit), data parallel reducing and "
                "sharding only what trains")

    def pretrained_name(self, name: str) -> str:
        plain = entry_plain_name(self.model, name)
        return plain if plain is not None else super().pretrained_name(name)

    def init_module(self, name: str, module) -> bool:
        return init_module(self.model, name, module)

    def quantize_base(self, scheme: str) -> None:
        quantize_base(self.model, scheme)

    def held_value(self, local, full):
        return requantized(local, full)  # an NF4 base (quantize_base on the meta device): quantized whole

    def whole_value(self, tensor):
        return gathered(tensor)  # an NF4 base weight: its parts gathered without torchao's asynchronous path

    def init_dependent(self, modules: list) -> None:
        init_dependent(modules)

    def save_pretrained(self, pmodel, directory: str) -> bool:
        return save_adapters(pmodel, directory)


class PeftLibrary(WrapperLibrary):
    """PEFT: its models (``PeftWrapper``), its LoRA adapters' factors (``pricing``), its checkpoints' exports
    (``checkpoints``)."""

    def wrap(self, model) -> PeftWrapper | None:
        if not is_peft_model(model):
            return None
        inner = model.get_base_model()
        return PeftWrapper(model, inner, next(fqn for fqn, module in model.named_modules() if module is inner))

    def adapter_factors(self, model, adapters):
        return pricing.adapter_factors(model, adapters)

    def export(self, checkpoint, form, out_dir, base, max_shard_bytes):
        return checkpoints.export(checkpoint, form, out_dir, base, max_shard_bytes)


LIBRARY = PeftLibrary()


@hookimpl
def ultrascale_declare_model_wrapper():
    return LIBRARY
