"""The single-prefill fast path answers exactly as kvpress's own pipeline, token for token."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def pipe(embedded):
    import kvpress  # noqa: F401  (registers the pipeline)
    from transformers import pipeline

    model, tokenizer = embedded
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")


def _candidates(ratios):
    from kvpress import KnormPress, RandomPress, SnapKVPress, StreamingLLMPress, TOVAPress

    from certkv.engine.engine import PressCandidate

    out = []
    for kv in ratios:
        for name, cls, kwargs in [
            ("snapkv", SnapKVPress, {}),
            ("streaming_llm", StreamingLLMPress, {}),
            ("knorm", KnormPress, {}),
            ("tova", TOVAPress, {}),
            ("random", RandomPress, {"seed": 11}),
        ]:
            out.append(PressCandidate(f"{name}@{kv:.2f}", cls(compression_ratio=round(1 - kv, 6), **kwargs), name, kv))
    return out


def test_fast_path_matches_kvpress_pipeline(embedded, pipe, monkeypatch):
    from certkv.engine import batched_decode
    from certkv.engine.engine import Engine
    from certkv.requests.request_set import generate_requests

    compactions = []
    real_compact = batched_decode._Decoding.compact

    def spying(self):
        before = list(self.lanes)
        real_compact(self)
        if self.lanes != before:
            compactions.append((before, list(self.lanes)))

    monkeypatch.setattr(batched_decode._Decoding, "compact", spying)
    model, tokenizer = embedded
    candidates = _candidates([1.0, 0.9, 0.6, 0.4, 0.2, 0.1])
    engine = Engine(model, tokenizer, candidates, max_new_tokens=8)
    assert not engine.slow, "every press here is score-based and must take the fast path"
    requests = generate_requests("all", 8, seed=31337, context_length="200-512")
    distinct = set()
    for req in requests:
        result = engine.run(req.context, req.question)
        assert result.full.answer == pipe(req.context, question=req.question, max_new_tokens=8)["answer"]
        for cand, got in zip(candidates, result.candidates):
            want = pipe(req.context, question=req.question, press=cand.press, max_new_tokens=8)["answer"]
            assert got.answer == want, (req.id, cand.policy)
            assert got.path == "fast"
            distinct.add((req.id, got.answer))
            expected_kept = max(1, int(result.context_length * cand.kv_retained + 1e-9))
            assert abs(got.kv_retained_actual * result.context_length - expected_kept) <= 1
    # The comparison must cover answers that differ from the full-KV answer, or it proves little.
    assert len(distinct) > 2 * len(requests)
    # ... and batches compacted with lanes moved within their buffers, not just truncated.
    assert any(after != before[: len(after)] for before, after in compactions), compactions


def test_non_scorer_press_takes_the_pipeline_path(embedded, pipe):
    from kvpress import AdaKVPress, SnapKVPress

    from certkv.engine.engine import Engine, PressCandidate
    from certkv.requests.request_set import generate_requests

    model, tokenizer = embedded
    press = AdaKVPress(SnapKVPress(compression_ratio=0.6))
    engine = Engine(model, tokenizer, [PressCandidate("adakv@0.40", press, "adakv", 0.4)], max_new_tokens=8)
    assert engine.slow and not engine.fast
    for req in generate_requests("demo", 3, seed=5, context_length=300):
        got = engine.run(req.context, req.question).candidates[0]
        want = pipe(req.context, question=req.question, press=press, max_new_tokens=8)["answer"]
        assert got.answer == want and got.path == "pipeline"
        assert 0.3 < got.kv_retained_actual < 0.5


def test_chunked_candidate_batches_give_the_same_answers(embedded, monkeypatch):
    import certkv.engine.engine as engine_module
    from certkv.engine.engine import Engine
    from certkv.requests.request_set import generate_requests

    model, tokenizer = embedded
    candidates = _candidates([0.7, 0.3])
    whole = Engine(model, tokenizer, candidates, max_new_tokens=8)
    one_by_one = Engine(model, tokenizer, candidates, max_new_tokens=8, max_batch_bytes=1)
    batches = []
    real = engine_module.padded_cache

    def counting(cache, selections, *args, **kwargs):
        batches.append(len(selections))
        return real(cache, selections, *args, **kwargs)

    monkeypatch.setattr(engine_module, "padded_cache", counting)
    for req in generate_requests("demo", 3, seed=8, context_length=300):
        batches.clear()
        a = whole.run(req.context, req.question)
        assert batches == [len(candidates)]
        batches.clear()
        b = one_by_one.run(req.context, req.question)
        assert batches == [1] * len(candidates), "a tiny memory budget must decode one candidate at a time"
        assert [c.answer for c in a.candidates] == [c.answer for c in b.candidates]
