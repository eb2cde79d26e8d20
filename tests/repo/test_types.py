"""mypy, configured in pyproject.toml ([tool.mypy]), finds no type error in certkv (CI runs it through pytest).

The check is basic (not strict) and offline: the model stack and other heavy third-party packages
are not analysed (their names are typed Any), so it runs in seconds and never imports torch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow  # a dozen seconds: outside the quick torch-free selection
def test_mypy_is_clean():
    proc = subprocess.run([sys.executable, "-m", "mypy", "certkv"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mypy certkv exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
