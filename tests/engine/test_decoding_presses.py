"""Decoding-time presses: the engine's generation is kvpress's pipeline's, token for token, and
the KV it reports is what the cache held."""

from __future__ import annotations

import pytest

MAX_NEW = 12


@pytest.fixture(scope="module")
def pipe(embedded):
    import kvpress  # noqa: F401  (registers the pipeline)
    from transformers import pipeline

    model, tokenizer = embedded
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")


def _candidates():
    from certkv.engine.engine import PressCandidate
    from certkv.presses.registry import build_press

    specs = [
        ("compression_ratio_decoding", 0.6, {"base_press": "knorm", "compression_interval": 2}),
        ("compression_ratio_decoding", 0.8, {"base_press": "streaming_llm", "compression_interval": 3}),
        ("prefill_decoding", 0.6, {
            "prefilling_press": {"press": "snapkv", "press_kwargs": {"compression_ratio": 0.3}},
            "decoding_press": {"press": "compression_ratio_decoding",
                               "press_kwargs": {"base_press": "knorm", "compression_interval": 2}},
        }),
    ]
    return [PressCandidate(f"{name}{i}@{kv:.2f}", build_press(name, kv, kwargs), name, kv)
            for i, (name, kv, kwargs) in enumerate(specs)]


@pytest.fixture(scope="module")
def results(embedded):
    from certkv.engine.engine import Engine
    from certkv.requests.request_set import generate_requests

    model, tokenizer = embedded
    engine = Engine(model, tokenizer, _candidates(), max_new_tokens=MAX_NEW)
    requests = generate_requests("demo", 4, seed=808, context_length="100-200")
    return engine, [(r, engine.run(r.context, r.question)) for r in requests]


def test_decoding_presses_answer_as_kvpress_pipeline(results, pipe):
    engine, runs = results
    assert engine.decoding == engine.candidates and not engine.slow and not engine.fast
    differs = 0
    for request, result in runs:
        for cand, got in zip(engine.candidates, result.candidates):
            want = pipe(request.context, question=request.question, press=cand.press, max_new_tokens=MAX_NEW)["answer"]
            assert got.answer == want, (request.id, cand.policy)
            assert got.path == "pipeline"
            differs += got.token_ids != result.full.token_ids
    assert differs >= 3, "the comparison must cover answers the compression changed"


def test_kv_cost_is_what_the_cache_held(results):
    """Compression events shrink the cache: KV-time under 1; the prefill-and-decoding press's
    prefill kept 70% of the context; a run decoded again with held entries recorded gives the
    same cost."""
    from certkv.core.kv_cost import kv_cost
    from certkv.engine.decoding_run import run_decoding
    from certkv.model.generation import encode_request

    engine, runs = results
    for _request, result in runs:
        assert result.full.kv_peak == result.full.kv_time == 1.0
        for cand, got in zip(engine.candidates, result.candidates):
            assert 0 < got.kv_time < 1 and 0 < got.kv_peak <= 1, (cand.policy, got.kv_peak, got.kv_time)
            if cand.press_name == "prefill_decoding":
                assert got.kv_retained_actual == pytest.approx(0.7, abs=0.02)
            else:
                assert got.kv_retained_actual == 1.0
    request, result = runs[0]
    enc = encode_request(engine.tokenizer, request.context, request.question)
    cand = engine.candidates[0]
    run = run_decoding(engine.model, cand.press, enc, MAX_NEW)
    assert run.token_ids == result.candidates[0].token_ids
    assert all(b <= a + 1 for a, b in zip(run.held, run.held[1:]))  # one entry a step at most
    assert any(b < a for a, b in zip(run.held, run.held[1:])), "a compression event must shrink the cache"
    cost = kv_cost(run.held, len(enc.context_ids), len(enc.question_ids))
    assert (cost.peak, cost.time) == (result.candidates[0].kv_peak, result.candidates[0].kv_time)


def test_confidence_up_to_the_first_departure(results):
    """confidence_min_agreeing is the lowest token probability up to and including the first token
    that departs from the full answer: all of it for an identical answer."""
    import math

    engine, runs = results
    for _, result in runs:
        full = result.full.token_ids
        for got in result.candidates:
            d = next((t for t, (a, b) in enumerate(zip(got.token_ids, full)) if a != b), min(len(got.token_ids), len(full)))
            want = math.exp(min(got.logprobs[: d + 1]))
            assert got.confidence_min_agreeing == pytest.approx(want)
            assert got.confidence_min_agreeing >= got.confidence_min


def test_a_windowed_scorer_needs_more_buffered_steps_than_its_window():
    """kvpress asserts mid-decode when SnapKV's window exceeds the hidden states a decoding press
    buffers; certkv says so before decoding (the request is skipped, the runtime uses the full cache)."""
    from certkv.engine.engine import press_precondition_failure
    from certkv.presses.registry import build_press

    short = build_press("compression_ratio_decoding", 0.5, {"base_press": "snapkv", "compression_interval": 16})
    assert "raise compression_interval" in press_precondition_failure(short, 300)
    snap = {"press": "snapkv", "press_kwargs": {"window_size": 8}}
    fits = build_press("compression_ratio_decoding", 0.5, {"base_press": snap, "compression_interval": 16})
    assert press_precondition_failure(fits, 300) is None
