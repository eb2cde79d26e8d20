"""kvpress's strongest presses on the embedded model: each runs through certkv with the answers of
kvpress's own pipeline, or a contract naming it is refused at load with one line saying why.

KVzap, fast KVzip and RestoreKV score with weights trained per base model (downloaded from the
Hugging Face hub by the model's name), none of which exist for the embedded model; DuoAttention has
no retention setting; PyramidKV's layers of different lengths cannot take a multi-token feed, so it
runs under the query-aware protocol only (docs/design.md, "Data flow", its two protocols).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_main

from certkv.contract.spec import candidates
from certkv.errors import CertkvError

#: The presses of the issue (registry names).
LEADERS = ("kvzip", "fastkvzip", "kvzap", "restorekv", "expected_attention", "keydiff", "adakv", "pyramidkv",
           "duo_attention", "tova", "criticalkv")

#: Presses that run question-agnostic: press_kwargs, the engine's path, retentions, requests (seed, n).
RUNS = {
    "tova": ({}, "fast", (0.5, 0.2), (3, 5)),
    "keydiff": ({}, "fast", (0.5, 0.2), (3, 5)),
    "expected_attention": ({}, "fast", (0.5, 0.2), (3, 5)),
    "criticalkv": ({"press": "snapkv"}, "fast", (0.5, 0.2), (3, 5)),
    "adakv": ({"press": "snapkv"}, "pipeline", (0.5, 0.2), (3, 5)),
    # KVzip replays the context to score it (2-3 prefills) and holds up to low retentions.
    "kvzip": ({}, "pipeline", (0.1, 0.02), (3, 3)),
}
#: Presses that run under the query-aware protocol only.
QUERY_AWARE_RUNS = {"pyramidkv": ({}, "pipeline", (0.7, 0.5, 0.3), (3, 5))}
#: Presses a contract on the embedded model cannot name (question-agnostic): words of the reason.
REFUSED = {
    "kvzap": ("cannot run on the embedded model", "trained per base model", "nvidia/KVzap"),
    "fastkvzip": ("cannot run on the embedded model", "trained per base model", "Jang-Hyun/Fast-KVzip"),
    "restorekv": ("cannot run on the embedded model", "trained per base model", "higokri/RestoreKV"),
    "duo_attention": ("no setting that kv_retained maps to",),
    "pyramidkv": ("cannot run under the question-agnostic protocol", "different number of entries in each layer",
                  "query_aware: true"),
}


def test_every_leader_runs_or_is_refused():
    from certkv.presses import registry

    assert all(registry.is_known_press(name) for name in LEADERS)
    assert set(RUNS) | set(QUERY_AWARE_RUNS) | set(REFUSED) == set(LEADERS)
    assert not set(RUNS) & set(REFUSED)


@pytest.fixture(scope="module")
def pipe(embedded):
    import kvpress  # noqa: F401  (registers the pipeline)
    from transformers import pipeline

    model, tokenizer = embedded
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")


def _candidates(name, kwargs, retentions):
    from certkv.engine.engine import PressCandidate
    from certkv.presses.registry import build_press

    return [PressCandidate(f"{name}@{kv:.2f}", build_press(name, kv, kwargs), name, kv) for kv in retentions]


def _check(got, cand, path, context_length):
    assert got.path == path, (cand.policy, got.path)
    assert abs(got.kv_retained_actual - cand.kv_retained) <= 2 / context_length, (cand.policy, got.kv_retained_actual)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_engine_equals_kvpress_pipeline(embedded, pipe, name):
    from certkv.engine.engine import Engine
    from certkv.requests.request_set import generate_requests

    kwargs, path, retentions, (seed, n) = RUNS[name]
    model, tokenizer = embedded
    candidates = _candidates(name, kwargs, retentions)
    engine = Engine(model, tokenizer, candidates, max_new_tokens=8)
    changed = 0
    for req in generate_requests("demo", n, seed=seed, context_length=300):
        result = engine.run(req.context, req.question)
        for cand, got in zip(candidates, result.candidates):
            want = pipe(req.context, question=req.question, press=cand.press, max_new_tokens=8)["answer"]
            assert got.answer == want, (name, req.id, cand.policy)
            _check(got, cand, path, result.context_length)
            changed += got.answer != result.full.answer
    assert changed > 0, f"{name}: no answer changed under eviction, the comparison proves little"


def _kvpress_answer(pipe, enc, press):
    """kvpress's pipeline on pre-split ids (the query-aware split): its own hooks, its own decode."""
    inputs = {"context_ids": torch.tensor([enc.context_ids]), "questions_ids": [torch.tensor([enc.question_ids])]}
    return pipe._forward(inputs, max_new_tokens=8, press=press)[0]


