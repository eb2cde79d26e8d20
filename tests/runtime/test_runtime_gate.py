"""Issue 5 on the embedded model: gate signal in the engine's prefill, the probabilistic press on the
one-prefill path, escalation, and the runtime's decisions against the engine's records."""

from __future__ import annotations

import math

import pytest

from certkv.requests.request_set import generate_requests

N_REQUESTS = 12


@pytest.fixture(scope="module")
def requests():
    return generate_requests("demo", n=N_REQUESTS, seed=4242, context_length=(200, 320))


@pytest.fixture(scope="module")
def engine_results(embedded, requests):
    from certkv.engine.engine import Engine, PressCandidate
    from certkv.presses.deterministic_head import DeterministicHeadPress
    from certkv.presses.probabilistic import ProbabilisticPress
    from certkv.presses.registry import build_press

    model, tok = embedded
    candidates = [
        PressCandidate("snapkv@0.30", build_press("snapkv", 0.3), "snapkv", 0.3),
        PressCandidate("probabilistic@0.50", ProbabilisticPress(compression_ratio=0.5, seed=3), "probabilistic", 0.5),
        PressCandidate("probabilistic@0.20", ProbabilisticPress(compression_ratio=0.8, seed=3), "probabilistic", 0.2),
        PressCandidate("pi_one@0.40", ProbabilisticPress(compression_ratio=0.6, head_share=1.0), "probabilistic", 0.4),
        PressCandidate("deterministic@0.40", DeterministicHeadPress(compression_ratio=0.6), "deterministic_head", 0.4),
    ]
    engine = Engine(model, tok, candidates, max_new_tokens=8, agreement={})
    return [engine.run(r.context, r.question) for r in requests]


def _answer(result, policy):
    return next(c for c in result.candidates if c.policy == policy)


def test_engine_agreement_drop_equals_eager_attention(embedded, requests, engine_results):
    """The drop recorded inside the engine's sdpa prefill equals one computed from eager attention
    weights of a separate full forward (docs/design.md: W = 32, k = 32, first/last ⌊L/3⌋ layers)."""
    import torch

    from certkv.model.generation import encode_request
    from certkv.signals.agreement import agreement_drop, layer_agreements

    model, tok = embedded
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        for request, result in zip(requests[:4], engine_results[:4]):
            ids = encode_request(tok, request.context, request.question).context_ids
            with torch.no_grad():
                out = model.model(input_ids=torch.tensor([ids]), output_attentions=True)
            per_layer = [float(layer_agreements(a[:, :, -32:, :], 32)[0]) for a in out.attentions]
            assert result.agreement_drop == pytest.approx(agreement_drop(per_layer), abs=1e-5)
    finally:
        model.set_attn_implementation(previous)
    drops = [r.agreement_drop for r in engine_results]
    assert len(set(round(d, 6) for d in drops)) > 1, "the signal must vary across requests"


def test_probabilistic_press_at_pi_one_equals_deterministic(engine_results):
    for result in engine_results:
        sampled, deterministic = _answer(result, "pi_one@0.40"), _answer(result, "deterministic@0.40")
        assert sampled.token_ids == deterministic.token_ids
        assert sampled.certificate_max == 0.0
        assert sampled.kv_retained_actual == pytest.approx(deterministic.kv_retained_actual)
        assert deterministic.certificate_max is None


def test_sampled_candidates_carry_certificates_and_target_retention(engine_results):
    for policy, target in (("probabilistic@0.50", 0.5), ("probabilistic@0.20", 0.2)):
        kept = [_answer(r, policy).kv_retained_actual for r in engine_results]
        certs = [_answer(r, policy).certificate_max for r in engine_results]
        assert abs(sum(kept) / len(kept) - target) < 0.03
        assert all(c > 0 and math.isfinite(c) for c in certs)
    # less KV, larger survey error (on average over requests)
    mean = lambda p: sum(_answer(r, p).certificate_max for r in engine_results) / len(engine_results)  # noqa: E731
    assert mean("probabilistic@0.20") > mean("probabilistic@0.50")


