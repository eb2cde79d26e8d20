"""Lazy attribute access for certkv's packages: names resolve to their module on first use.

Each package lists ``name -> (module, attribute)`` and gets a module ``__getattr__`` from
:func:`lazy_getattr`, so importing a package never imports torch, transformers or kvpress.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, table: dict[str, tuple[str, str]]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` that imports `table[name]` when `name` is first used."""

    def __getattr__(name: str) -> Any:
        if name in table:
            module, attr = table[name]
            return getattr(importlib.import_module(module), attr)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