@pytest.mark.parametrize("name", sorted(QUERY_AWARE_RUNS))
def test_query_aware_engine_equals_kvpress_pipeline(embedded, pipe, name):
    from certkv.engine.engine import Engine
    from certkv.model.generation import encode_request, for_protocol
    from certkv.requests.request_set import generate_requests

    kwargs, path, retentions, (seed, n) = QUERY_AWARE_RUNS[name]
    model, tokenizer = embedded
    candidates = _candidates(name, kwargs, retentions)
    engine = Engine(model, tokenizer, candidates, max_new_tokens=8, query_aware=True)
    changed = 0
    for req in generate_requests("demo", n, seed=seed, context_length=300):
        enc = for_protocol(encode_request(tokenizer, req.context, req.question), True)
        result = engine.run(req.context, req.question)
        for cand, got in zip(candidates, result.candidates):
            assert got.answer == _kvpress_answer(pipe, enc, cand.press), (name, req.id, cand.policy)
            _check(got, cand, path, result.context_length)
            changed += got.answer != result.full.answer
    assert changed > 0, f"{name}: no answer changed under eviction, the comparison proves little"


def _contract(tmp_path, name, policies, query_aware=False, n=4):
    from certkv.requests.request_set import generate_requests, write_jsonl

    folder = tmp_path / name
    folder.mkdir()
    write_jsonl(generate_requests("demo", n, seed=41, context_length="200-300"), folder / "requests.jsonl")
    data = {
        "name": name, "model": "embedded", "requests": {"source": "requests.jsonl"},
        "protocol": {"max_new_tokens": 8, "device": "cpu", "query_aware": query_aware},
        "utility": "exact_match", "tolerance": 0.0, "risk": 0.2, "confidence": 0.9, "store": "store",
        "policies": policies,
    }
    path = folder / "contract.yaml"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("query_aware", [False, True], ids=["question_agnostic", "query_aware"])
def test_calibrate_runs_the_presses_that_run(tmp_path, query_aware):
    from certkv.calibration.run import calibrate
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract

    runs = QUERY_AWARE_RUNS if query_aware else RUNS
    policies = [{"press": name, "press_kwargs": kwargs, "kv_retained": list(retentions)}
                for name, (kwargs, _, retentions, _) in runs.items()]
    contract = load_contract(_contract(tmp_path, "leaders", policies, query_aware))
    summary = calibrate(contract, quiet=True)
    assert summary.calibrated == 4 and not summary.skipped
    with CalibrationStore.read(contract.resolved_store_path()) as store:
        policies_seen = {r["policy"] for r in store.records()}
    assert policies_seen == {"full", *(c.policy for c in candidates(contract))}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_contract_naming_a_refused_press_fails_at_load(tmp_path, capsys, name):
    from certkv.contract.loading import load_contract

    path = _contract(tmp_path, name, [{"press": name, "kv_retained": [0.5]}], n=1)
    with pytest.raises(CertkvError) as info:
        load_contract(path)
    message = str(info.value)
    assert "\n" not in message and repr(name) in message
    for words in REFUSED[name]:
        assert words in message, (name, message)
    capsys.readouterr()
    for args in (("calibrate", str(path), "--quiet"), ("certify", str(path))):
        assert run_main(*args) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("certkv: error: ") and "Traceback" not in err, err
        assert message in err
    assert not (path.parent / "store").exists()


