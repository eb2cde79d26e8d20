"""The engine's recorded gate signals on the embedded model: per-token log-probabilities of every
answer (all three decode paths) and the lookahead probe's attention mass on evicted entries, each
checked against a plain transformers computation."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

A = 2  # lookahead tokens


def _candidates():
    from kvpress import AdaKVPress, SnapKVPress, StreamingLLMPress

    from certkv.engine.engine import PressCandidate
    from certkv.presses.registry import build_press

    return [
        PressCandidate("snapkv@0.50", SnapKVPress(compression_ratio=0.5), "snapkv", 0.5),
        PressCandidate("streaming_llm@0.30", StreamingLLMPress(compression_ratio=0.7), "streaming_llm", 0.3),
        PressCandidate("snapkv@1.00", SnapKVPress(compression_ratio=0.0), "snapkv", 1.0),
        PressCandidate("probabilistic@0.50", build_press("probabilistic", 0.5), "probabilistic", 0.5),
        PressCandidate("adakv@0.40", AdaKVPress(SnapKVPress(compression_ratio=0.6)), "adakv", 0.4),
    ]


def _requests(n=3, seed=41):
    from certkv.requests.request_set import generate_requests

    return generate_requests("demo", n, seed=seed, context_length="250-400")


@pytest.fixture(scope="module")
def runs(embedded):
    """(request, encoded request, result without signals-only settings, result with the probe)."""
    from certkv.engine.engine import Engine
    from certkv.model.generation import encode_request

    model, tokenizer = embedded
    plain = Engine(model, tokenizer, _candidates(), max_new_tokens=8)
    probed = Engine(model, tokenizer, _candidates(), max_new_tokens=8, lookahead_tokens=A)
    out = []
    for req in _requests():
        enc = encode_request(tokenizer, req.context, req.question)
        out.append((req, enc, plain.run(req.context, req.question), probed.run(req.context, req.question)))
    return out


def _prefill(model, context_ids, press=None):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad(), press(model) if press is not None else _null():
        model.model(input_ids=torch.as_tensor([context_ids]), past_key_values=cache)
    return cache


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _teacher_forced_logprobs(model, cache, question_ids, answer, start):
    """log_softmax of each answer token after feeding question + answer[:-1] over `cache`."""
    fed = list(question_ids) + list(answer[:-1])
    positions = torch.arange(start, start + len(fed)).view(1, -1)
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor([fed]), past_key_values=cache, position_ids=positions,
                       logits_to_keep=len(answer)).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)[torch.arange(len(answer)), torch.as_tensor(answer)].tolist()


def test_signals_leave_every_answer_unchanged(runs):
    for _, _, plain, probed in runs:
        assert probed.full.token_ids == plain.full.token_ids
        assert [c.token_ids for c in probed.candidates] == [c.token_ids for c in plain.candidates]
        assert {c.path for c in probed.candidates} == {"fast", "pipeline"}
        assert "lookahead" in probed.seconds


def test_logprobs_equal_a_plain_forward_on_every_path(embedded, runs):
    from certkv.core.gate_features import answer_confidence

    model, _ = embedded
    candidates = {c.policy: c for c in _candidates()}
    for _, enc, _, result in runs:
        n_ctx = len(enc.context_ids)
        answers = [result.full] + [c for c in result.candidates if c.policy != "probabilistic@0.50"]
        for answer in answers:
            press = None if answer.policy == "full" else candidates[answer.policy].press
            cache = _prefill(model, enc.context_ids, press)
            want = _teacher_forced_logprobs(model, cache, enc.question_ids, answer.token_ids, n_ctx)
            low, mean = answer_confidence(want)
            assert answer.confidence_min == pytest.approx(low, rel=1e-4, abs=1e-6), answer.policy
            assert answer.logprob_mean == pytest.approx(mean, rel=1e-4, abs=1e-6), answer.policy


def test_probabilistic_logprobs_equal_a_teacher_forced_hajek_forward(embedded):
    from certkv.engine.probabilistic_decode import decode_probabilistic, gathered_cache, selection_hooks
    from certkv.model.generation import encode_request, stop_token_ids
    from certkv.presses.hajek_attention import use_hajek_attention
    from certkv.presses.hajek_state import clear_states, set_state
    from certkv.presses.probabilistic import attention_modules
    from certkv.presses.registry import build_press

    model, tokenizer = embedded
    press = build_press("probabilistic", 0.5)
    for req in _requests(2, seed=43):
        enc = encode_request(tokenizer, req.context, req.question)
        n_ctx = len(enc.context_ids)
        sampled: dict = {}
        from transformers import DynamicCache

        cache = DynamicCache()
        with torch.no_grad(), selection_hooks(model, {"p": press}, sampled):
            model.model(input_ids=torch.as_tensor([enc.context_ids]), past_key_values=cache)
        logprobs: list = [None]
        (result,) = decode_probabilistic(model, cache, [sampled["p"]], enc.question_ids, n_ctx, 8,
                                         stop_token_ids(model), logprobs=logprobs)
        assert logprobs[0] == result.logprobs and len(result.logprobs) == len(result.token_ids)
        batch, states = gathered_cache(cache, [sampled["p"]], n_ctx)
        try:
            for module, state in zip(attention_modules(model), states):
                set_state(module, state)
            with use_hajek_attention(model):
                want = _teacher_forced_logprobs(model, batch, enc.question_ids, result.token_ids, n_ctx)
        finally:
            clear_states(model)
        assert result.logprobs == pytest.approx(want, abs=1e-4)


def test_answer_confidence():
    from certkv.core.gate_features import answer_confidence

    low, mean = answer_confidence([-0.1, -2.0, 0.0])
    assert low == pytest.approx(math.exp(-2.0)) and mean == pytest.approx(-0.7)
    with pytest.raises(ValueError):
        answer_confidence([])


def _brute_force_weights(eager_model, enc, answer):
    """Eager attention weights (layers, q_heads, A+1, n_ctx) of the probe's query positions, from
    one plain forward of context + question + the answer's first A tokens."""
    n_ctx, q_len = len(enc.context_ids), len(enc.question_ids)
    seq = list(enc.context_ids) + list(enc.question_ids) + list(answer[:A])
    with torch.no_grad():
        out = eager_model(input_ids=torch.as_tensor([seq]), output_attentions=True)
    rows = [n_ctx + q_len - 1 + j for j in range(A + 1)]
    return torch.stack([a[0][:, rows, :n_ctx] for a in out.attentions]).double()


