"""calibrate → certify a contract whose candidates store their KV in formats (``kv_cost: bytes``).

A tiny contract (4-bit integers in groups of 16 with a full-precision window of 32 tokens, an int
ladder over nbits 8 → 4, StreamingLLM × fp8 and a 16-bit SnapKV; transformers' quanto and HQQ
formats are checked in tests/kv_formats, whose libraries cost seconds to import) is calibrated on
the embedded model into a temporary store; the records carry peak and KV-time bytes, and the
operating point's bytes, format and engine setting are recomputed from the store, as is the choice
(least mean peak bytes among the certified candidates).

This folder is torch-free (tests/conftest.py) and this file calibrates a model: it is marked
``model`` itself, imports the model stack only inside its fixture, and is deselected by
``-m "not model"`` like every other model test.
"""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import yaml

pytestmark = pytest.mark.model

CONTRACT = {
    "name": "formats",
    "model": "embedded",
    "requests": {"source": "builtin:demo", "limit": 24, "seed": 3, "context_length": "128-256"},
    "protocol": {"max_new_tokens": 8, "device": "cpu"},
    "utility": "exact_match",
    "tolerance": 0.0,
    "risk": 0.3,  # lenient: a formatted candidate with a few violations certifies
    "confidence": 0.8,
    "policies": [
        {"cache": {"backend": "int", "nbits": 4, "q_group_size": 16, "residual_length": 32}, "label": "int4w"},
        {"cache": {"backend": "int", "nbits": [8, 4]}},
        {"press": "streaming_llm", "kv_retained": [0.7], "cache": {"backend": "fp8"}},
        {"press": "snapkv", "kv_retained": [0.5]},
    ],
    "store": "store",
}
POLICIES = ["int4w@1.00", "int8@1.00", "int4@1.00", "streaming_llm+fp8e4m3@0.70", "snapkv@0.50"]
#: The embedded model's head size (int formats keep one 16-bit scale per token and head).
HEAD = 32


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, embedded):
    from certkv import workflow
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract

    folder = tmp_path_factory.mktemp("formats")
    (folder / "contract.yaml").write_text(yaml.safe_dump(CONTRACT))
    contract = load_contract(folder / "contract.yaml")
    assert contract.cost_measure == "bytes"
    summary = workflow.calibrate(contract, quiet=True)
    assert summary.calibrated == 24 and not summary.skipped
    with CalibrationStore.read(folder / "store") as store:
        records = store.records()
    return contract, records, workflow.certify(contract).operating_point


def _by_policy(records) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["policy"], []).append(r)
    return out


def test_records_carry_bytes(calibrated):
    _, records, _ = calibrated
    by = _by_policy(records)
    assert sorted(by) == sorted(["full", *POLICIES]) and all(len(rs) == 24 for rs in by.values())
    for r in by["full"]:  # the reference: 16 bits, every token (when it records them at all)
        assert r.get("kv_peak_bytes", 1.0) == 1.0 and r.get("kv_time_bytes", 1.0) == 1.0
    for policy in POLICIES:
        for r in by[policy]:
            assert 0 < r["kv_time_bytes"] <= r["kv_peak_bytes"] <= 1, (policy, r)
            assert r["memory"] == r["kv_peak_bytes"]  # kv_cost: bytes compares candidates by peak bytes
    for policy in ("int4w@1.00", "int8@1.00", "int4@1.00"):
        assert {r["press"] for r in by[policy]} == {"none"}  # precision only: no press
        assert all(r["kv_peak"] == r["kv_time"] == r["kv_retained_actual"] == 1.0 for r in by[policy])
    # Every token stored at once in a per-token format: the bytes are its share (by hand), throughout.
    for policy, bits in (("int8@1.00", 8), ("int4@1.00", 4)):
        share = (bits + 16 / HEAD) / 16
        assert {(r["kv_peak_bytes"], r["kv_time_bytes"]) for r in by[policy]} == {(share, share)}
    # fp8 beside a press: each token kept at half its 16 bits (exactly: a power of two).
    for r in by["streaming_llm+fp8e4m3@0.70"]:
        assert (r["kv_peak_bytes"], r["kv_time_bytes"]) == (r["kv_peak"] / 2, r["kv_time"] / 2)
        assert r["kv_peak"] < 1
    # a window: its tokens cost 1 each, the others (4 + 16/16)/16 = 0.3125.
    assert all(0.3125 < r["kv_peak_bytes"] < 0.5 for r in by["int4w@1.00"])
    # 16 bits: the bytes' shares are the tokens'.
    assert all((r["kv_peak_bytes"], r["kv_time_bytes"]) == (r["kv_peak"], r["kv_time"]) for r in by["snapkv@0.50"])
    # the formats cost answers, or the certification below would choose among equals
    assert sum(r["loss"] for r in by["int4@1.00"]) > 0


def test_operating_point_bytes_and_choice_from_the_store(calibrated):
    from certkv.contract.spec import certification_spec
    from certkv.core.certify import select_candidates
    from certkv.kv_formats.spec import parse_format

    contract, records, op = calibrated
    by = _by_policy(records)
    spec = certification_spec(contract)
    assert not op.fallback, op.reason
    assert [c.policy for c in op.candidates] == POLICIES
    peaks = {p: statistics.fmean(r["kv_peak_bytes"] for r in by[p]) for p in POLICIES}
    times = {p: statistics.fmean(r["kv_time_bytes"] for r in by[p]) for p in POLICIES}
    for c in op.candidates:
        assert c.n == len(by[c.policy]) == 24
        assert c.peak_kv_bytes == pytest.approx(peaks[c.policy], rel=1e-12)
        assert c.mean_kv_bytes == pytest.approx(times[c.policy], rel=1e-12)
        assert c.mean_kv_retained == pytest.approx(peaks[c.policy], rel=1e-12)  # the memory it is ordered by
        assert c.violations == sum(r["loss"] > contract.tolerance for r in by[c.policy])
    assert op.peak_kv_bytes == pytest.approx(peaks[op.policy], rel=1e-12)
    assert op.mean_kv_bytes == pytest.approx(times[op.policy], rel=1e-12)
    # The choice: the least mean peak bytes among the certified (select_candidates on the store's means).
    certified = [c for c in op.candidates if c.certified]
    assert op.policy == min(certified, key=lambda c: peaks[c.policy]).policy
    chosen = select_candidates([c.certified for c in op.candidates], [peaks[p] for p in POLICIES],
                               [c.violations for c in op.candidates])
    assert POLICIES[int(chosen)] == op.policy
    # ... here a format: the point says which, and what to set in an engine
    info = spec.candidate_info[op.policy]
    assert info.kv_format is not None, op.policy
    assert op.kv_format == dict(info.kv_format)
    assert op.engine_setting == parse_format(op.kv_format).engine_counterpart()
    # and it is not the most conservative certified one: the bytes ordered the choice
    assert len(certified) >= 2 and max(peaks[c.policy] for c in certified) > op.peak_kv_bytes
    assert np.isfinite(op.risk_upper_bound) and op.n == 24
