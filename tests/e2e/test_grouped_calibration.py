"""Many questions on one context, end to end: calibrate a grouped contract on the embedded model,
certify it over contexts, and recompute the certificate from the stored records by hand."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import yaml
from conftest import run_here
from test_grouped import _betting_by_hand
from test_grouped_certify import _betting_order

from certkv.core.binomial import VIOLATION_EPS

CONTRACT = {
    "name": "grouped",
    "model": "embedded",
    "requests": {"source": "builtin:multi_question", "limit": 128, "seed": 5, "context_length": "96-160",
                 "group_by": "context"},
    "protocol": {"max_new_tokens": 6, "device": "cpu"},
    "utility": "exact_match",
    "tolerance": 0.0,
    "risk": 0.3,
    "confidence": 0.9,
    "policies": [{"press": "streaming_llm", "kv_retained": [0.9, 0.4]}],
    "store": "store",
}


def test_a_grouped_contract_calibrates_and_certifies_over_its_contexts(tmp_path, capsys):
    path = tmp_path / "contract.yaml"
    path.write_text(yaml.safe_dump(CONTRACT))
    assert run_here(capsys, "calibrate", str(path)).returncode == 0
    result = run_here(capsys, "certify", str(path))
    assert result.returncode == 0, result.stderr
    op = json.loads((tmp_path / "store" / "operating_point.json").read_text())

    from certkv.calibration.store import CalibrationStore

    with CalibrationStore.read(tmp_path / "store") as store:
        records = store.records()
    groups = {r["request_id"]: r["group"] for r in records}
    assert len(groups) == 128 and len(set(groups.values())) == op["n_contexts"]
    assert all(r["group"] == r["request_id"].rsplit("-q", 1)[0] for r in records)  # a draw's questions, one group
    for candidate in op["candidates"]:
        k: dict[str, int] = defaultdict(int)
        n: dict[str, int] = defaultdict(int)
        for r in records:
            if r["policy"] == candidate["policy"]:
                n[r["group"]] += 1
                k[r["group"]] += r["loss"] > VIOLATION_EPS
        shares = [k[g] / n[g] for g in sorted(n, key=_betting_order)]  # the order certify bets in
        assert candidate["p_value"] == pytest.approx(_betting_by_hand(shares, 0.3), rel=1e-9)
        assert candidate["n_contexts"] == len(n) and candidate["violations"] == sum(k.values())
        assert candidate["grouped_risk"] == pytest.approx(sum(shares) / len(shares))
    assert op["policy"] == "streaming_llm@0.90", op["reason"]  # the milder retention certifies, the other fails
    assert "each context weighted equally" in op["guarantee"]
