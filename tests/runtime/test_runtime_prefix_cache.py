"""Compress once, answer many: a question-agnostic point answers repeated contexts from its prefix cache.

A cached runtime and an uncached one answer the same repeated-context traffic (several questions
about each multi_key haystack): ids and decisions must be equal, with the hits and misses the
traffic implies; the same in-process and through ``certkv serve``'s scheduler under a KV budget
that the kept contexts count against. The cache's bytes are recomputed from the model's shapes.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from scheduler_checks import TOL

from certkv.core.operating_point import ContractSummary, OperatingPoint
from certkv.errors import CertkvError
from certkv.requests.builtin_tasks import multi_key
from certkv.runtime.certified_runtime import CertifiedRuntime
from certkv.runtime.prefix_cache import PrefixCache, PrefixEntry, PrefixReserve, context_key

#: Splits the embedded model's multi_key haystacks of 256 tokens at SnapKV 0.25 three ways: the
#: agreement drop fires on seed 0's context (before any decode), the confidence bound escalates most
#: answers of seeds 1 and 2, and one of seed 1's answers is kept.
GATE = {"agreement_drop": -0.05, "confidence": 0.5}


def _point(kv=0.25, gate=None, press="snapkv", **update) -> OperatingPoint:
    policy = f"{press}@{kv:.2f}"
    op = OperatingPoint(
        policy=policy, base_policy=policy, press=press, kv_retained=kv, mean_kv_retained=kv, fallback=False,
        contract=ContractSummary(tolerance=0.0, risk=0.5, confidence=0.9, procedure="fixed_sequence",
                                 utility="agreement"),
        n=4, violations=0, empirical_risk=0.0, risk_upper_bound=0.5, p_value=0.01, candidates=[], sequences=[],
        guarantee="test", created="now", certkv_version="test", gate=gate, max_new_tokens=8,
    )
    return op.model_copy(update=update)


def _traffic(seeds=(0, 1, 2), questions=4, length=256) -> list[tuple[str, str]]:
    """`questions` questions about each seed's multi_key haystack, interleaved across contexts."""
    samples = [multi_key(random.Random(seed), length) for seed in seeds]
    return [(s.context, s.qa[i][0]) for i in range(questions) for s in samples]


def _same(a, b) -> None:
    assert b.token_ids == a.token_ids
    da, db = a.decision.to_dict(), b.decision.to_dict()
    for key, value in da.items():
        if isinstance(value, float):
            assert db[key] == pytest.approx(value, rel=TOL, abs=TOL), key
        else:
            assert db[key] == value, key


@pytest.mark.parametrize("gate", [None, GATE], ids=["ungated", "drop-and-confidence"])
def test_cached_answers_equal_the_uncached_runtime(embedded, gate):
    traffic = _traffic()
    plain = CertifiedRuntime(*embedded, _point(gate=gate))
    cache = PrefixCache(4)
    cached = CertifiedRuntime(*embedded, _point(gate=gate), prefix_cache=cache)
    answers = [(plain.generate(c, q), cached.generate(c, q)) for c, q in traffic]
    for a, b in answers:
        _same(a, b)
        assert a.prefix_cache is None
    assert [b.prefix_cache for _, b in answers] == ["miss"] * 3 + ["hit"] * 9
    assert (cache.hits, cache.misses, cache.evictions, len(cache)) == (9, 3, 0, 3)
    if gate is not None:  # every branch of the gate was taken from kept contexts
        hits = [b.decision for _, b in answers[3:]]
        assert {d.reason for d in hits} == {"gate", "confidence", None}
        assert any(d.escalated for d in hits)