def _brute_force_mass(weights, kept_mask, n_kv_heads):
    """Per KV head (layer-major) the max over its query heads and positions of the evicted weight."""
    layers, q_heads = weights.shape[:2]
    out = []
    for layer in range(layers):
        for h in range(n_kv_heads):
            group = range(h * (q_heads // n_kv_heads), (h + 1) * (q_heads // n_kv_heads))
            evicted = ~kept_mask[layer][h]
            out.append(max(float(weights[layer, q, p][evicted].sum()) for q in group for p in range(A + 1)))
    return out


@pytest.fixture(scope="module")
def eager_model():
    from certkv.model.loading import load_model

    model, _ = load_model("embedded", device="cpu", attn_implementation="eager")
    return model


def test_probe_reads_the_full_answers_first_tokens_under_sdpa_and_eager(embedded, eager_model, runs):
    from certkv.model.generation import stop_token_ids
    from certkv.signals.lookahead import lookahead_probe

    model, _ = embedded
    for _, enc, _, result in runs:
        n_ctx = len(enc.context_ids)
        want = _brute_force_weights(eager_model, enc, result.full.token_ids)
        for m in (model, eager_model):
            cache = _prefill(m, enc.context_ids)
            probe = lookahead_probe(m, cache, enc.question_ids, n_ctx, A, stop_ids=stop_token_ids(m))
            assert cache.get_seq_length() == n_ctx, "the probe crops the cache back to the context"
            assert probe.token_ids == result.full.token_ids[: A + 1]
            assert probe.weights.shape == want.shape
            torch.testing.assert_close(probe.weights.double(), want, atol=1e-5, rtol=0)


def test_evicted_mass_equals_brute_force_eager_attention(embedded, eager_model, runs):
    from certkv.engine.probabilistic_decode import selection_hooks
    from certkv.engine.scoring import Selections, scoring_hooks
    from certkv.signals.lookahead import evicted_mass, lookahead_probe

    model, _ = embedded
    candidates = _candidates()
    fast = {c.policy: c.press for c in candidates[:3]}  # the score-based ones (fast path)
    n_kv = model.config.num_key_value_heads
    for _, enc, _, result in runs:
        n_ctx = len(enc.context_ids)
        weights = _brute_force_weights(eager_model, enc, result.full.token_ids)
        from transformers import DynamicCache

        selections, sampled, cache = Selections(), {}, DynamicCache()
        with (torch.no_grad(), scoring_hooks(model, fast, selections),
              selection_hooks(model, {"p": candidates[3].press}, sampled)):
            model.model(input_ids=torch.as_tensor([enc.context_ids]), past_key_values=cache)
        probe = lookahead_probe(model, cache, enc.question_ids, n_ctx, A)
        by_policy = {c.policy: c for c in result.candidates}
        for policy, kept in selections.by_candidate.items():
            masks = []
            for layer in kept:
                m = torch.zeros(n_kv, n_ctx, dtype=torch.bool)
                if layer is None:
                    m[:] = True
                else:
                    m.scatter_(1, layer[0], True)
                masks.append(m)
            want = _brute_force_mass(weights, masks, n_kv)
            assert evicted_mass(probe.weights, kept, n_kv) == pytest.approx(want, abs=1e-5), policy
            # ... and the engine recorded the same for this candidate.
            assert by_policy[policy].lookahead_heads == pytest.approx(want, abs=1e-5), policy
            assert by_policy[policy].lookahead_mass == max(by_policy[policy].lookahead_heads)
        # A probabilistic selection: padding slots (valid False) are not kept.
        masks = []
        for sel in sampled["p"]:
            m = torch.zeros(n_kv, n_ctx, dtype=torch.bool)
            for h in range(n_kv):
                m[h, sel.indices[0, h][sel.valid[0, h]]] = True
            masks.append(m)
        want = _brute_force_mass(weights, masks, n_kv)
        assert evicted_mass(probe.weights, sampled["p"], n_kv) == pytest.approx(want, abs=1e-5)
        pairs = [(s.indices, s.valid) for s in sampled["p"]]
        assert evicted_mass(probe.weights, pairs, n_kv) == pytest.approx(want, abs=1e-5)
        assert by_policy["adakv@0.40"].lookahead_heads is None  # pipeline path: kept indices unknown
        assert by_policy["adakv@0.40"].confidence_min is not None


def test_keep_everything_has_no_evicted_mass_and_keep_nothing_has_all(embedded, runs):
    from certkv.signals.lookahead import evicted_mass, lookahead_probe

    model, _ = embedded
    n_kv = model.config.num_key_value_heads
    n_layers = model.config.num_hidden_layers
    _, enc, _, result = runs[0]
    n_ctx = len(enc.context_ids)
    assert next(c for c in result.candidates if c.policy == "snapkv@1.00").lookahead_heads == [0.0] * (n_layers * n_kv)
    probe = lookahead_probe(model, _prefill(model, enc.context_ids), enc.question_ids, n_ctx, A)
    everything = [torch.arange(n_ctx).expand(1, n_kv, n_ctx) for _ in range(n_layers)]
    assert evicted_mass(probe.weights, everything, n_kv) == [0.0] * (n_layers * n_kv)
    assert evicted_mass(probe.weights, [None] * n_layers, n_kv) == [0.0] * (n_layers * n_kv)
    nothing = [torch.zeros((1, n_kv, 0), dtype=torch.long) for _ in range(n_layers)]
    groups = model.config.num_attention_heads // n_kv
    total = probe.weights.double().sum(-1).view(n_layers, n_kv, groups * probe.weights.shape[2]).amax(-1)
    assert evicted_mass(probe.weights, nothing, n_kv) == pytest.approx(total.flatten().tolist(), abs=1e-6)


def _contract(tmp_path, gate):
    from certkv.contract.loading import parse_contract
    from certkv.requests.request_set import write_jsonl

    write_jsonl(_requests(2, seed=47), tmp_path / "requests.jsonl")
    data = {
        "name": "signals", "model": "embedded", "requests": {"source": "requests.jsonl"},
        "protocol": {"max_new_tokens": 8, "device": "cpu"}, "utility": "exact_match", "tolerance": 0.0,
        "risk": 0.1, "confidence": 0.9, "store": "store",
        "policies": [{"press": "snapkv", "kv_retained": [0.5]},
                     {"press": "adakv", "press_kwargs": {"press": "knorm"}, "kv_retained": [0.5]}],
        "gate": gate,
    }
    return parse_contract(data, base_dir=tmp_path)


def test_calibration_stores_the_signals_its_gate_reads(tmp_path):
    from certkv.calibration.run import calibrate
    from certkv.calibration.store import CalibrationStore

    lookahead = _contract(tmp_path, {"pilot": 0.25, "lookahead": {"quantiles": [0.1]}})
    summary = calibrate(lookahead, quiet=True)
    assert summary.calibrated == 2
    with CalibrationStore.read(lookahead.resolved_store_path()) as store:
        rows = {(r["request_id"], r["policy"]): r for r in store.records()}
    for (_, policy), row in rows.items():
        assert 0 < row["confidence_min"] <= 1 and row["logprob_mean"] <= 0
        assert row.get("agreement_drop") is None  # nothing reads it: not computed
        if policy == "snapkv@0.50":
            assert len(row["lookahead_heads"]) == 4 and row["lookahead_mass"] == max(row["lookahead_heads"])
        else:  # the full cache, and the pipeline path (kept indices unknown)
            assert row.get("lookahead_heads") is None and row.get("lookahead_mass") is None
        if policy == "full":
            assert row["context_tokens"] > 0 and "lookahead" in row["seconds_breakdown"]
