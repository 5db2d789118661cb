"""A library that wraps causal LMs, declared by a third party (``ultrascale_declare_model_wrapper``: a
``WrapperLibrary``): once registered, the registry asks it what a model of its kind wraps and what its adapters
cost, beside PEFT's; a plugin that declares something else is refused with the fix."""
import pytest
from torch import nn

from models import make_config
from ultrascale_plugins import hookimpl
from ultrascale_plugins.core.inventory import inventory
from ultrascale_plugins.core.registry import make_registry
from ultrascale_plugins.interface.config import ConfigError
from ultrascale_plugins.interface.estimates import AdapterFactor, Adapters, meta_model
from ultrascale_plugins.interface.model_wrapper import ModelWrapper, WrapperLibrary


class Shell(nn.Module):
    """A wrapper of the causal LM at ``held``."""

    def __init__(self, inner):
        super().__init__()
        self.held = inner


class ShellLibrary(WrapperLibrary):
    """Sees through a ``Shell``; prices a "toy" adapter: one rank-2 factor on the first decoder layer's q_proj."""

    def wrap(self, model):
        return ModelWrapper(model, model.held, "held") if isinstance(model, Shell) else None

    def adapter_factors(self, model, adapters):
        if adapters is None or adapters.method != "toy":
            return None
        base = "model.layers.0.self_attn.q_proj.weight"
        return [AdapterFactor("model.layers.0.self_attn.q_proj.toy", "lora_A", base, 2, shape=(2, 64))]


class ShellPlugin:
    @hookimpl
    def ultrascale_declare_model_wrapper(self):
        return ShellLibrary()


def test_a_third_partys_library_is_asked_once_registered():
    pm = make_registry(load_entry_points=False)
    plain = meta_model(make_config("llama"))
    shell = Shell(plain)
    assert not pm.wrapper_of(shell).wraps  # asked before the plugin is registered: no library knows a Shell
    with pytest.raises(ConfigError, match="'toy': no installed plugin prices them"):
        inventory(plain, None, Adapters(r=2, method="toy"), pm=pm)
    pm.register(ShellPlugin(), name="shell")
    wrapper = pm.wrapper_of(shell)
    assert (wrapper.inner, wrapper.prefix) == (plain, "held")
    assert pm.wrapper_of(plain).inner is plain  # a plain model: neither library's
    records = inventory(plain, None, Adapters(r=2, method="toy"), pm=pm)
    assert [(r.name, r.shape, r.adapter_of) for r in records if r.adapter] == [
        ("model.layers.0.self_attn.q_proj.toy", (2, 64), "model.layers.0.self_attn.q_proj.weight")]


def test_a_declaration_that_is_no_library_is_refused():
    class Wrong:
        @hookimpl
        def ultrascale_declare_model_wrapper(self):
            return ModelWrapper(nn.Linear(1, 1))

    pm = make_registry(load_entry_points=False)
    pm.register(Wrong(), name="wrong")
    with pytest.raises(ConfigError, match="returned .*ModelWrapper.* Fix: return a model_wrapper.WrapperLibrary"):
        pm.wrapper_of(nn.Linear(1, 1))
