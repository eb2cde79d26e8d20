"""ruff, configured in pyproject.toml, is clean on the whole repository (CI runs it through pytest)."""

from __future__ import annotations

import shutil
import subprocess
import sys

from conftest import REPO


def test_ruff_is_clean():
    ruff = shutil.which("ruff")
    command = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    proc = subprocess.run([*command, "check", "--no-cache", str(REPO)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


#: Every function of the package stays short: each long step gets a name of its own.
MAX_FUNCTION_LINES = 60


def test_no_function_in_the_package_is_over_60_lines():
    import ast

    long = []
    for path in sorted((REPO / "certkv").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these into named steps: " + "; ".join(long)
