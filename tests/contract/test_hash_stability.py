"""A contract that uses no new feature keeps its hash: stores and results stay bound to it.

`benchmarks/results/smollm2_ruler.json` recorded the sha256 of `contracts/smollm2_ruler.yaml` when
it was certified, before KV formats existed; the contract is unchanged since, so the hash that
certkv computes today must be that one (a new optional key written as null would change it, and
every existing store would then refuse its contract).
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_contract_without_formats_hashes_as_before_them():
    from certkv.contract.loading import load_contract

    recorded = json.loads((REPO / "benchmarks" / "results" / "smollm2_ruler.json").read_text())["certified"]["contract_sha256"]
    assert load_contract(REPO / "contracts" / "smollm2_ruler.yaml").sha256() == recorded


def test_a_format_changes_the_hash():
    from certkv.contract.loading import parse_contract

    terms = {"name": "h", "requests": {"source": "builtin:all"}, "utility": "exact_match", "tolerance": 0.0,
             "risk": 0.1, "confidence": 0.9, "policies": [{"press": "snapkv", "kv_retained": [0.5]}]}
    plain = parse_contract(terms)
    formatted = parse_contract({**terms, "policies": [{"press": "snapkv", "kv_retained": [0.5], "cache": {"backend": "fp8"}}]})
    assert '"cache"' not in plain.canonical_json() and plain.sha256() != formatted.sha256()
