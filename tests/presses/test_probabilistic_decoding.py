"""certkv's probabilistic press while decoding: each event's sampling keeps every slot with the
probability its state records (compound over events), the cache stays in position order and
bounded, the press is reproducible, and at ratio 0 it is the full cache."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")


def _layer(seed: int = 0):
    """A synthetic layer after one earlier event: (1, 2, 40, 4) keys and values, 6 padding slots
    in head 1, a sampled past (log π < 0) on some slots, and positive sizes."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, 2, 40, 4, generator=g), torch.randn(1, 2, 40, 4, generator=g)
    valid = torch.ones(1, 2, 40, dtype=torch.bool)
    valid[0, 1, 28:34] = False  # padding of the earlier event, before the tokens appended since
    log_pi = torch.where(torch.rand(1, 2, 40, generator=g) < 0.4, -torch.rand(1, 2, 40, generator=g), 0.0)
    log_pi[~valid] = 0.0
    sizes = torch.rand(1, 2, 40, generator=g) ** 3
    return keys, values, log_pi, valid, sizes


def test_each_slot_is_kept_with_the_probability_its_state_records():
    """Over 400 seeds, how often each slot survives an event matches exp(new log π − old log π),
    the probability the state records for it (independent of how it was drawn); kept slots are
    valid, in ascending position, with their own keys; the expected count is the budget."""
    from certkv.presses.probabilistic_decoding import ProbabilisticDecodingPress, _Track

    keys, values, log_pi, valid, sizes = _layer()
    draws = 400
    hits = torch.zeros(2, 40)
    recorded = torch.full((2, 40), float("nan"))
    counts = []
    for seed in range(draws):
        press = ProbabilisticDecodingPress(compression_ratio=0.5, n_sink=2, window=4, head_share=0.25, seed=seed)
        k, v, state = press._resample(keys, values, log_pi, valid, sizes, _Track(seen=50), layer_idx=1)
        assert state.n_head == 0 and state.context_length == 50
        counts.append(state.counts[0].tolist())
        for h in range(2):
            n = int(state.counts[0, h])
            assert not bool(state.valid[0, h, n:].any())
            slots = (k[0, h, :n, None] == keys[0, h, None]).all(-1).int().argmax(-1)  # each kept key's slot
            assert bool((slots[1:] > slots[:-1]).all()) and bool(valid[0, h, slots].all())
            assert torch.equal(v[0, h, :n], values[0, h, slots])
            hits[h, slots] += 1
            conditional = (state.log_pi[0, h, :n] - log_pi[0, h, slots]).exp()
            assert bool((conditional <= 1 + 1e-6).all())
            first = torch.isnan(recorded[h, slots])
            recorded[h, slots[first]] = conditional[first]
            torch.testing.assert_close(recorded[h, slots], conditional, atol=1e-6, rtol=0)  # the same π every draw
    seen = ~torch.isnan(recorded)
    freq = hits / draws
    tolerance = 4 * (recorded * (1 - recorded) / draws).sqrt() + 1e-9
    assert bool(((freq - recorded).abs()[seen] <= tolerance[seen]).all())
    assert float(freq[~seen].max()) == 0.0 and not bool(seen[1, 28:34].any())  # padding never kept
    # sinks (first 2 valid) and window (last 4) kept for sure, with their old π
    assert bool((freq[:, :2] == 1).all()) and bool((freq[:, -4:] == 1).all())
    mean_count = torch.tensor(counts, dtype=torch.float64).mean(0)
    assert mean_count.tolist() == pytest.approx([25, 25], abs=0.6)  # compute_n_kept(50, 0.5) = 25


def _recite(embedded_recite, n: int = 2):
    from certkv.model.generation import encode_request
    from certkv.requests.request_set import load_requests

    _, tok = embedded_recite
    return [encode_request(tok, r.context, r.question, r.answer_prefix) for r in load_requests("builtin:recite", limit=n, seed=5)]


def test_ratio_zero_is_the_full_cache(embedded_recite):
    from transformers import DynamicCache

    from certkv.engine.decoding_run import run_decoding
    from certkv.model.generation import greedy_decode
    from certkv.presses.probabilistic_decoding import ProbabilisticDecodingPress

    model, _ = embedded_recite
    enc = _recite(embedded_recite, 1)[0]
    cache = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=torch.tensor([enc.context_ids]), past_key_values=cache)
        want = greedy_decode(model, cache, enc.question_ids, len(enc.context_ids), 40)
    run = run_decoding(model, ProbabilisticDecodingPress(compression_ratio=0.0, compression_interval=4), enc, 40)
    assert run.token_ids == want and run.certificate_max == 0.0
    assert run.held == [len(enc.context_ids) + len(enc.question_ids) + t for t in range(len(want))]