def test_the_cache_holds_what_the_press_kept_and_evicts_the_least_recently_used(embedded):
    model, tokenizer = embedded
    cfg = model.config
    op = _point(kv=0.5)
    sizes = []
    for context in {c for c, _ in _traffic(questions=1)}:
        n = len(tokenizer(context, add_special_tokens=False)["input_ids"])  # bounds the entry from above
        sizes.append(n)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    one = PrefixCache(1)
    runtime = CertifiedRuntime(model, tokenizer, op, prefix_cache=one)
    runtime.generate(*_traffic(seeds=(1,), questions=1)[0])
    (entry,) = one._entries.values()
    kept = math.ceil(0.5 * entry.context_length)  # kvpress keeps n - int(n * ratio)
    assert kept == entry.keys[0].shape[2] and one.bytes == kept * per_token == entry.nbytes
    assert entry.slots == kept and entry.kept == kept / entry.context_length
    # room for two entries: the third context evicts the least recently used (seed 1 was used last)
    two = PrefixCache(2.5 * one.bytes / (1 << 20))
    runtime = CertifiedRuntime(model, tokenizer, op, prefix_cache=two)
    (c0, q0), (c1, q1), (c2, q2) = _traffic(seeds=(0, 1, 2), questions=1)
    for c, q in ((c0, q0), (c1, q1), (c0, q0), (c2, q2), (c0, q0), (c1, q1)):
        runtime.generate(c, q)
    assert (two.hits, two.misses, two.evictions) == (2, 4, 2)


def test_the_key_is_the_exact_context_and_the_stratum():
    entry = PrefixEntry(3, [torch.zeros(1, 1, 2, 4)], [torch.zeros(1, 1, 2, 4)], 2 / 3)
    cache = PrefixCache(1)
    assert cache.put(context_key("", [1, 2, 3]), entry)
    assert cache.lookup(context_key("", [1, 2, 3])) is entry
    assert cache.lookup(context_key("", [1, 2, 4])) is None and cache.lookup(context_key("", [1, 2])) is None
    assert cache.lookup(context_key("", [1, 2, 3, 0])) is None  # no padding makes two contexts alike
    assert cache.lookup(context_key("other stratum", [1, 2, 3])) is None
    assert cache.bytes == entry.nbytes == 2 * 2 * 4 * 4 and cache.slots == entry.slots == 2
    # a waiting request reserves the copy of a kept context, else its prefill and the entry it will keep
    copy = PrefixReserve(cache, context_key("", [1, 2, 3]), room=5, miss=100, keep=40)
    assert (copy.slots, copy.prefills, copy.kept_room) == (2 + 5, False, 0)
    fresh = PrefixReserve(cache, context_key("", [9]), room=5, miss=100, keep=40)
    assert (fresh.slots, fresh.prefills, fresh.kept_room) == (140, True, 40)
    cache.kv_budget = 120  # never more than the budget: the entry then gets what is left
    assert (fresh.slots, fresh.kept_room) == (120, 20)
    cache.kv_budget = 50  # the prefill alone exceeds it: the scheduler refuses the request
    assert fresh.slots == 100
    limited = PrefixCache(1)
    limited.limit = lambda: 1.5  # what a KV budget leaves beside the requests in flight: not 2 slots
    assert not limited.put(context_key("", [1, 2, 3]), entry) and len(limited) == 0 and limited.refused == 1
    with pytest.raises(CertkvError, match="positive number of MiB"):
        PrefixCache(0)


@pytest.mark.parametrize(("update", "why"), [
    ({"query_aware": True}, "query-aware"),
    ({"gate": {"lookahead": 0.5}}, "lookahead probe"),
    ({"press": "full", "fallback": True, "reason": "test"}, "full cache"),
    ({"press": "pyramidkv"}, "kvpress's pipeline"),
    ({"press": "probabilistic"}, "probabilistic press"),
    ({"press": "compression_ratio_decoding", "press_kwargs": {"base_press": "tova", "compression_interval": 2}},
     "while the answer decodes"),
])
def test_points_that_cannot_reuse_a_context_say_why_and_answer_as_without_it(embedded, update, why):
    op = _point(**update)
    cache = PrefixCache(4)
    runtime = CertifiedRuntime(*embedded, op, prefix_cache=cache)
    refusal = runtime.prefix_cache_refusal()
    assert why in refusal and "\n" not in refusal and runtime.prefix is None
    assert runtime.prefix_bypassed() == {op.policy: runtime.prefix_bypass}
    if "press" in update:
        return
    context, question = _traffic(seeds=(1,), questions=1)[0]
    a = CertifiedRuntime(*embedded, op).generate(context, question)
    for b in (runtime.generate(context, question), runtime.generate(context, question)):
        _same(a, b)
        assert b.prefix_cache is None
    assert (cache.hits, cache.misses, len(cache)) == (0, 0, 0)


