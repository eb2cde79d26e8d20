"""What every response-aware press's test checks the same way: calibration's engine, the runtime and
a plain gathered cache give one answer (tests/presses/test_deferkv.py, test_lorekv.py, test_behavior_preserving.py)."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import DynamicCache


def gathered_answer(model, full_cache, kept, enc, max_new_tokens: int = 8) -> list[int]:
    """Greedy answer from a cache holding only the `kept` indices of each layer (positions from n_ctx)."""
    from certkv.model.generation import greedy_decode

    cache = DynamicCache()
    for layer, index in enumerate(kept):
        keys, values = full_cache.layers[layer].keys, full_cache.layers[layer].values
        idx = index.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        cache.update(keys.gather(2, idx), values.gather(2, idx), layer)
    ids = greedy_decode(model, cache, enc.question_ids, len(enc.context_ids), max_new_tokens)
    assert ids is not None
    return ids


def engine_and_runtime_agree(embedded, name: str, kv: float, kwargs: dict[str, Any], requests) -> None:
    """The press at `kv` answers every request alike in the engine, the runtime (an operating point
    that certifies it) and a greedy decode from its kept entries; some answer leaves the full one."""
    from certkv.core.certify import certify
    from certkv.core.loss_table import LossTable
    from certkv.core.spec import CertificationSpec
    from certkv.engine.engine import Engine, PressCandidate
    from certkv.engine.full_cache import prefill_full
    from certkv.model.generation import encode_request, stop_token_ids
    from certkv.presses.registry import build_press
    from certkv.runtime.certified_runtime import CertifiedRuntime

    model, tokenizer = embedded
    policy = f"{name}@{kv:.2f}"
    press = build_press(name, kv, kwargs)
    engine = Engine(model, tokenizer, [PressCandidate(policy, press, name, kv)], max_new_tokens=8)
    assert engine.response_aware == engine.candidates and not engine.slow
    rows = [{"request_id": f"r{i}", "policy": p, "kv_retained": k, "loss": 0.0}
            for i in range(200) for p, k in (("full", 1.0), (policy, kv))]
    table = LossTable.from_records(rows)
    op = certify(table, CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[[policy]], max_new_tokens=8))
    runtime = CertifiedRuntime(model, tokenizer, op.model_copy(update={"press": name, "press_kwargs": dict(kwargs)}))
    assert runtime.single_prefill
    differ = 0
    for req in requests:
        got = engine.run(req.context, req.question)
        (candidate,) = got.candidates
        enc = encode_request(tokenizer, req.context, req.question)
        cache, _, _ = prefill_full(model, enc.context_ids, observers=[press])
        kept = press.select(model, cache, enc, stop_token_ids(model))
        assert candidate.token_ids == gathered_answer(model, cache, kept, enc), req.id
        out = runtime.generate(req.context, req.question)
        assert out.token_ids == candidate.token_ids and out.decision.mode == "evicted", req.id
        assert out.decision.kv_retained_actual == pytest.approx(candidate.kv_retained_actual)
        differ += candidate.answer != got.full.answer
    assert differ > 0, f"no answer changed under eviction at {kv}: the comparison proves little"
