"""Which model types keep packed samples apart, as measured by benchmarks/packing_sweep.py.

``data.packing: true`` gives each row ``position_ids`` restarting at every sample and no attention mask; only
models whose masks transformers derives from those position_ids keep each sample's attention to itself. The
others would let packed samples attend to each other and train silently wrong, so packing is refused for every
model type the sweep did not measure ``apart`` (the verdicts ship in ``data/packing_support.json``).
"""
from __future__ import annotations

import functools
import json
from importlib import resources

from ..interface.config import ConfigError

SWEEP = "python benchmarks/packing_sweep.py"


@functools.lru_cache(maxsize=1)
def _shipped() -> tuple[str, dict[str, str]]:
    """(transformers version of the sweep, {model_type: verdict})."""
    data = json.loads(resources.files("ultrascale_plugins").joinpath("resources/packing_support.json").read_text())
    verdicts = {}
    for verdict in ("apart", "crosses", "error", "untinyable"):
        for model_type in data.get(verdict, []):
            verdicts[model_type] = verdict
    return str(data.get("transformers", "?")), verdicts


def packing_verdict(model_type: str) -> str:
    """``apart``, ``crosses``, ``error`` or ``untinyable`` as measured for ``model_type``; ``unmeasured`` when the
    sweep did not include it."""
    return _shipped()[1].get(model_type, "unmeasured")


def check_packing_model(model_type: str, transformers_version: str) -> None:
    """Refuse ``data.packing: true`` for a model type not measured to keep packed samples apart."""
    swept, _ = _shipped()
    verdict = packing_verdict(model_type)
    if verdict == "apart":
        return
    measured = {
        "crosses": "lets packed samples attend to each other (their logits differ from each sample run alone)",
        "error": "could not be measured (a forward of its tiny model raised)",
        "untinyable": "could not be measured (no tiny model of it could be built)",
    }
    if verdict in measured:
        what = f"model type '{model_type}' {measured[verdict]} in the packing sweep of transformers {swept}"
    else:
        what = (f"model type '{model_type}' is not in the packing sweep of transformers {swept} (installed: "
                f"{transformers_version}), so nothing shows that it keeps packed samples apart; to measure it run "
                f"`{SWEEP} --types {model_type}`")
    risk = "training would be silently wrong" if verdict == "crosses" else "training could be silently wrong"
    raise ConfigError(f"data.packing=true: {what}; {risk}. Fix: set data.packing: false (one sample per row, "
                      "padded)")