def test_refusals_depend_on_the_model_and_protocol():
    from certkv.contract.loading import parse_contract

    def contract(policies, model="embedded", query_aware=False):
        return {
            "name": "r", "model": model, "requests": {"source": "builtin:demo"}, "utility": "exact_match",
            "tolerance": 0.0, "risk": 0.1, "confidence": 0.9, "policies": policies,
            "protocol": {"query_aware": query_aware},
        }

    # Weights trained per model: only the embedded model is known to have none.
    for name in ("kvzap", "fastkvzip", "restorekv"):
        parse_contract(contract([{"press": name, "kv_retained": [0.5]}], model="Qwen/Qwen3-8B"))
    with pytest.raises(CertkvError, match=r"entry 0: press_kwargs.press: press 'kvzap' cannot run on the embedded"):
        parse_contract(contract([{"press": "adakv", "press_kwargs": {"press": "kvzap"}, "kv_retained": [0.5]}]))
    with pytest.raises(CertkvError, match="'kvpress:KVzapPress' cannot run on the embedded model"):
        parse_contract(contract([{"press": "kvpress:KVzapPress", "kv_retained": [0.5]}]))
    # PyramidKV: query-aware runs it, unless a candidate needs eager attention; as a wrapper's inner
    # press only its scores are used, so it runs in either protocol.
    pyramid = {"press": "pyramidkv", "kv_retained": [0.5]}
    parse_contract(contract([pyramid], query_aware=True))
    with pytest.raises(CertkvError, match="'pyramidkv' cannot run beside a press that needs eager attention"):
        parse_contract(contract([pyramid, {"press": "observed_attention", "kv_retained": [0.5]}], query_aware=True))
    parse_contract(contract([{"press": "adakv", "press_kwargs": {"press": "pyramidkv"}, "kv_retained": [0.5]}]))


def test_a_wrapper_without_its_scorer_says_which_press_kwargs_it_needs():
    from certkv.presses.registry import build_press

    for name, kwargs in (("adakv", {}), ("criticalkv", {}), ("criticalkv", {"press": "kvzip"}),
                         ("adakv", {"press": {"press": "adakv", "press_kwargs": {"press": "snapkv"}}})):
        with pytest.raises(CertkvError, match=r"set press_kwargs: \{press: snapkv\}") as info:
            build_press(name, 0.5, kwargs)
        assert f"press {name!r} rejected press_kwargs" in str(info.value) and "\n" not in str(info.value)


def test_preconditions_read_scoring_windows_only():
    """SnapKV's window must fit in the context; FastKVzip's window_size chunks long prefills and
    does not (a 300-token context is not "shorter than its 4096-token window")."""
    from kvpress import FastKVzipPress, SnapKVPress

    from certkv.engine.engine import press_precondition_failure

    assert "press window 64" in press_precondition_failure(SnapKVPress(compression_ratio=0.5, window_size=64), 50)
    assert press_precondition_failure(SnapKVPress(compression_ratio=0.5, window_size=64), 300) is None
    assert press_precondition_failure(FastKVzipPress(compression_ratio=0.5), 300) is None


def test_engine_checks_walk_every_inner_press():
    """The eager-attention and window checks see a press however deep it sits: a wrapper's
    ``press``, DeferKV's ``prompt_press``, ComposedPress's ``presses`` (one walk, press_tree)."""
    from kvpress import ComposedPress, CriticalKVPress, ObservedAttentionPress, SnapKVPress, StreamingLLMPress

    from certkv.engine.engine import needs_attention_weights, press_precondition_failure
    from certkv.presses.deferkv import DeferKVPress

    observed = ObservedAttentionPress()
    assert needs_attention_weights(DeferKVPress(compression_ratio=0.5, prompt_press=observed))
    assert needs_attention_weights(CriticalKVPress(press=observed))
    assert needs_attention_weights(ComposedPress(presses=[StreamingLLMPress(compression_ratio=0.2), observed]))
    assert not needs_attention_weights(DeferKVPress(compression_ratio=0.5))
    assert not needs_attention_weights(None)
    deferred = DeferKVPress(compression_ratio=0.5, prompt_press=SnapKVPress(window_size=64))
    assert "press window 64" in press_precondition_failure(deferred, 50)
    assert press_precondition_failure(deferred, 300) is None
    composed = ComposedPress(presses=[StreamingLLMPress(compression_ratio=0.2, n_sink=8), SnapKVPress(window_size=64)])
    assert "press window 64" in press_precondition_failure(composed, 50)
