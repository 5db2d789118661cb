"""The pip command that installs one of the package's optional extras (``plot``, ``tensorboard``, ``float8``,
``peft``, ``trl``), for the hint of an error or note that needs one.

The hint names the extra's own requirements (``pip install "peft>=0.21"``), read from the installed package's
metadata, rather than ``pip install "ultrascale-plugins[peft]"``: that form needs the package on an index, and a
package installed from a clone is not there (``".[peft]"`` works only in the clone's root)."""
from __future__ import annotations

import re

DISTRIBUTION = "ultrascale-plugins"


def extra_requirements(extra: str) -> list[str]:
    """The requirement strings of ``extra`` as the installed metadata lists them (``["peft>=0.21"]``); empty when
    the metadata cannot be read (a source tree run without installing) or the extra is unknown."""
    from importlib import metadata

    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    marker = re.compile(r"""extra\s*==\s*['"]""" + re.escape(extra) + r"""['"]""")
    return [req.split(";")[0].strip() for req in requires if ";" in req and marker.search(req.split(";", 1)[1])]


def install_command(extra: str) -> str:
    """``pip install "peft>=0.21"``: what installs ``extra``'s packages wherever this package came from."""
    requirements = extra_requirements(extra)
    if not requirements:  # no metadata: the source tree's own spelling, run from its root
        return f'pip install ".[{extra}]" (from the ultrascale-plugins source directory)'
    return "pip install " + " ".join(f'"{req}"' for req in requirements)
