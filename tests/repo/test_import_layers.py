"""The package's import graph: no cycles between modules or subpackages, and a torch-free core.

The checks live in ``tools/import_layers.py`` (also runnable by hand); these tests run them on
the package and on a copy with a deliberately introduced cycle, which they must catch.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import import_layers
from conftest import REPO

PACKAGE = REPO / "certkv"


def test_package_has_no_cycles_and_a_pure_core():
    assert import_layers.problems(PACKAGE) == []


def test_the_graph_sees_lazy_imports():
    """Function-level imports count: `certkv calibrate`'s command imports the calibration run only
    inside its body (the CLI keeps heavy imports out of `certkv --help`)."""
    graph = import_layers.import_graph(PACKAGE)
    assert "certkv.calibration.run" in graph["certkv.cli.calibrate"]
    assert "certkv.engine" in import_layers.unit_graph(graph)["certkv.runtime"]


def _copy_with(tmp_path: Path, relative: str, line: str) -> Path:
    copy = tmp_path / "certkv"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("embedded", "__pycache__"))
    target = copy / relative
    target.write_text(target.read_text(encoding="utf-8") + f"\n\ndef _introduced():\n    {line}\n", encoding="utf-8")
    return copy


def test_a_deliberate_subpackage_cycle_fails(tmp_path):
    # The contract validates builtin sources against the requests package; the reverse closes a loop.
    copy = _copy_with(tmp_path, "requests/vocabulary.py", "from certkv.contract.schema import Contract")
    found = import_layers.problems(copy)
    assert any("between subpackages" in p and "certkv.contract" in p and "certkv.requests" in p for p in found), found
    assert any("between modules" in p and "certkv.requests.vocabulary" in p for p in found), found
    proc = subprocess.run([sys.executable, str(Path(import_layers.__file__)), str(copy)], capture_output=True, text=True)
    assert proc.returncode == 1 and "cycle" in proc.stdout


def test_core_importing_the_model_stack_fails(tmp_path):
    copy = _copy_with(tmp_path, "core/binomial.py", "import certkv.model.loading")
    found = import_layers.problems(copy)
    assert any(p.startswith("certkv.core.binomial imports certkv.model.loading") for p in found), found


def test_importing_the_core_imports_no_model_stack():
    """Every core module, imported in a fresh interpreter, leaves torch, transformers and kvpress out."""
    modules = sorted(m for m in import_layers.module_names(PACKAGE) if m.startswith("certkv.core"))
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'kvpress'))\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(modules) >= 9
