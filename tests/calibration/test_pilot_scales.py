"""fp8 scales placed on the pilot: computed before calibration, bound to the store, written by certify.

The scales are recomputed here from their definition (each layer's largest key and value magnitude
over the pilot requests' full prefills, over float8 e4m3's largest value 448), the store's records
must be the ones those scales give (the runtime answers as the store), a store whose placement
requests fall outside the certifier's pilot is refused, and so is a point whose scales were never
placed. Marked ``model`` (this folder is torch-free otherwise).
"""

from __future__ import annotations

import json
import sqlite3

import pytest
import yaml

pytestmark = pytest.mark.model

CONTRACT = {
    "name": "pilot_scales",
    "model": "embedded",
    "requests": {"source": "builtin:demo", "limit": 24, "seed": 9, "context_length": "128-256"},
    "protocol": {"max_new_tokens": 6, "device": "cpu"},
    "utility": "exact_match",
    "tolerance": 0.0,
    "risk": 0.5,
    "confidence": 0.6,
    "policies": [{"cache": {"backend": "fp8", "dtype": "e4m3", "scale": "pilot"}}],
    "gate": {"pilot": 0.25},
    "store": "store",
}


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, embedded):
    from certkv import workflow
    from certkv.contract.loading import load_contract

    folder = tmp_path_factory.mktemp("pilot_scales")
    (folder / "contract.yaml").write_text(yaml.safe_dump(CONTRACT))
    contract = load_contract(folder / "contract.yaml")
    summary = workflow.calibrate(contract, quiet=True, limit=20)  # a preview: 20 of 24, so a small pilot certifies
    assert summary.calibrated == 20
    return contract, folder


def _amax_by_hand(contract, model, tokenizer) -> list[list[float]]:
    import hashlib

    import torch
    from transformers import DynamicCache

    from certkv.model.generation import encode_request

    requests = contract.load_requests()
    ranked = sorted(requests, key=lambda r: hashlib.sha256(f"{contract.requests.seed}:{r.id}".encode()).hexdigest())
    pilot = ranked[: int(0.9 * round(0.25 * len(requests)))]  # the pilot's first ranks (a margin for skips)
    amax = None
    with torch.no_grad():
        for request in pilot:
            enc = encode_request(tokenizer, request.context, request.question)
            cache = DynamicCache()
            model.model(input_ids=torch.tensor([enc.context_ids]), past_key_values=cache)
            seen = [[layer.keys.abs().max().item(), layer.values.abs().max().item()] for layer in cache.layers]
            amax = seen if amax is None else [[max(a, b) for a, b in zip(x, y)] for x, y in zip(amax, seen)]
    return amax


def test_the_scales_are_the_pilots_magnitudes_and_the_point_deploys_them(calibrated, embedded):
    from certkv import workflow
    from certkv.runtime.certified_runtime import CertifiedRuntime

    contract, folder = calibrated
    model, tokenizer = embedded
    conn = sqlite3.connect(folder / "store" / "records.sqlite")
    meta = dict(conn.execute("SELECT key, value FROM meta"))
    amax = json.loads(meta["kv_pilot_amax"])
    by_hand = _amax_by_hand(contract, model, tokenizer)
    assert sum(amax, []) == pytest.approx(sum(by_hand, []), rel=1e-6)
    op = workflow.certify(contract, allow_incomplete=True).operating_point
    assert op.kv_format is not None and op.kv_format["scale"] == "pilot"
    assert sum(op.kv_format["layer_scales"], []) == pytest.approx([x / 448 for x in sum(amax, [])], rel=1e-9)
    assert "calibrated" in op.engine_setting
    records = dict(conn.execute("SELECT request_id, answer FROM records WHERE policy = 'fp8e4m3p@1.00'"))
    runtime = CertifiedRuntime(model, tokenizer, op.model_copy(update={"fallback": False, "policy": "fp8e4m3p@1.00",
                                                                       "base_policy": "fp8e4m3p@1.00", "press": "none"}))
    for request in contract.load_requests():
        if request.id in records:
            assert runtime.generate(request.context, request.question).answer == records[request.id]
    unplaced = op.model_copy(update={"fallback": False, "kv_format": {"backend": "fp8", "scale": "pilot"}})
    with pytest.raises(Exception, match="no fp8 scales"):
        CertifiedRuntime(model, tokenizer, unplaced)


def test_scales_placed_on_a_request_that_certifies_are_refused(calibrated):
    from certkv import workflow
    from certkv.errors import CertkvError

    contract, folder = calibrated
    conn = sqlite3.connect(folder / "store" / "records.sqlite")
    meta = dict(conn.execute("SELECT key, value FROM meta"))
    placed = json.loads(meta["kv_pilot_ids"])
    outside = sorted({r for (r,) in conn.execute("SELECT request_id FROM records")} - set(placed))[0]
    with conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'kv_pilot_ids'", (json.dumps([*placed, outside]),))
    try:
        with pytest.raises(CertkvError, match="recalibrate with `--new-store`"):
            workflow.certify(contract, allow_incomplete=True)
    finally:
        with conn:
            conn.execute("UPDATE meta SET value = ? WHERE key = 'kv_pilot_ids'", (json.dumps(placed),))


def test_a_pilot_scale_needs_a_pilot():
    from certkv.contract.loading import parse_contract
    from certkv.errors import CertkvError

    terms = {k: v for k, v in CONTRACT.items() if k not in ("gate", "store")}
    with pytest.raises(CertkvError, match="set gate.pilot") as info:
        parse_contract(terms)
    assert "\n" not in str(info.value)
