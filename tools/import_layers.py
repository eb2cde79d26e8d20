"""Import-graph checks for certkv: no cycles between modules or subpackages; a torch-free core.

Every ``import`` counts, including the ones inside function bodies (a lazy import is still a
dependency: it only moves the failure to run time). Run from the repository root::

    python tools/import_layers.py            # exit 1 and one line per problem when any

The test suite runs the same checks (``tests/repo/test_import_layers.py``), so a new cycle fails CI.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

#: What ``certkv.core`` may import from the rest of certkv: small shared helpers only.
CORE_ALLOWED = ("certkv.errors", "certkv.atomic_io", "certkv._version", "certkv._lazy")


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted module name → file, for every ``.py`` under `package_dir` (``__init__`` names its package)."""
    root = package_dir.parent
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that `name` (a module or ``module.attribute``) lies in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """module → the package's modules it imports (anywhere in its body), self-imports left out."""
    modules = module_names(package_dir)
    top = package_dir.name
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        resolved = {_resolve(t, modules) for t in targets if t == top or t.startswith(top + ".")}
        graph[name] = {t for t in resolved if t is not None and t != name}
    return graph


def unit_of(module: str) -> str:
    """The subpackage a module belongs to (``certkv.core.binomial`` → ``certkv.core``); a
    top-level module is its own unit."""
    parts = module.split(".")
    return ".".join(parts[:2])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between subpackages: an edge where any module of one imports any of the other.

    The root package's ``__init__`` is a facade of lazy names and is left out: it imports
    nothing at import time, and every subpackage necessarily sits inside it.
    """
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if "." not in module:
            continue
        source = unit_of(module)
        units.setdefault(source, set()).update(
            unit_of(t) for t in targets if "." in t and unit_of(t) != source
        )
    return units


def problems(package_dir: Path) -> list[str]:
    """One line per problem: module cycles, subpackage cycles, core imports outside the core."""
    graph = import_graph(package_dir)
    out = [f"import cycle between modules: {' <-> '.join(c)}" for c in cycles(graph)]
    out += [f"import cycle between subpackages: {' <-> '.join(c)}" for c in cycles(unit_graph(graph))]
    core = f"{package_dir.name}.core"
    for module, targets in sorted(graph.items()):
        if module == core or module.startswith(core + "."):
            for t in sorted(targets):
                if not (t == core or t.startswith(core + ".") or t in CORE_ALLOWED):
                    out.append(f"{module} imports {t}: the core may import only itself and {', '.join(CORE_ALLOWED)}")
    return out


def main() -> int:
    package_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "certkv"
    found = problems(package_dir)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
