"""The hardware profile ``ultrascale calibrate`` writes and ``--gpu FILE`` reads: a JSON file holding a ``Hardware``'s
figures (``hardware``), the time model's constants fitted on the machine (``constants``: overrides of
``constants.CONSTANTS``), each collective's measured curve inside a node (``collectives``), the raw measurements
and where, when and with what they were taken. Reading checks every figure the planner uses, so a broken file is refused in one
line naming the file, the field and the fix, before any work.
"""
from __future__ import annotations

import json
import math
import os

from ..interface.config import ConfigError
from .constants import CONSTANTS

FORMAT = "ultrascale-hardware-profile"
VERSION = 1
# the Hardware fields a profile must give, with what each is (for the fix of a missing or bad one)
FIELDS = {
    "name": "the machine's name",
    "memory_gb": "GB of memory per device (per process on a CPU)",
    "tflops": "TFLOP/s of bf16 matmuls per device",
    "intra_node_gbps": "GB/s per device, one direction, inside a node",
    "inter_node_gbps": "GB/s per device, one direction, between nodes",
    "gpus_per_node": "devices (processes on a CPU) per node",
    "host_link_gbps": "GB/s per device to host memory",
    "host_memory_gb": "GB of host memory per device",
}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def write_profile(path: str, profile: dict) -> None:
    """``profile`` as JSON at ``path``, written aside and moved over, so a failure leaves no half file."""
    aside = f"{path}.tmp"
    with open(aside, "w") as f:
        json.dump(profile, f, indent=1)
        f.write("\n")
    os.replace(aside, path)


def read_profile(path: str) -> dict:
    """The ``Hardware`` fields a profile gives (``hardware.Hardware(**read_profile(path))``): its figures, its fitted
    constants and measured curves; a ``ConfigError`` naming the file, the field and the fix when the file is
    missing, does not parse, or lacks or breaks a field."""
    data = _load(path)
    hw = data.get("hardware")
    if not isinstance(hw, dict):
        raise _refuse(path, "hardware", "is missing (no section of the machine's figures)")
    unknown = sorted(set(hw) - set(FIELDS))
    if unknown:
        raise _refuse(path, f"hardware.{unknown[0]}", f"is not a hardware field (they are {', '.join(FIELDS)})")
    figures = {name: _figure(path, f"hardware.{name}", hw.get(name), what) for name, what in FIELDS.items()}
    return {**figures, "constants": _constants(path, data.get("constants", {})),
            "measured_busbw": _curves(path, data.get("collectives", {}))}


def _load(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--gpu {path}: no such file. Fix: write it with `ultrascale calibrate --out {path}`, or "
                          "name a preset")
    try:
        with open(path) as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--gpu {path}: not a JSON hardware profile ({exc}). Fix: write it again with "
                          f"`ultrascale calibrate --out {path}`") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--gpu {path}: not a hardware profile (a JSON object with a 'hardware' section). Fix: write "
                          f"it with `ultrascale calibrate --out {path}`")
    return data


def _refuse(path: str, field: str, problem: str, fix: str = "") -> ConfigError:
    return ConfigError(f"--gpu {path}: {field} {problem}. Fix: {fix or 'correct it'}, or write the profile again "
                       f"with `ultrascale calibrate --out {path}`")


def _figure(path: str, field: str, value, what: str):
    """One hardware field's value, checked: the name a string, ``gpus_per_node`` a whole number from 1, every other
    figure a finite positive number."""
    if value is None:
        return _missing(path, field, what)
    if field == "hardware.name":
        if not isinstance(value, str) or not value:
            raise _refuse(path, field, f"= {value!r}: must be a name", f"give {what}")
        return value
    if field == "hardware.gpus_per_node":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _refuse(path, field, f"= {value!r}: must be a whole number, at least 1", f"give {what}")
        return value
    return _positive(path, field, value, what)


def _missing(path: str, field: str, what: str):
    raise _refuse(path, field, "is missing", f"add it ({what})")


def _positive(path: str, field: str, value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _refuse(path, field, f"= {value!r}: must be a positive number", f"give {what}")
    return float(value)


def _constants(path: str, constants) -> tuple:
    """The fitted constants as (name, value) pairs, each a constant of the time model, positive."""
    if not isinstance(constants, dict):
        raise _refuse(path, "constants", "must be an object of the time model's constants")
    for name in constants:
        if name not in CONSTANTS:
            raise _refuse(path, f"constants.{name}", "is not a constant of the time model",
                          f"use one of {', '.join(CONSTANTS)}")
    return tuple((name, _positive(path, f"constants.{name}", value, "a positive figure"))
                 for name, value in sorted(constants.items()))


def _curves(path: str, collectives) -> tuple:
    """Each collective's measured bus bandwidth by group size inside a node: (collective, ((group, GB/s), ...))."""
    if not isinstance(collectives, dict):
        raise _refuse(path, "collectives", "must be an object of measured curves by collective")
    out = []
    for name, by_group in sorted(collectives.items()):
        if name not in COLLECTIVES:
            raise _refuse(path, f"collectives.{name}", "is not a collective", f"use one of {', '.join(COLLECTIVES)}")
        if not isinstance(by_group, dict) or not by_group:
            raise _refuse(path, f"collectives.{name}", "must hold the figures by group size")
        points = []
        for group, fit in sorted(by_group.items()):
            field = f"collectives.{name}.{group}"
            if not str(group).isdigit() or int(group) < 2:
                raise _refuse(path, field, "is not a group size (a whole number of ranks, at least 2)")
            if not isinstance(fit, dict):
                raise _refuse(path, field, "must hold latency_s and bus_gbps")
            for key in ("latency_s", "bus_gbps"):
                if key not in fit:
                    _missing(path, f"{field}.{key}", "the fitted figure")
                _positive(path, f"{field}.{key}", fit[key], "the fitted figure")
            points.append((int(group), float(fit["bus_gbps"])))
        out.append((name, tuple(sorted(points))))
    return tuple(out)

