"""The Examples sections of the certification modules' docstrings run, and say what they print.

A docstring example that no longer runs teaches the wrong API; running them here keeps the
examples of certify, strata, pilot, gated candidates, gates, candidates, validation and the
contract's spec as true as the tests. Torch-free.
"""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "certkv.core.certify",
    "certkv.core.gate_features",
    "certkv.core.gated",
    "certkv.core.pilot",
    "certkv.core.policy_names",
    "certkv.core.spec",
    "certkv.core.strata",
    "certkv.core.validation",
    "certkv.contract.spec",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed (run pytest -s to see them)"
