"""`certkv calibrate` refuses a stratified contract whose requests do not all give their stratum:
one line, exit 2, nothing created. Run in this process (the refusal comes before any model loads,
but the command imports torch, so these live outside the torch-free tests/core)."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import run_main

CONTRACT = {
    "name": "strata",
    "requests": {"source": "requests.jsonl"},
    "utility": "exact_match",
    "tolerance": 0.0,
    "risk": 0.05,
    "confidence": 0.95,
    "policies": [{"press": "snapkv", "kv_retained": [0.7, 0.5]}],
    "strata": {"by": "task"},
    "store": "store",
}


@pytest.mark.parametrize(
    "lines,match",
    [
        ([{"task": "a"}, {}], "request 'r1' does not give it"),
        ([{}, {}], "no request has this field"),
        ([{"task": "a"}, {"task": " "}], "empty value"),
    ],
)
def test_calibrate_refuses_requests_without_their_stratum(tmp_path, lines, match, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(
        json.dumps({"id": f"r{i}", "context": f"context {i}", "question": "q?", "answers": ["a"], **extra}) + "\n"
        for i, extra in enumerate(lines)))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(CONTRACT, sort_keys=False))
    assert run_main("calibrate", str(path)) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1
    assert not (tmp_path / "store").exists()
