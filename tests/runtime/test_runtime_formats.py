"""calibrate → certify → CertifiedRuntime for KV formats: the deployed answers are the store's.

A contract with a format alone (int4 in groups of 16, a full-precision window of 8 tokens), a
scorer press beside a per-token format in three tiers (its kept entries chosen in the full prefill,
the highest-scored of them at 16 bits, the others as int8), a press
beside transformers' HQQ format (pruned through kvpress's hooks) and a decoding-time press beside
fp8 is calibrated into a real store; the runtime of each candidate
answers every calibration request as its records say, stores its KV at the format's precision,
and restarts on the full cache where a recompute threshold fires, as certification derived it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from scheduler_checks import assert_scheduler_matches, budget_for

N_REQUESTS = 6
POLICIES = ("int4w8@1.00", "snapkv+tier0.1-int8@0.50", "knorm+hqq4@0.70", "streaming_dec_fp8@0.70")
#: Decoded as lanes of certkv serve's batch: a per-token format alone or beside a scorer press.
LANES = ("int4w8@1.00", "snapkv+tier0.1-int8@0.50")


def _contract(folder: Path) -> Path:
    contract = {
        "name": "runtime_formats",
        "model": "embedded-recite",
        "requests": {"source": "builtin:recite", "limit": N_REQUESTS, "seed": 77},
        "protocol": {"max_new_tokens": 28, "device": "cpu"},
        "utility": "prefix_agreement",
        "tolerance": 0.0,
        "risk": 0.6,  # lenient: the point is deployment, not power
        "confidence": 0.6,
        "policies": [
            {"cache": {"backend": "int", "nbits": 4, "q_group_size": 16, "residual_length": 8}, "label": "int4w8"},
            # three tiers: the 0.1 of the context SnapKV scores highest at 16 bits, the rest it keeps as int8
            {"press": "snapkv", "kv_retained": [0.5], "cache": {"backend": "tiered", "full": 0.1,
                                                                 "quantised": {"backend": "int", "nbits": 8}}},
            {"press": "knorm", "kv_retained": [0.7], "cache": {"backend": "hqq", "nbits": 4, "residual_length": 8}},
            {"press": "compression_ratio_decoding", "label": "streaming_dec_fp8", "kv_retained": [0.7],
             "press_kwargs": {"base_press": "streaming_llm", "compression_interval": 8},
             "cache": {"backend": "fp8", "dtype": "e5m2"}},
        ],
        "store": "store",
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "contract.yaml"
    path.write_text(yaml.safe_dump(contract))
    return path


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    from certkv.calibration.run import calibrate
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract

    folder = tmp_path_factory.mktemp("runtime_formats")
    contract = load_contract(_contract(folder))
    summary = calibrate(contract, quiet=True)
    assert summary.calibrated == N_REQUESTS and not summary.skipped
    with CalibrationStore.read(folder / "store") as store:
        records = store.records()
    return contract, {(r["request_id"], r["policy"]): r for r in records}


@pytest.fixture(scope="module")
def recite():
    from certkv.model.loading import load_model

    return load_model("embedded-recite", device="cpu")


def _point(contract, policy: str, gate=None):
    """The operating point deploying `policy` (behind `gate`), as certify writes a chosen one."""
    from certkv.calibration.certification import load_records
    from certkv.contract.spec import certification_spec
    from certkv.core.certify import certify

    spec = certification_spec(contract)
    op = certify(load_records(contract).table, spec, contract_sha256=contract.sha256())
    candidate = next(c for c in op.candidates if c.policy == policy)
    info = spec.candidate_info[policy]
    return op.model_copy(update={
        "policy": policy, "base_policy": policy, "press": candidate.press, "kv_retained": candidate.kv_retained,
        "press_kwargs": info.press_kwargs, "kv_format": info.kv_format, "engine_setting": info.engine_setting,
        "gate": gate, "fallback": False,
    })


@pytest.mark.parametrize("policy", POLICIES)
def test_runtime_answers_as_the_store(calibrated, recite, policy):
    from certkv.requests.request_set import generate_requests
    from certkv.runtime.certified_runtime import CertifiedRuntime

    contract, records = calibrated
    model, tok = recite
    runtime = CertifiedRuntime(model, tok, _point(contract, policy))
    assert runtime.kv_format is not None and type(runtime.path).__name__ == "FormatPath"
    requests = generate_requests("recite", N_REQUESTS, seed=77)
    answers, differ = [], 0
    for request in requests:
        record, full = records[(request.id, policy)], records[(request.id, "full")]
        out = runtime.generate(request.context, request.question)
        assert out.answer == record["answer"], (policy, request.id)
        assert out.decision.mode == "evicted"
        differ += record["answer"] != full["answer"]
        answers.append(out)
    assert differ, f"{policy} answers every request as the full cache; the comparison proves little"
    # certkv serve's scheduler, a few requests' KV at a time, answers them all the same: a per-token
    # format alone as lanes of its batch, holding its stored tensors; beside a press, alone
    lanes = runtime.path.lanes()
    assert lanes == (policy in LANES)
    assert_scheduler_matches(runtime, requests, budget=budget_for(runtime, requests), alone=answers, batching=lanes)


def test_the_cache_is_stored_at_the_formats_precision(recite):
    """What the deployed path holds: float8 elements for fp8, int4 two to a byte and float16 scales."""
    import torch
    from transformers import DynamicCache

    from certkv.kv_formats.caches import build_cache, prime
    from certkv.kv_formats.spec import parse_format
    from certkv.model.generation import encode_request
    from certkv.requests.request_set import generate_requests

    model, tok = recite
    request = generate_requests("recite", 1, seed=5)[0]
    enc = encode_request(tok, request.context, request.question)
    full = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=torch.tensor([enc.context_ids]), past_key_values=full)
    fp8, int4 = {"backend": "fp8", "dtype": "e4m3"}, {"backend": "int", "nbits": 4}
    for data, dtype in ((fp8, torch.float8_e4m3fn), (int4, torch.uint8)):
        cache = prime(build_cache(parse_format(data), model.config), full)
        stored = cache.layers[0]._quantized_keys
        assert stored.data.dtype == dtype and stored.tokens == len(enc.context_ids)
        assert (stored.scale is None) == (dtype == torch.float8_e4m3fn)
        assert stored.scale is None or stored.scale.dtype == torch.float16
        assert torch.isfinite(stored.dequantize()).all()


def test_recompute_on_a_format_restarts_where_certification_counted(calibrated, recite):
    """A recompute threshold between two recorded token probabilities: the requests whose lowest
    probability is under it restart on the full cache and answer as the full cache (their prefix
    agreed) or as certification's late restart; the others answer as the format's record; and
    certkv serve's scheduler, batching the format's lanes, answers all of them the same."""
    from certkv.core.spec import GateSettings
    from certkv.requests.request_set import generate_requests
    from certkv.runtime.certified_runtime import CertifiedRuntime

    contract, records = calibrated
    model, tok = recite
    policy = "int4w8@1.00"
    lows = sorted(records[(r.id, policy)]["confidence_min"] for r in generate_requests("recite", N_REQUESTS, seed=77))
    threshold = math.sqrt(lows[len(lows) // 2 - 1] * lows[len(lows) // 2])  # between two recorded values
    runtime = CertifiedRuntime(model, tok, _point(contract, policy, GateSettings(recompute=threshold)))
    restarted, answers = 0, []
    requests = generate_requests("recite", N_REQUESTS, seed=77)
    for request in requests:
        record, full = records[(request.id, policy)], records[(request.id, "full")]
        out = runtime.generate(request.context, request.question)
        answers.append(out)
        fires = record["confidence_min"] < threshold
        assert (out.decision.reason == "recompute") == fires, request.id
        if not fires:
            assert out.answer == record["answer"]
        elif record["confidence_min_agreeing"] < threshold:  # it fired before the answer departed
            assert out.answer == full["answer"]
        restarted += fires
    assert 0 < restarted < N_REQUESTS
    # certkv serve's scheduler decodes the gated format as lanes of its batch, each stopping itself at
    # the first token under the threshold: the same restarts and answers as the token-by-token decode
    assert runtime.path.lanes()
    assert_scheduler_matches(runtime, requests, budget=budget_for(runtime, requests), alone=answers)
