"""DeferKV: its kept entries equal a brute-force computation from an eager forward of the whole
prompt, and calibration's engine and the runtime answer from them as a plain gathered cache does."""

from __future__ import annotations

import pytest
import torch
from response_aware_checks import engine_and_runtime_agree
from transformers import DynamicCache

from certkv.errors import CertkvError


def _requests(n=4, seed=41):
    from certkv.requests.request_set import generate_requests

    return generate_requests("demo", n, seed=seed, context_length="200-320")


def _eager(embedded):
    from certkv.model.loading import load_model

    return load_model("embedded", device="cpu", attn_implementation="eager")


def _reference_scores(model, enc, weight):
    """Per layer (H_kv, n_ctx) float64: (1 − w)·norm(−‖k‖) + w·norm(attention of the first decode query).

    The first decode query is the prompt's last position (the question's last token fed over the
    full cache), read from an eager forward of the whole prompt; ‖k‖ from the context's cached keys.
    """
    n_ctx = len(enc.context_ids)
    prompt = torch.tensor([enc.context_ids + enc.question_ids])
    cache = DynamicCache()
    with torch.no_grad():
        out = model.model(input_ids=prompt, past_key_values=cache, output_attentions=True)
    scores = []
    for layer, attention in enumerate(out.attentions):
        keys = cache.layers[layer].keys[0, :, :n_ctx].double()  # (H_kv, n_ctx, d)
        kv_heads = keys.shape[0]
        last = attention[0, :, -1, :n_ctx].double()  # (H, n_ctx)
        decode = last.view(kv_heads, -1, n_ctx).mean(dim=1)
        prompt_side = -keys.norm(dim=-1)
        prompt_side = prompt_side - prompt_side.min(dim=-1, keepdim=True).values
        score = (1 - weight) * prompt_side / prompt_side.sum(-1, keepdim=True) + weight * decode / decode.sum(-1, keepdim=True)
        scores.append(score)
    return scores


def _assert_top_k(kept, score, where, tol=1e-6):
    """`kept` (H_kv, k) is a top-k of `score` (H_kv, n): no entry left out scores above a kept one
    (ties, e.g. the equal key norms of a repeated token, may fall either way)."""
    n = score.shape[-1]
    for head, row in enumerate(kept):
        inside = torch.zeros(n, dtype=torch.bool)
        inside[row] = True
        assert inside.sum() == row.numel(), (where, head, "duplicate indices")
        assert score[head][inside].min() >= score[head][~inside].max() - tol, (where, head)


@pytest.mark.parametrize("weight", [0.0, 0.5, 1.0])
def test_kept_entries_equal_a_brute_force_computation(embedded, weight):
    from kvpress import KnormPress

    from certkv.engine.full_cache import prefill_full
    from certkv.model.generation import encode_request, stop_token_ids
    from certkv.presses.deferkv import DeferKVPress

    model, tokenizer = _eager(embedded)
    press = DeferKVPress(compression_ratio=0.7, prompt_press=KnormPress(), weight=weight)
    for req in _requests():
        enc = encode_request(tokenizer, req.context, req.question)
        cache, _, _ = prefill_full(model, enc.context_ids, observers=[press])
        got = press.select(model, cache, enc, stop_token_ids(model))
        assert cache.get_seq_length() == len(enc.context_ids), "the decode step is cropped away again"
        want = _reference_scores(model, enc, weight)
        for layer, (g, w) in enumerate(zip(got, want)):
            assert g.shape[-1] == max(1, int(len(enc.context_ids) * 0.3))
            _assert_top_k(g[0], w, (req.id, layer))


def test_weight_zero_keeps_what_the_prompt_press_keeps(embedded):
    from certkv.engine.engine import Engine, PressCandidate
    from certkv.presses.deferkv import DeferKVPress
    from certkv.presses.registry import build_press

    model, tokenizer = embedded
    snap, defer = build_press("snapkv", 0.3), DeferKVPress(compression_ratio=0.7, weight=0.0)
    engine = Engine(model, tokenizer, [PressCandidate("snapkv@0.30", snap, "snapkv", 0.3),
                                       PressCandidate("deferkv@0.30", defer, "deferkv", 0.3)], max_new_tokens=8)
    assert engine.response_aware == engine.candidates[1:] and not engine.slow
    for req in _requests():
        a, b = engine.run(req.context, req.question).candidates
        assert a.answer == b.answer and a.kv_retained_actual == b.kv_retained_actual


