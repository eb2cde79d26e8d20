"""Every answering path through the same gate cases: one gate flow (certkv/runtime/gate_flow.py).

One request on the embedded model is answered in-process by every path: the engine's single
prefill (fresh, and from its context kept in a prefix cache), kvpress's pipeline hooks and a
decoding-time press, each behind gates whose outcome is certain whatever the model answers:

* ``passes``: a confidence bound of 0 never fires: the press's answer, the ungated path's;
* ``pre_decode``: an agreement-drop threshold of 10 always fires (D ≤ 1): the full answer, no
  evicted decode (the decoding path never measures the drop; an unmeasured signal fires);
* ``post_decode``: a confidence bound of 1 fires (an answer has a token of p < 1): the evicted
  answer escalates to the full answer;
* ``recompute``: a recompute threshold of 1 stops the press's decode at its first token: the
  answer restarts on the full cache, so it is the full answer (only a decoding-time press's path
  restarts; the runtime refuses the gate for any other).
"""

from __future__ import annotations

import pytest

from certkv.core.signals import empty_signals
from certkv.core.spec import GateSettings
from certkv.runtime.full_path import full_answer_steps
from certkv.runtime.steps import run_alone

MAX_NEW = 8
PATHS = ("single_prefill", "cached_context", "pipeline", "decoding")
CASES = {
    "passes": GateSettings(confidence=0.0),
    "pre_decode": GateSettings(agreement_drop=10.0),
    "post_decode": GateSettings(confidence=1.0),
    "recompute": GateSettings(recompute=1.0),
}
#: What each case's answer is: (reason, mode, escalated, the seconds key that times the case's last answer).
EXPECTED = {
    "passes": (None, "evicted", False, "decode"),
    "pre_decode": ("gate", "full", False, "decode"),
    "post_decode": ("confidence", "full", True, "escalation"),
    "recompute": ("recompute", "full", True, "recompute"),
}


def _path(embedded, kind: str, gate: GateSettings, prefix=None):
    from certkv.model.generation import stop_token_ids
    from certkv.presses.registry import build_press
    from certkv.runtime.decoding_path import DecodingPath
    from certkv.runtime.pipeline import PipelinePath
    from certkv.runtime.single_prefill import SinglePrefillPath

    model, _ = embedded
    stops = stop_token_ids(model)
    if kind == "pipeline":
        return PipelinePath(model, build_press("pyramidkv", 0.4), gate, stops)
    if kind == "decoding":
        press = build_press("compression_ratio_decoding", 0.6, {"base_press": "tova", "compression_interval": 2})
        return DecodingPath(model, press, gate, stops)
    return SinglePrefillPath(model, build_press("snapkv", 0.4), gate, "snapkv@0.40", stops, prefix=prefix)


@pytest.fixture(scope="module")
def enc(embedded):
    from certkv.model.generation import encode_request
    from certkv.requests.request_set import generate_requests

    (request,) = generate_requests("demo", n=1, seed=5151, context_length=(200, 260))
    return encode_request(embedded[1], request.context, request.question)


@pytest.fixture(scope="module")
def full_ids(embedded, enc):
    from certkv.model.generation import stop_token_ids

    model, _ = embedded
    return run_alone(full_answer_steps(model, enc, MAX_NEW, stop_token_ids(model)))


@pytest.fixture(scope="module")
def prefix(embedded, enc):
    """A prefix cache holding the request's compressed context, with the agreement drop its prefill
    recorded (the warming gate reads the drop and never fires)."""
    from certkv.runtime.prefix_cache import PrefixCache, PrefixScope

    scope = PrefixScope(PrefixCache(64))
    warm = _path(embedded, "single_prefill", GateSettings(agreement_drop=-10.0), scope).answer(enc, MAX_NEW, empty_signals())
    assert warm.prefix == "miss" and len(scope.cache) == 1
    return scope


def _compressed(answer) -> bool:
    """Whether an evicted answer was decoded from less than the full KV: its kept share of the
    prefill, or the peak a decoding-time press held (it prefills in full, then compresses)."""
    return answer.kept is not None and min(answer.kept, answer.kv_peak or 1.0) < 1.0


def _answer(embedded, enc, prefix, kind: str, gate: GateSettings):
    path = _path(embedded, kind, gate, prefix if kind == "cached_context" else None)
    signals = empty_signals()
    return path.answer(enc, MAX_NEW, signals), signals


@pytest.fixture(scope="module")
def ungated(embedded, enc, prefix):
    """Each path's answer behind no gate: the press's own answer."""
    return {kind: _answer(embedded, enc, prefix, kind, GateSettings())[0] for kind in PATHS}


@pytest.mark.parametrize(
    ("kind", "case"),
    [(kind, case) for kind in PATHS for case in CASES if case != "recompute" or kind == "decoding"],
)
def test_every_path_runs_the_same_gate_cases(embedded, enc, full_ids, prefix, ungated, kind, case):
    from certkv.runtime.gate_flow import AnsweringPath

    answer, signals = _answer(embedded, enc, prefix, kind, CASES[case])
    reason, mode, escalated, timed = EXPECTED[case]
    assert isinstance(_path(embedded, kind, GateSettings()), AnsweringPath)
    assert (answer.reason, answer.mode, answer.escalated) == (reason, mode, escalated)
    assert answer.ids == (ungated[kind].ids if case == "passes" else full_ids)
    assert timed in answer.seconds and ("escalation" in answer.seconds) == (case == "post_decode")
    assert answer.prefix == ("hit" if kind == "cached_context" else None)
    assert answer.recomputed_at == (0 if case == "recompute" else None)
    if case in ("passes", "post_decode"):  # the evicted answer was decoded to its end and read
        assert signals["confidence_min"] is not None and signals["confidence_min"] < 1.0
    if case == "passes":
        assert _compressed(answer)


def test_the_ungated_paths_answer_from_their_press(ungated, full_ids):
    """The ungated answers are the presses' (evicted, from less than the full KV): the `passes` case
    compares with them; the kept context's answer is the fresh prefill's (the prefix cache's rule)."""
    assert all(a.mode == "evicted" and _compressed(a) for a in ungated.values())
    assert ungated["cached_context"].ids == ungated["single_prefill"].ids
    assert ungated["cached_context"].prefix == "hit"
