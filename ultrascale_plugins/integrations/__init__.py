"""Source-checkout stand-in for ``ultrascale_plugins.integrations``; not part of any install.

The framework adapters live in the repository's top-level ``integrations/`` directory. An install (wheel, sdist or
``pip install -e .``) ships them as ``ultrascale_plugins.integrations`` through pyproject.toml's
``[tool.setuptools.package-dir]``; this file is not in the wheel. But whenever the repository root comes first on
``sys.path`` (``python -m ultrascale_plugins.cli.main`` or ``python -c ...`` started from the root, as the tests'
subprocesses are), Python imports ``ultrascale_plugins`` from this checkout, and then looks for its subpackages in
this directory only, whatever is installed. So this package takes ``../../integrations`` as its search path, and
the checkout imports the same files under the same names as an install does. ``integrations/__init__.py`` holds
only a docstring, so nothing is lost by this file running in its place.
"""
from pathlib import Path

_source = Path(__file__).resolve().parent.parent.parent / "integrations"
if (_source / "__init__.py").is_file():
    __path__[:] = [str(_source)]  # noqa: F821 (a package's __path__); in place, so __spec__ agrees
del Path, _source
