"""The Examples sections of the statistics modules run, and say what they show.

Every public function of the binomial tests (Clopper–Pearson), the family-wise procedures
(fixed-sequence, Bonferroni, Holm) and the live risk monitor (Ville's inequality) carries an
example; this runs them all with doctest, so an example that no longer matches the code fails here,
and so does a module that loses its examples. The file-format check, which every reader of a
certkv file calls, is run here too.
"""

from __future__ import annotations

import doctest
import importlib

import pytest

#: Module → the fewest examples it must keep (each ``>>>`` line counts as one).
MODULES = {
    "certkv.core.binomial": 18,
    "certkv.core.procedures": 20,
    "certkv.core.monitor": 19,
    "certkv.core.file_format": 3,
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_example_runs_as_written(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, report=True)
    assert result.failed == 0, f"{result.failed} example(s) of {name} fail (doctest output above)"
    assert result.attempted >= MODULES[name], f"{name} keeps {result.attempted} examples, expected {MODULES[name]}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_public_function_has_an_example(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder()
    with_examples = {test.name.rsplit(".", 1)[-1] for test in finder.find(module) if test.examples}
    public = [attr for attr in getattr(module, "__all__", dir(module))
              if not attr.startswith("_") and callable(getattr(module, attr))
              and getattr(getattr(module, attr), "__module__", None) == name
              and not isinstance(getattr(module, attr), type)]
    missing = sorted(set(public) - with_examples)
    assert not missing, f"{name}: public functions without an Examples section: {missing}"
