"""The runtime on the engine's single-prefill path: a gated request is prefilled once.

Every gate kind is set so that it sends every request to the full cache (before the evicted decode
for the agreement drop, the lookahead mass and a pre-decode learned score; after it, as an
escalation, for the certificate, the confidence and a learned score that reads the confidence):
the request must still be prefilled exactly once, and its answer must be the full cache's, the one
a fallback operating point gives (which calibration records as ``full``).
"""

from __future__ import annotations

import pytest

from certkv.requests.request_set import generate_requests

N_REQUESTS = 4


@pytest.fixture(scope="module")
def requests():
    return generate_requests("demo", n=N_REQUESTS, seed=4243, context_length=(200, 320))


def _operating_point(press, kv, policy, gate, fallback=False):
    from certkv.core.operating_point import ContractSummary, OperatingPoint

    return OperatingPoint(
        policy=policy, base_policy=policy, press=press, kv_retained=kv, mean_kv_retained=kv, fallback=fallback,
        contract=ContractSummary(tolerance=0.0, risk=0.5, confidence=0.9, procedure="fixed_sequence"),
        n=N_REQUESTS, violations=0, empirical_risk=0.0, risk_upper_bound=0.5, p_value=0.01,
        candidates=[], sequences=[], guarantee="test", created="now", certkv_version="test", gate=gate,
        max_new_tokens=8,
    )


class _Prefills:
    """Counts the decoder's forward calls over `length` tokens (the context prefill)."""

    def __init__(self, model):
        self.model, self.length, self.calls = model, None, 0

    def __enter__(self):
        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None and ids.shape[1] == self.length:
                self.calls += 1

        self.handle = self.model.model.register_forward_pre_hook(hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def _learned(features, coef, intercept):
    from certkv.core.spec import LearnedGate

    n = len(features)
    return LearnedGate(features=features, mean=[0.0] * n, scale=[1.0] * n, coef=coef, intercept=intercept)


def _always_full_gates():
    """(name, press, gate dict, expected reason, escalated): every request goes to the full cache."""
    pre = _learned(["lookahead[0]", "log_context_tokens"], [0.0, 0.0], 5.0)  # score ≈ 0.993 > 0.5
    post = _learned(["confidence_min", "logprob_mean"], [0.0, 0.0], 5.0)
    return [
        ("agreement_drop", "snapkv", {"agreement_drop": 1e9}, "gate", False),
        ("lookahead", "snapkv", {"lookahead": 0.0}, "lookahead", False),
        ("learned", "snapkv", {"learned": pre, "learned_threshold": 0.5}, "learned", False),
        ("confidence", "snapkv", {"confidence": 1.0}, "confidence", True),
        ("learned_post", "snapkv", {"learned": post, "learned_threshold": 0.5}, "learned", True),
        ("certificate", "probabilistic", {"certificate": 1e-9}, "certificate", True),
        ("lookahead_probabilistic", "probabilistic", {"lookahead": 0.0}, "lookahead", False),
    ]


@pytest.mark.parametrize("name, press, gate, reason, escalated", _always_full_gates(),
                         ids=[g[0] for g in _always_full_gates()])
def test_a_gated_request_is_prefilled_once(embedded, requests, name, press, gate, reason, escalated):
    from certkv.model.generation import encode_request
    from certkv.runtime.certified_runtime import CertifiedRuntime

    model, tok = embedded
    full = CertifiedRuntime(model, tok, _operating_point("full", 1.0, "full", None, fallback=True))
    runtime = CertifiedRuntime(model, tok, _operating_point(press, 0.4, f"{press}@0.40+{name}", gate))
    assert runtime.single_prefill
    for request in requests:
        with _Prefills(model) as prefills:
            prefills.length = len(encode_request(tok, request.context, request.question).context_ids)
            out = runtime.generate(request.context, request.question)
        d = out.decision
        assert prefills.calls == 1, (name, request.id)
        assert (d.mode, d.reason, d.escalated) == ("full", reason, escalated)
        assert d.kv_retained == d.kv_retained_actual == 1.0
        assert out.token_ids == full.generate(request.context, request.question).token_ids
        assert ("escalation" in out.seconds) == escalated and out.seconds["prefill"] > 0
        assert ("probe" in out.seconds) == runtime.gate.needs_lookahead
        if escalated:  # the evicted answer was decoded and judged on its signals
            assert d.confidence_min is not None and 0 < d.confidence_min <= 1
        if runtime.gate.needs_lookahead:
            assert len(d.lookahead_heads) == model.config.num_hidden_layers * model.config.num_key_value_heads
            assert d.lookahead_mass == max(d.lookahead_heads)


def test_an_ungated_request_is_prefilled_once_and_records_its_confidence(embedded, requests):
    from certkv.model.generation import encode_request
    from certkv.runtime.certified_runtime import CertifiedRuntime

    model, tok = embedded
    runtime = CertifiedRuntime(model, tok, _operating_point("snapkv", 0.4, "snapkv@0.40", None))
    for request in requests:
        with _Prefills(model) as prefills:
            prefills.length = len(encode_request(tok, request.context, request.question).context_ids)
            out = runtime.generate(request.context, request.question)
        d = out.decision
        assert prefills.calls == 1
        assert (d.mode, d.reason, d.gate_kind) == ("evicted", None, None)
        assert 0 < d.confidence_min <= 1 and d.logprob_mean <= 0
        assert d.lookahead_mass is None and d.agreement_drop is None


def test_a_lookahead_gate_on_a_pipeline_press_is_refused(embedded):
    from certkv.errors import CertkvError
    from certkv.runtime.certified_runtime import CertifiedRuntime

    model, tok = embedded
    for gate in ({"lookahead": 0.5}, {"learned": _learned(["lookahead[3]"], [1.0], 0.0), "learned_threshold": 0.5}):
        with pytest.raises(CertkvError, match="lookahead probe") as info:
            CertifiedRuntime(model, tok, _operating_point("pyramidkv", 0.5, "pyramidkv@0.50+look", gate))
        assert "\n" not in str(info.value)
    # the same press with a gate it can run keeps kvpress's own path
    runtime = CertifiedRuntime(model, tok, _operating_point("pyramidkv", 0.5, "pyramidkv@0.50+conf", {"confidence": 0.5}))
    assert not runtime.single_prefill
