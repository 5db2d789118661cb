"""One install brings everything; integrations/ installs under the ultrascale_plugins namespace only."""
import importlib
import os
import subprocess
import sys
from importlib import metadata


def test_integrations_live_under_the_package_namespace(tmp_path):
    module = importlib.import_module("ultrascale_plugins.integrations")
    assert module.__name__ == "ultrascale_plugins.integrations"
    # outside the source tree, no top-level "integrations" is importable
    probe = "import importlib.util as u; print(u.find_spec('integrations'))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.stdout.strip() == "None", out.stdout + out.stderr


def test_console_script_and_data_are_installed():
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("ultrascale") == "ultrascale_plugins.cli:main"
    from importlib import resources

    data = resources.files("ultrascale_plugins").joinpath("data")
    assert data.joinpath("corpus.txt").read_bytes()
    assert "parallel:" in data.joinpath("default.yaml").read_text()
