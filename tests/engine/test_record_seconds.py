"""The seconds each store record carries (certkv/calibration/run.py ``request_records``): a pipeline
candidate its own run, a gathered candidate decoded as a lane its own share, a gathered candidate of
the padded fast path its share of ``candidates_fast`` (split among those alone), the full cache its
prefill and decode."""

from __future__ import annotations

import pytest
from conftest import REPO


def test_each_record_carries_its_own_seconds_once():
    from certkv.calibration.run import request_records
    from certkv.contract.loading import load_contract
    from certkv.engine.engine import CandidateAnswer, RequestResult
    from certkv.requests.request_set import Request

    contract = load_contract(REPO / "contracts" / "embedded_long.yaml")
    request = Request(id="r1", task="recite", context="c", question="q", answers=["a b c"])

    def answer(policy: str, path: str, seconds: float, own: bool = False) -> CandidateAnswer:
        return CandidateAnswer(policy, policy.split("@")[0], 0.5, 0.5, "a b c", [1, 2, 3], path, seconds, own_seconds=own)

    result = RequestResult(
        full=answer("full", "full", 0.0),
        candidates=[answer("tova_decoding@0.50", "pipeline", 0.4), answer("snapkv@0.50", "fast", 0.25, own=True),
                    answer("snapkv@0.70", "fast", 0.01), answer("snapkv@0.30", "fast", 0.0)],
        seconds={"prefill": 0.1, "full_decode": 0.2, "candidates_decoding": 0.65, "candidates_fast": 0.3},
    )
    seconds = {record["policy"]: record["seconds"] for record in request_records(request, result, contract, {})}
    assert seconds["full"] == pytest.approx(0.3)
    assert seconds["tova_decoding@0.50"] == pytest.approx(0.4)
    assert seconds["snapkv@0.50"] == pytest.approx(0.25)  # its share of the lanes, not of candidates_fast
    assert seconds["snapkv@0.70"] == pytest.approx(0.15 + 0.01)  # half of candidates_fast, plus its own scoring
    assert seconds["snapkv@0.30"] == pytest.approx(0.15)