def test_engine_probabilistic_path_equals_kvpress_hooks(embedded, requests, engine_results):
    """The one-prefill batched path answers as the press run through kvpress's own hooks, one
    request at a time under the Hájek attention, with the same certificate maximum."""
    import torch
    from transformers import DynamicCache

    from certkv.model.generation import encode_request, greedy_decode
    from certkv.presses.hajek_attention import certificate_max, use_hajek_attention
    from certkv.presses.hajek_state import clear_states, kept_fraction
    from certkv.presses.probabilistic import ProbabilisticPress

    model, tok = embedded
    press = ProbabilisticPress(compression_ratio=0.8, seed=3)
    for request, result in zip(requests, engine_results):
        enc = encode_request(tok, request.context, request.question)
        cache = DynamicCache()
        with torch.no_grad(), use_hajek_attention(model):
            with press(model):
                model.model(input_ids=torch.tensor([enc.context_ids]), past_key_values=cache)
            kept = kept_fraction(model)
            ids = greedy_decode(model, cache, enc.question_ids, len(enc.context_ids), 8)
            cert = certificate_max(model)
        clear_states(model)
        record = _answer(result, "probabilistic@0.20")
        assert ids == record.token_ids
        assert kept == pytest.approx(record.kv_retained_actual)
        assert cert == pytest.approx(record.certificate_max, rel=1e-4)


def _operating_point(press, kv, policy, gate):
    from certkv.core.operating_point import ContractSummary, OperatingPoint

    return OperatingPoint(
        policy=policy, base_policy=policy, press=press, kv_retained=kv, mean_kv_retained=kv, fallback=False,
        contract=ContractSummary(tolerance=0.0, risk=0.5, confidence=0.9, procedure="fixed_sequence"),
        n=N_REQUESTS, violations=0, empirical_risk=0.0, risk_upper_bound=0.5, p_value=0.01,
        candidates=[], sequences=[], guarantee="test", created="now", certkv_version="test",
        gate=gate,
    )


@pytest.mark.parametrize("bound, expect", [(1e-9, "always"), (1e9, "never")])
def test_escalation_tiny_bound_always_infinite_never(embedded, requests, engine_results, bound, expect):
    from certkv.presses.probabilistic import ProbabilisticPress
    from certkv.runtime.certified_runtime import CertifiedRuntime

    model, tok = embedded
    op = _operating_point("probabilistic", 0.5, "probabilistic@0.50+cert", {"certificate": bound})
    runtime = CertifiedRuntime(model, tok, op, press=ProbabilisticPress(compression_ratio=0.5, seed=3))
    for request, result in zip(requests[:5], engine_results[:5]):
        out = runtime.generate(request.context, request.question)
        if expect == "always":
            assert out.decision.escalated and out.decision.mode == "full" and out.decision.reason == "certificate"
            assert out.token_ids == result.full.token_ids
            assert out.decision.kv_retained_actual == 1.0
        else:
            assert not out.decision.escalated and out.decision.mode == "evicted"
            assert out.token_ids == _answer(result, "probabilistic@0.50").token_ids


