"""How much a reader has to walk through: the structural figures issue 39 asked to be measured.

Four numbers, each computed from the tree as it is (nothing is hard-coded)::

    python tools/structure_metrics.py                 # the static figures
    python tools/structure_metrics.py --certify DIR   # also: files on the path of `certkv certify`

- **functions over 60 lines** in ``certkv/`` (``def`` to its last line, docstring included);
- **gate-related types**: classes and protocols in ``certkv/`` whose name says gate (``Gate``,
  ``Gated``) or that live in a module named for gates;
- **tests that sleep**: test files under ``tests/`` that call ``time.sleep``/``asyncio.sleep``
  (waiting for time instead of an event);
- with ``--certify DIR`` (a folder holding a contract YAML whose store is calibrated, such as the
  ``certkv-demo`` folder ``certkv demo`` leaves): the ``certkv/`` files in which some function runs
  while ``certkv certify CONTRACT`` goes from the contract to ``operating_point.json`` — the files a
  reader opens to follow it (module and class bodies, and whatever runs while a certkv module is
  being imported, are not counted).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "certkv"
_GATE_NAME = re.compile(r"gate", re.IGNORECASE)


def long_functions(limit: int = 60) -> list[tuple[str, int]]:
    """(``path:function``, lines) of every function in certkv/ longer than `limit` lines."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > limit:
                    found.append((f"{path.relative_to(REPO)}:{node.name}", length))
    return found


def gate_types() -> list[str]:
    """``path:Class`` for each class named for gates or defined in a module named for gates."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        in_gate_module = bool(_GATE_NAME.search(path.stem))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and (in_gate_module or _GATE_NAME.search(node.name)):
                found.append(f"{path.relative_to(REPO)}:{node.name}")
    return found


def sleeping_tests() -> list[str]:
    """Test files that wait for time (``time.sleep``/``asyncio.sleep``) somewhere in their body."""
    pattern = re.compile(r"\b(time|asyncio)\.sleep\(|^\s*from time import .*\bsleep\b", re.MULTILINE)
    files = sorted((REPO / "tests").rglob("*.py"))
    return [str(p.relative_to(REPO)) for p in files if pattern.search(p.read_text(encoding="utf-8"))]


def certify_path_files(folder: Path) -> list[str]:
    """certkv/ files with a function called while `certkv certify` runs on the contract in `folder`."""
    contracts = sorted(folder.glob("*.yaml"))
    if len(contracts) != 1:
        raise SystemExit(f"--certify {folder}: expected exactly one contract YAML there, found {len(contracts)}")
    seen: set[str] = set()
    root = str(PACKAGE)

    def profile(frame, event, arg):  # noqa: ARG001 - sys.setprofile's signature
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(root) or not code.co_flags & inspect.CO_OPTIMIZED:
            return  # not certkv's, or a module or class body
        outer = frame.f_back
        while outer is not None:  # code that runs while a certkv module is being imported is not counted
            if outer.f_code.co_name == "<module>" and outer.f_code.co_filename.startswith(root):
                return
            outer = outer.f_back
        seen.add(code.co_filename)

    from certkv.cli.app import main

    old_cwd, old_argv = Path.cwd(), sys.argv
    os.chdir(folder)
    sys.argv = ["certkv", "certify", contracts[0].name, "--output", str(folder / "metrics-operating-point.json")]
    sys.setprofile(profile)
    try:
        main()
    except SystemExit as exc:
        if exc.code:
            raise
    finally:
        sys.setprofile(None)
        sys.argv = old_argv
        os.chdir(old_cwd)
        (folder / "metrics-operating-point.json").unlink(missing_ok=True)
    return sorted(str(Path(f).relative_to(REPO)) for f in seen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--certify", type=Path, help="a folder with one calibrated contract (e.g. certkv-demo)")
    parser.add_argument("--list", action="store_true", help="list the items behind each count")
    args = parser.parse_args()
    figures = {
        "functions over 60 lines in certkv/": [f"{name} ({n})" for name, n in long_functions()],
        "gate-related types": gate_types(),
        "test files that sleep": sleeping_tests(),
    }
    if args.certify:
        sys.path.insert(0, str(REPO))
        figures["certkv files run by `certkv certify`"] = certify_path_files(args.certify.resolve())
    for label, items in figures.items():
        print(f"{label}: {len(items)}")
        if args.list:
            for item in items:
                print(f"    {item}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
