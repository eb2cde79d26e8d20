"""The query-aware protocol: the question is prefilled with the context, the press evicts after
seeing it, and only the prompt's last token is fed over the compressed cache.

The engine's answers equal kvpress's own pipeline run on that split of the prompt, token for
token; the operating point records the protocol and a runtime asked for the other one refuses.
"""

from __future__ import annotations

import json

import pytest
import torch

from certkv.errors import CertkvError


@pytest.fixture(scope="module")
def pipe(embedded):
    import kvpress  # noqa: F401  (registers the pipeline)
    from transformers import pipeline

    model, tokenizer = embedded
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")


def _kvpress_answer(pipe, enc, press, max_new_tokens=8):
    """kvpress's pipeline on pre-split ids: its own press hooks over the prefill, its own decode."""
    inputs = {"context_ids": torch.tensor([enc.context_ids]), "questions_ids": [torch.tensor([enc.question_ids])]}
    return pipe._forward(inputs, max_new_tokens=max_new_tokens, press=press)[0]


def test_for_protocol_moves_the_question_into_the_prefill():
    from certkv.model.generation import EncodedRequest, for_protocol

    enc = EncodedRequest(context_ids=[1, 2, 3], question_ids=[7, 8, 9])
    assert for_protocol(enc, False) is enc
    split = for_protocol(enc, True)
    assert split.context_ids == [1, 2, 3, 7, 8] and split.question_ids == [9]
    with pytest.raises(ValueError, match="no tokens"):
        for_protocol(EncodedRequest([1, 2], []), True)


def test_engine_equals_kvpress_pipeline_with_the_question_prefilled(embedded, pipe):
    from certkv.engine.engine import Engine, PressCandidate
    from certkv.model.generation import encode_request, for_protocol
    from certkv.presses.registry import build_press
    from certkv.requests.request_set import generate_requests

    model, tokenizer = embedded
    candidates = [
        PressCandidate(f"{name}@{kv:.2f}", build_press(name, kv), name, kv)
        for name in ("snapkv", "streaming_llm", "knorm", "value_diff")
        for kv in (0.5, 0.2)
    ]
    engine = Engine(model, tokenizer, candidates, max_new_tokens=8, query_aware=True)
    assert engine.fast == candidates
    changed = 0
    for req in generate_requests("all", 6, seed=23, context_length="200-400"):
        enc = for_protocol(encode_request(tokenizer, req.context, req.question), True)
        result = engine.run(req.context, req.question)
        assert result.context_length == len(enc.context_ids)
        assert result.full.answer == _kvpress_answer(pipe, enc, None)
        for cand, got in zip(candidates, result.candidates):
            assert got.answer == _kvpress_answer(pipe, enc, cand.press), (req.id, cand.policy)
            changed += got.answer != result.full.answer
    assert changed > 0, "no answer changed under eviction: the comparison proves little"


def test_seeing_the_question_keeps_what_it_asks_for(embedded):
    """SnapKV at 0.2 on multi-key requests: with the question in its window it keeps the asked
    key's value far more often than when it compresses before the question (fixed seed)."""
    from certkv.engine.engine import Engine, PressCandidate
    from certkv.presses.registry import build_press
    from certkv.requests.request_set import generate_requests

    model, tokenizer = embedded
    requests = generate_requests("demo", 24, seed=99, context_length="256-512")
    kept = {}
    for query_aware in (False, True):
        engine = Engine(model, tokenizer, [PressCandidate("snapkv@0.20", build_press("snapkv", 0.2), "snapkv", 0.2)],
                        max_new_tokens=8, query_aware=query_aware)
        results = [engine.run(r.context, r.question) for r in requests]
        kept[query_aware] = sum(res.candidates[0].answer == res.full.answer for res in results)
    assert kept[True] > kept[False], kept


def test_the_contract_accepts_the_protocol_and_hashes_it(tmp_path):
    from certkv.contract.loading import load_contract
    from certkv.contract.spec import certification_spec

    base = {
        "name": "qa", "model": "embedded", "requests": {"source": "builtin:demo", "limit": 10},
        "utility": "exact_match", "tolerance": 0.0, "risk": 0.1, "confidence": 0.9,
        "policies": [{"press": "snapkv", "kv_retained": [0.5]}],
    }
    hashes = {}
    for flag in (False, True):
        path = tmp_path / f"{flag}.yaml"
        path.write_text(json.dumps({**base, "protocol": {"query_aware": flag}}))
        contract = load_contract(path)
        assert contract.protocol.query_aware is flag
        assert certification_spec(contract).query_aware is flag
        hashes[flag] = contract.sha256()
    assert hashes[False] != hashes[True]


def _operating_point(query_aware: bool | None) -> dict:
    """A certified SnapKV@0.5 point (200 lossless requests) under the given protocol (None: unsaid)."""
    from certkv.core.certify import certify
    from certkv.core.loss_table import LossTable
    from certkv.core.spec import CertificationSpec

    records = []
    for i in range(200):
        records.append({"request_id": f"r{i}", "policy": "full", "kv_retained": 1.0, "loss": 0.0})
        records.append({"request_id": f"r{i}", "policy": "snapkv@0.50", "kv_retained": 0.5, "loss": 0.0})
    protocol = {} if query_aware is None else {"query_aware": query_aware}
    spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["snapkv@0.50"]], max_new_tokens=8,
                             **protocol)
    data = certify(LossTable.from_records(records), spec).to_dict()
    assert not data["fallback"]
    return data


def test_the_operating_point_records_the_protocol():
    from certkv.core.operating_point import OperatingPoint

    assert _operating_point(True)["query_aware"] is True
    assert _operating_point(None)["query_aware"] is False
    older = _operating_point(None)
    del older["query_aware"]  # a file written before the protocol was recorded
    assert OperatingPoint.model_validate(older).query_aware is False


def test_a_runtime_refuses_the_other_protocol(embedded):
    from certkv.requests.request_set import generate_requests
    from certkv.runtime.certified_runtime import CertifiedRuntime

    model, tokenizer = embedded
    op = _operating_point(True)
    with pytest.raises(CertkvError, match="calibrated with protocol query_aware: true, not false"):
        CertifiedRuntime(model, tokenizer, op, query_aware=False)
    with pytest.raises(CertkvError, match="calibrated with protocol query_aware: false, not true"):
        CertifiedRuntime(model, tokenizer, _operating_point(False), query_aware=True)
    runtime = CertifiedRuntime(model, tokenizer, op, query_aware=True)
    assert runtime.query_aware is True
    req = generate_requests("demo", 1, seed=4, context_length=300)[0]
    out = runtime.generate(req.context, req.question)
    assert out.decision.mode == "evicted"
    with pytest.raises(CertkvError, match="question is empty"):
        runtime.generate(req.context, "")