def test_cache_is_bounded_reproducible_and_certified(embedded_recite):
    """kv 0.5, an event every 4 forwards: the held entries fall back to about half the tokens seen
    at each event, the same request gives the same tokens and certificate twice (and after another
    request), and every run's certificate is positive."""
    from certkv.engine.decoding_run import run_decoding
    from certkv.presses.probabilistic_decoding import ProbabilisticDecodingPress

    model, _ = embedded_recite
    first, other = _recite(embedded_recite)
    press = ProbabilisticDecodingPress(compression_ratio=0.5, compression_interval=4, seed=1)
    runs = [run_decoding(model, press, enc, 40) for enc in (first, other, first)]
    assert runs[0].token_ids == runs[2].token_ids and runs[0].held == runs[2].held
    assert runs[0].certificate_max == runs[2].certificate_max > 0 and runs[1].certificate_max > 0
    n_prompt = len(first.context_ids) + len(first.question_ids)
    held = runs[0].held
    assert runs[0].prefill_kept < 0.6 * len(first.context_ids)
    # after the question feed (one forward) the t-th token's forward is forward t + 1
    for t, entries in enumerate(held):
        assert entries < 0.5 * (n_prompt + t) + 4 + 4 * math.sqrt(n_prompt), (t, entries)
    other_seed = run_decoding(model, ProbabilisticDecodingPress(compression_ratio=0.5, compression_interval=4, seed=2),
                              first, 40)
    assert other_seed.held != held  # the seed draws other samples


def test_registry_names_it_a_certified_decoding_press():
    from certkv.errors import CertkvError
    from certkv.presses import registry
    from certkv.presses.probabilistic_decoding import ProbabilisticDecodingPress

    assert registry.compresses_while_decoding("probabilistic_decoding")
    assert registry.produces_certificates("probabilistic_decoding")
    assert not registry.compresses_while_decoding("probabilistic")
    press = registry.build_press("probabilistic_decoding", 0.6, {"compression_interval": 8})
    assert isinstance(press, ProbabilisticDecodingPress) and press.compression_ratio == pytest.approx(0.4)
    with pytest.raises(CertkvError, match="compression_interval must be an integer"):
        registry.build_press("probabilistic_decoding", 0.6, {"compression_interval": 0})
    with pytest.raises(ValueError, match="compress_prefill"):
        ProbabilisticDecodingPress(compress_prefill="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("compress_prefill", [True, False])
def test_each_token_carries_its_step_certificate_and_a_bound_stops_before_it(embedded_recite, compress_prefill):
    """run_decoding reads each step's certificate as its token is chosen: the numbers a decode under
    the press that nobody watches reduces once at the end, one per token, 0 before the press first
    samples (without compress_prefill the prompt is held whole until the event at the 4th forward).
    stop_above stops at the first token whose certificate exceeds it, keeping exactly those before."""
    from contextlib import nullcontext

    from transformers import DynamicCache

    from certkv.engine.decoding_run import compresses_prefill, run_decoding
    from certkv.model.generation import greedy_decode
    from certkv.model.window_queries import capturing_window_queries
    from certkv.presses.hajek_attention import certificate_steps
    from certkv.presses.hajek_state import clear_states
    from certkv.presses.probabilistic_decoding import ProbabilisticDecodingPress

    model, _ = embedded_recite
    enc = _recite(embedded_recite, 1)[0]
    press = ProbabilisticDecodingPress(compression_ratio=0.5, compression_interval=4, seed=1,
                                       compress_prefill=compress_prefill)
    run = run_decoding(model, press, enc, 40)
    cache = DynamicCache()
    try:
        with torch.no_grad():
            with press(model) if compresses_prefill(press) else nullcontext(), capturing_window_queries(model):
                model.model(input_ids=torch.tensor([enc.context_ids]), past_key_values=cache)
            with press(model):
                ids = greedy_decode(model, cache, enc.question_ids, len(enc.context_ids), 40)
                steps = certificate_steps(model)[0]
    finally:
        clear_states(model)
    assert ids == run.token_ids and len(run.certificates) == len(ids)
    unsampled = 0 if compress_prefill else 4
    assert len(steps) == len(ids) - unsampled and all(c > 0 for c in steps)
    assert run.certificates == pytest.approx([0.0] * unsampled + steps, rel=1e-5, abs=1e-7)
    assert run.certificate_max == max(run.certificates)
    # a bound between the running maximum and the last new record: the first token over it is that
    # record (the question's forward, max over its positions, may hold the largest one: then token 0)
    records = [t for t, c in enumerate(run.certificates) if c > max(run.certificates[:t], default=0.0)]
    k = records[-1]
    assert k >= unsampled
    bound = (max(run.certificates[:k], default=0.0) + run.certificates[k]) / 2
    stopped = run_decoding(model, press, enc, 40, stop_above=bound)
    assert stopped.stopped_at == k and stopped.token_ids == run.token_ids[:k]
    assert stopped.certificates == run.certificates[:k] and stopped.logprobs == run.logprobs[:k]
    assert run_decoding(model, press, enc, 40, stop_above=run.certificate_max).stopped_at is None


def test_only_the_probabilistic_press_has_a_certificate_to_stop_on(embedded_recite):
    from certkv.engine.decoding_run import run_decoding
    from certkv.presses.registry import build_press

    model, _ = embedded_recite
    press = build_press("compression_ratio_decoding", 0.6, {"base_press": "knorm", "compression_interval": 4})
    with pytest.raises(ValueError, match="stop_above watches the probabilistic decoding press's certificate"):
        run_decoding(model, press, _recite(embedded_recite, 1)[0], 8, stop_above=0.1)
