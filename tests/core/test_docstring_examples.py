"""The Examples sections of the torch-free core's docstrings run, and every public name has one.

A docstring example that no longer matches the code teaches the wrong API, so every module of
certkv/core (found by walking the package, so a new module is included without editing this file)
and the contract's spec (certkv/contract/spec.py, torch-free too) is run with doctest here, and
every public function and class it defines (its ``__all__``, or its public names where it has
none) must carry an example. Names a module re-exports are checked in the module that defines
them; a pydantic model's own methods are not required to have one (the class's example shows it).

The statistics modules (the binomial tests, the family-wise procedures, the live monitor and the
file-format check) run without option flags and keep at least the examples they had, so an
example cannot be dropped from them unnoticed.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import certkv.core

MODULES = sorted(
    [f"certkv.core.{info.name}" for info in pkgutil.iter_modules(certkv.core.__path__)] + ["certkv.contract.spec"]
)

#: Statistics module → the fewest examples it must keep (each ``>>>`` line counts as one). These
#: run as written, without ELLIPSIS or whitespace normalisation.
STATISTICS_FLOORS = {
    "certkv.core.binomial": 18,
    "certkv.core.procedures": 20,
    "certkv.core.monitor": 19,
    "certkv.core.file_format": 3,
}

LENIENT = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _public_callables(module) -> list[str]:
    """The functions and classes `module` itself defines and exports."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [name for name in vars(module) if not name.startswith("_")]
    return [
        name
        for name in names
        if callable(getattr(module, name)) and getattr(getattr(module, name), "__module__", None) == module.__name__
    ]


def test_the_walk_finds_the_core():
    assert {"certkv.core.certify", "certkv.core.loss_table", "certkv.core.pilot", *STATISTICS_FLOORS} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_every_example_runs_as_written(name):
    module = importlib.import_module(name)
    flags = 0 if name in STATISTICS_FLOORS else LENIENT
    result = doctest.testmod(module, optionflags=flags, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} example(s) of {name} fail (doctest output above)"
    floor = STATISTICS_FLOORS.get(name, 0)
    assert result.attempted >= floor, f"{name} keeps {result.attempted} examples, expected at least {floor}"


@pytest.mark.parametrize("name", MODULES)
def test_every_public_callable_has_an_example(name):
    module = importlib.import_module(name)
    with_examples = {test.name.removeprefix(f"{name}.") for test in doctest.DocTestFinder().find(module) if test.examples}
    missing = sorted(set(_public_callables(module)) - with_examples)
    assert not missing, f"{name}: public functions or classes without an Examples section: {missing}"