def test_a_stratified_point_keeps_each_stratums_contexts_apart_and_names_the_bypassed_ones(embedded):
    from certkv.core.operating_point import StrataResult

    entries = {"agnostic": _point(), "aware": _point(query_aware=True)}
    op = _point().model_copy(update={"policy": "stratified", "base_policy": "stratified", "strata": StrataResult(
        by="task", simultaneous=False, confidence=0.9, entries=entries)})
    cache = PrefixCache(4)
    runtime = CertifiedRuntime(*embedded, op, prefix_cache=cache)
    assert runtime.prefix_cache_refusal() is None
    assert list(runtime.prefix_bypassed()) == ["aware"] and "query-aware" in runtime.prefix_bypassed()["aware"]
    assert runtime.strata["agnostic"].prefix.namespace == "agnostic"
    context, question = _traffic(seeds=(1,), questions=1)[0]
    for stratum in ("agnostic", "aware", "agnostic"):
        runtime.generate(context, question, stratum)
    assert (cache.hits, cache.misses) == (1, 1) and [k[0] for k in cache._entries] == ["agnostic"]


def _scheduled(embedded, traffic, op, budget_share):
    """Every request of `traffic` submitted at once to a scheduler under a budget of `budget_share`
    times the largest full-prefill reservation; (answers alone uncached, served answers, cache, scheduler)."""
    from certkv.model.generation import encode_request
    from certkv.runtime.full_path import prefill_slots
    from certkv.serve.scheduler import Scheduler

    alone = [CertifiedRuntime(*embedded, op).generate(c, q) for c, q in traffic]
    cache = PrefixCache(4)
    runtime = CertifiedRuntime(*embedded, op, prefix_cache=cache)
    largest = max(prefill_slots(runtime.model, encode_request(runtime.tokenizer, c, q), runtime.max_new_tokens)
                  for c, q in traffic)
    scheduler = Scheduler(runtime.model, math.ceil(budget_share * largest), prefix_cache=cache)
    futures = [scheduler.submit(runtime.answer_steps(c, q, lean=True)) for c, q in traffic]
    scheduler.start()
    try:
        served = [f.result(timeout=600) for f in futures]
    finally:
        scheduler.shutdown()
    for a, b in zip(alone, served):
        _same(a, b)
    assert 0 < scheduler.peak_kv <= scheduler.budget
    assert cache.hits + cache.misses == len(traffic) == sum(b.prefix_cache in ("hit", "miss") for b in served)
    assert sum(b.prefix_cache == "hit" for b in served) == cache.hits
    return cache, scheduler


@pytest.mark.parametrize("gate", [None, GATE], ids=["ungated", "drop-and-confidence"])
def test_the_scheduler_answers_from_kept_contexts_within_a_budget_they_count_against(embedded, gate):
    cache, _ = _scheduled(embedded, _traffic(questions=4), _point(gate=gate), budget_share=3.0)
    assert cache.hits >= 6  # at most one prefill per context, and one per context admitted meanwhile


def test_under_a_tight_budget_kept_contexts_are_evicted_not_the_requests(embedded):
    # a budget of about one prefill: kept contexts make room for the next context's prefill, yet each
    # context is prefilled once (its prefill reserves the entry it keeps, its questions wait for it)
    cache, scheduler = _scheduled(embedded, _traffic(questions=2), _point(), budget_share=1.05)
    assert cache.evictions > 0 and (cache.hits, cache.misses) == (3, 3)