def test_runtime_decisions_equal_the_engine_records(embedded, requests, engine_results):
    """Gate at the median drop and a certificate bound at the median certificate: every request's
    runtime decision and answer is the one the records imply."""
    from certkv.presses.probabilistic import ProbabilisticPress
    from certkv.presses.registry import build_press
    from certkv.runtime.certified_runtime import CertifiedRuntime

    model, tok = embedded
    drops = sorted(r.agreement_drop for r in engine_results)
    threshold = (drops[len(drops) // 2 - 1] + drops[len(drops) // 2]) / 2
    certs = sorted(_answer(r, "probabilistic@0.50").certificate_max for r in engine_results)
    bound = (certs[len(certs) // 2 - 1] + certs[len(certs) // 2]) / 2
    setups = [
        ("snapkv@0.30", "snapkv", 0.3, build_press("snapkv", 0.3), {"agreement_drop": threshold}),
        ("probabilistic@0.50", "probabilistic", 0.5, ProbabilisticPress(compression_ratio=0.5, seed=3),
         {"agreement_drop": threshold, "certificate": bound}),
    ]
    seen = {"gate": 0, "certificate": 0, None: 0}
    for policy, press_name, kv, press, gate in setups:
        runtime = CertifiedRuntime(model, tok, _operating_point(press_name, kv, policy, gate), press=press)
        for request, result in zip(requests, engine_results):
            record = _answer(result, policy)
            out = runtime.generate(request.context, request.question)
            d = out.decision
            assert d.agreement_drop == pytest.approx(result.agreement_drop, abs=1e-6)
            gated = result.agreement_drop < threshold
            escalated = not gated and "certificate" in gate and record.certificate_max > bound
            expected = result.full if gated or escalated else record
            assert out.token_ids == expected.token_ids, (policy, request.id, d)
            assert d.reason == ("gate" if gated else "certificate" if escalated else None)
            assert d.escalated == escalated
            if not gated and "certificate" in gate and not escalated:
                assert d.certificate_max == pytest.approx(record.certificate_max, rel=1e-4)
            if escalated:  # the peak up to the first step above the bound: above it, at most the answer's
                assert bound < d.certificate_max <= record.certificate_max * (1 + 1e-4)
            if d.mode == "evicted":
                assert d.kv_retained_actual == pytest.approx(record.kv_retained_actual)
            seen[d.reason] += 1
    assert all(seen.values()), f"every kind of decision should occur on these requests: {seen}"


def test_probabilistic_batches_split_by_memory_give_the_same_answers(embedded, requests, engine_results):
    from certkv.engine.engine import Engine, PressCandidate
    from certkv.presses.probabilistic import ProbabilisticPress

    model, tok = embedded
    candidates = [
        PressCandidate("probabilistic@0.50", ProbabilisticPress(compression_ratio=0.5, seed=3), "probabilistic", 0.5),
        PressCandidate("probabilistic@0.20", ProbabilisticPress(compression_ratio=0.8, seed=3), "probabilistic", 0.2),
    ]
    engine = Engine(model, tok, candidates, max_batch_bytes=1)  # one lane per batch
    for request, result in zip(requests[:3], engine_results[:3]):
        alone = engine.run(request.context, request.question)
        for c in alone.candidates:
            assert c.token_ids == _answer(result, c.policy).token_ids
            assert c.certificate_max == pytest.approx(_answer(result, c.policy).certificate_max, rel=1e-4)


def test_runtime_refuses_bad_input_with_one_line_errors(embedded, requests):
    from certkv.errors import CertkvError
    from certkv.presses.probabilistic import ProbabilisticPress
    from certkv.presses.registry import build_press
    from certkv.runtime.certified_runtime import CertifiedRuntime

    model, tok = embedded
    op = _operating_point("snapkv", 0.5, "snapkv@0.50", None)
    op.max_new_tokens = 8
    with pytest.raises(CertkvError, match="compression_ratio"):
        CertifiedRuntime(model, tok, op, press=build_press("snapkv", 0.3))
    with pytest.raises(CertkvError, match="certifies press 'snapkv'"):
        CertifiedRuntime(model, tok, op, press=build_press("knorm", 0.5))
    with pytest.raises(CertkvError, match="kvpress press object"):
        CertifiedRuntime(model, tok, op, press="snapkv")
    with pytest.raises(CertkvError, match="differs from the 8"):
        CertifiedRuntime(model, tok, op, max_new_tokens=16)
    with pytest.raises(CertkvError, match="positive integer"):
        CertifiedRuntime(model, tok, op, max_new_tokens=0)
    with pytest.raises(CertkvError, match="question must be a string"):
        CertifiedRuntime(model, tok, op).generate(requests[0].context, None)
    escalating = _operating_point("snapkv", 0.5, "snapkv@0.50+cert1", {"certificate": 1.0})
    with pytest.raises(CertkvError, match="only certkv's probabilistic press"):
        CertifiedRuntime(model, tok, escalating, press=build_press("snapkv", 0.5))
    with pytest.raises(CertkvError, match="operating point"):
        CertifiedRuntime(model, tok, {"policy": "snapkv@0.50"})
    sampled = _operating_point("probabilistic", 0.5, "probabilistic@0.50+cert1", {"certificate": 1.0})
    assert CertifiedRuntime(model, tok, sampled, press=ProbabilisticPress(compression_ratio=0.5)).bound == 1.0


def test_runtime_falls_back(embedded, requests):
    from certkv.runtime.certified_runtime import CertifiedRuntime

    model, tok = embedded
    fallback = _operating_point("full", 1.0, "full", None)
    fallback.fallback = True
    out = CertifiedRuntime(model, tok, fallback).generate(requests[0].context, requests[0].question)
    assert out.decision.mode == "full" and out.decision.reason == "fallback"
