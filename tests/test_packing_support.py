"""Which model types keep packed samples apart (benchmarks/packing_sweep.py): a fixed subset of the sweep
reproduces the verdicts shipped in ultrascale_plugins/resources/packing_support.json, and data.packing is refused
for the types that were not measured apart."""
import sys
from pathlib import Path

import pytest

from ultrascale_plugins.interface.config import ConfigError
from ultrascale_plugins.data.packing_support import check_packing_model, packing_verdict

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

SUBSET = {
    "llama": "apart",
    "gpt2": "apart",
    "qwen3": "apart",
    "mistral": "apart",
    "gemma2": "apart",       # eager only (no sdpa), sliding + full layers
    "mixtral": "apart",      # mixture of experts
    "gpt_oss": "crosses",    # builds its masks without position_ids
    "lfm2": "crosses",       # conv layers, absent from the default config: measured through a layer_types variant
    "bailing_hybrid": "error",
}


@pytest.mark.parametrize("model_type", sorted(SUBSET))
def test_sweep_reproduces_the_shipped_verdict(model_type):
    from packing_sweep import measure

    assert packing_verdict(model_type) == SUBSET[model_type]
    result = measure(model_type)
    assert result["result"] == SUBSET[model_type], result["detail"]


def _version():
    import transformers

    return transformers.__version__


def test_a_type_measured_apart_passes():
    check_packing_model("llama", _version())


def test_a_crossing_type_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as info:
        check_packing_model("gpt_oss", _version())
    message = str(info.value)
    assert "\n" not in message
    assert "data.packing=true" in message and "'gpt_oss'" in message and "attend to each other" in message
    assert "Fix: set data.packing: false" in message


def test_an_unmeasured_type_is_refused_with_how_to_measure_it():
    assert packing_verdict("no_such_model") == "unmeasured"
    with pytest.raises(ConfigError) as info:
        check_packing_model("no_such_model", "9.9.9")
    message = str(info.value)
    assert "\n" not in message
    assert "not in the packing sweep of transformers" in message and "9.9.9" in message
    assert "python benchmarks/packing_sweep.py --types no_such_model" in message
    assert "Fix: set data.packing: false" in message