def test_engine_and_runtime_answer_from_the_kept_entries(embedded):
    engine_and_runtime_agree(embedded, "deferkv", 0.25, {"weight": 0.7, "decode_queries": 2}, _requests(6, seed=8))


def test_kvpress_pipeline_cannot_run_it_and_bad_settings_fail_at_construction(embedded):
    from certkv.presses.deferkv import DeferKVPress

    with pytest.raises(CertkvError, match="certkv's engine only"):
        DeferKVPress(compression_ratio=0.5)(embedded[0])
    with pytest.raises(ValueError, match="weight"):
        DeferKVPress(weight=1.5)
    with pytest.raises(ValueError, match="decode_queries"):
        DeferKVPress(decode_queries=0)


def test_retentions_of_one_press_share_one_scoring(embedded, monkeypatch):
    """Calibration scores a press once per request for all its retentions; the answers are those
    of each retention calibrated alone."""
    from certkv.engine.engine import Engine, PressCandidate
    from certkv.presses.deferkv import DeferKVPress
    from certkv.presses.registry import build_press

    model, tokenizer = embedded
    candidates = [PressCandidate(f"deferkv@{kv:.2f}", build_press("deferkv", kv), "deferkv", kv) for kv in (0.5, 0.3, 0.2)]
    calls = []
    real = DeferKVPress.scores
    monkeypatch.setattr(DeferKVPress, "scores", lambda self, *a: calls.append(1) or real(self, *a))
    together = Engine(model, tokenizer, candidates, max_new_tokens=8)
    for req in _requests(3, seed=12):
        calls.clear()
        joint = together.run(req.context, req.question).candidates
        assert len(calls) == 1
        for c, got in zip(candidates, joint):
            (alone,) = Engine(model, tokenizer, [c], max_new_tokens=8).run(req.context, req.question).candidates
            assert got.token_ids == alone.token_ids, (req.id, c.policy)


def test_one_observer_per_scoring_and_none_at_full_retention():
    """The prefill is watched once per scoring (retentions of a press share it) and not at all by a
    press that evicts nothing (kv_retained 1.0 scores nothing), in the engine and the runtime alike."""
    from certkv.presses.registry import build_press
    from certkv.presses.response_aware import prefill_observers

    half, third = build_press("deferkv", 0.5), build_press("deferkv", 0.3)
    other = build_press("deferkv", 0.5, {"weight": 0.2})
    assert prefill_observers([half, third]) == [half]
    assert prefill_observers([half, other]) == [half, other]
    assert prefill_observers([build_press("deferkv", 1.0)]) == []


def test_each_candidate_is_charged_its_share_of_the_scoring(embedded):
    """The scoring after the prefill is part of a response-aware candidate's cost: the candidates
    sharing it split its time (their seconds sum to at most the request's response_select), and a
    press scored in the prefill is charged nothing for it."""
    from certkv.engine.engine import Engine, PressCandidate
    from certkv.presses.registry import build_press

    model, tokenizer = embedded
    candidates = [PressCandidate(f"deferkv@{kv:.2f}", build_press("deferkv", kv), "deferkv", kv) for kv in (0.5, 0.3)]
    candidates.append(PressCandidate("snapkv@0.50", build_press("snapkv", 0.5), "snapkv", 0.5))
    req = _requests(1, seed=12)[0]
    result = Engine(model, tokenizer, candidates, max_new_tokens=8).run(req.context, req.question)
    deferred = [c.seconds for c in result.candidates if c.press == "deferkv"]
    assert len(deferred) == 2 and all(s > 0 for s in deferred)
    assert deferred[0] == deferred[1] and sum(deferred) <= result.seconds["response_select"]
    assert [c.seconds for c in result.candidates if c.press == "snapkv"] == [0.0]
