"""The Makefile's install targets: `make run` installs the package alone, `make test` the test and parity extras."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def planned(target: str, tmp_path: Path) -> list[str]:
    """The pip installs `make TARGET` would run on a fresh machine (a venv that does not exist yet)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    proc = subprocess.run(["make", "-n", f"VENV={tmp_path / 'venv'}", target], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if "pip install" in line and "--upgrade pip" not in line]


def test_make_run_installs_what_training_needs(tmp_path):
    assert [line.split("pip install -q ")[1] for line in planned("run", tmp_path)] == ["-e ."]


def test_make_test_adds_the_test_and_parity_extras(tmp_path):
    assert [line.split("pip install -q ")[1] for line in planned("test", tmp_path)] == ['-e ".[test,parity]"']
