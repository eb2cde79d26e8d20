"""Endpoint contracts without a server: the syntax, its one-line refusals, the names and the hash,
what is sent and read back, and the refusals a run gives before any request (an unset API key, an
unreachable endpoint). Torch-free; the runs against real `certkv serve` upstreams are
tests/e2e/test_endpoints.py."""

from __future__ import annotations

import socket

import pytest
from conftest import run_here

from certkv.calibration.endpoints import EndpointOptions, prompt_tokens, read_answer, request_body
from certkv.contract.loading import parse_contract
from certkv.contract.spec import candidates, sequences
from certkv.errors import CertkvError
from certkv.requests.request_set import Request

FULL = {"endpoint": "http://127.0.0.1:8001/v1", "name": "smollm2"}
ENTRY = {"endpoint": {"url": "http://127.0.0.1:8002/v1", "name": "smollm2"}, "label": "q4_0_kv", "memory": 0.28}
TERMS = {"name": "ep", "requests": {"source": "requests.jsonl"}, "utility": "exact_match", "tolerance": 0.0,
         "risk": 0.1, "confidence": 0.9}


def endpoint_contract(**changes):
    return parse_contract({**TERMS, "model": FULL, "protocol": {"max_new_tokens": 32, "route": "chat"},
                           "policies": [ENTRY], **changes})


def test_the_issue_syntax_names_candidates_label_at_memory():
    contract = endpoint_contract(gate={"pilot": 0.25, "confidence": {"quantiles": [0.1]}})
    [cand] = candidates(contract)
    assert (cand.policy, cand.press, cand.kv_retained) == ("q4_0_kv@0.28", "endpoint", 0.28)
    assert sequences(contract) == [["q4_0_kv@0.28"], ["q4_0_kv@0.28+confq0.1"]]
    assert contract.endpoint.url == "http://127.0.0.1:8001/v1" and contract.route == "chat"
    assert endpoint_contract(protocol={"route": "completions"}).route == "completions"


def test_contracts_without_endpoints_hash_as_before():
    """The endpoint keys (model mapping, an entry's endpoint and memory, protocol.route) leave no
    trace in the canonical JSON of a contract that does not use them."""
    contract = parse_contract({**TERMS, "policies": [{"press": "snapkv", "kv_retained": [0.5]}]})
    text = contract.canonical_json()
    assert all(key not in text for key in ('"endpoint"', '"memory"', '"route"', '"logprobs"'))


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"policies": [{"press": "snapkv", "kv_retained": [0.5]}]}, "entry 0 runs in-process, but model is an endpoint"),
    ({"model": "embedded"}, "entry 0 is an endpoint, but model runs in-process"),
    ({"policies": [{**ENTRY, "press": "snapkv"}]}, "remove press"),
    ({"policies": [{**ENTRY, "cache": {"backend": "fp8"}}]}, "remove cache"),
    ({"policies": [{**ENTRY, "kv_retained": [0.5]}]}, "remove kv_retained"),
    ({"policies": [{k: v for k, v in ENTRY.items() if k != "label"}]}, "needs a label"),
    ({"policies": [{**ENTRY, "memory": 0.0}]}, "memory in (0, 1]"),
    ({"policies": [{**ENTRY, "memory": 1.5}]}, "memory in (0, 1]"),
    ({"policies": [{k: v for k, v in ENTRY.items() if k != "memory"}]}, "memory in (0, 1]"),
    ({"gate": {"agreement_drop": [0.1]}}, "gate.agreement_drop reads the model's attention or cache"),
    ({"gate": {"pilot": 0.25, "lookahead": {"quantiles": [0.1]}}}, "gate.lookahead reads"),
    ({"gate": {"pilot": 0.25, "learned": {"quantiles": [0.1]}}}, "gate.learned feature lookahead reads"),
    ({"protocol": {"query_aware": True}}, "protocol.query_aware configures certkv's own engine"),
    ({"kv_cost": "bytes"}, "kv_cost bytes is measured inside certkv's engine"),
    ({"protocol": {"logprobs": False}, "gate": {"pilot": 0.25, "confidence": {"quantiles": [0.1]}}},
     "the confidence gate reads the answer's log-probabilities, which protocol.logprobs: false does not ask for"),
    ({"model": {**FULL, "endpoint": "localhost:8001"}}, "must be http(s)://host"),
    ({"model": {**FULL, "api_key_env": "sk-live key"}}, "must name an environment variable"),
])
def test_refusals_are_one_line(changes, fragment):
    with pytest.raises(CertkvError) as err:
        endpoint_contract(**changes)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_in_process_entries_refuse_endpoint_keys():
    for entry, fragment in (({"press": "snapkv", "kv_retained": [0.5], "memory": 0.5}, "memory is an endpoint entry's"),):
        with pytest.raises(CertkvError, match=fragment):
            parse_contract({**TERMS, "policies": [entry]})
    for key, value in (("route", "chat"), ("logprobs", False)):
        with pytest.raises(CertkvError, match=f"protocol.{key} applies to endpoint contracts only"):
            parse_contract({**TERMS, "protocol": {key: value}, "policies": [{"press": "snapkv", "kv_retained": [0.5]}]})


def test_the_confidence_gate_is_allowed_for_endpoints():
    contract = endpoint_contract(gate={"pilot": 0.25, "confidence": {"quantiles": [0.1, 0.2]},
                                       "learned": {"quantiles": [0.3], "features": ["confidence"]}})
    assert [s[0] for s in sequences(contract)] == ["q4_0_kv@0.28", "q4_0_kv@0.28+confq0.1", "q4_0_kv@0.28+confq0.2",
                                                    "q4_0_kv@0.28+learnq0.3"]


def test_what_is_sent():
    """Greedy, the contract's length, log-probabilities asked for; a certkv serve upstream gets the
    request's fields as they are, another server the context then the question in one turn."""
    request = Request(id="r", task="t", context="The number is 7. ", question="Question: which?", answers=["7"],
                      answer_prefix="It is")
    chat = request_body(request, "chat", "m", 8, certkv_upstream=False)
    assert chat == {"model": "m", "temperature": 0, "max_tokens": 8, "logprobs": True,
                    "top_logprobs": 0, "messages": [{"role": "user", "content": "The number is 7. Question: which?"}]}
    completion = request_body(request, "completions", "m", 8, certkv_upstream=False)
    assert completion["prompt"] == "The number is 7. Question: which?" and completion["logprobs"] == 0
    upstream = request_body(request, "chat", "m", 8, certkv_upstream=True)
    assert upstream["messages"] == [] and (upstream["context"], upstream["question"], upstream["answer_prefix"]) == (
        request.context, request.question, "It is")
    assert request_body(request, "completions", "m", 8, certkv_upstream=True)["prompt"] == ""
    for route in ("chat", "completions"):  # protocol.logprobs: false asks for none
        body = request_body(request, route, "m", 8, certkv_upstream=False, logprobs=False)
        assert "logprobs" not in body and "top_logprobs" not in body


def test_logprobs_false_changes_the_hash_and_true_the_default_does_not():
    plain = endpoint_contract()
    without, written = (endpoint_contract(protocol={"max_new_tokens": 32, "route": "chat", "logprobs": value})
                        for value in (False, True))
    assert plain.asks_logprobs and written.asks_logprobs and not without.asks_logprobs
    assert '"logprobs"' not in plain.canonical_json() and plain.sha256() == written.sha256() != without.sha256()


def test_what_is_read_back():
    chat = {"choices": [{"message": {"content": "42"}, "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.5}]}}]}
    assert read_answer(chat, "chat", "u") == ("42", [-0.1, -0.5])
    completion = {"choices": [{"text": "42", "logprobs": {"token_logprobs": [-0.2]}}]}
    assert read_answer(completion, "completions", "u") == ("42", [-0.2])
    assert read_answer({"choices": [{"text": "42", "logprobs": None}]}, "completions", "u") == ("42", None)
    with pytest.raises(CertkvError, match="endpoint u answered without a chat completion's choices"):
        read_answer({"error": "x"}, "chat", "u")
    # the prompt's length as the server counted it: the certificate's context range for a gateway
    assert prompt_tokens({**chat, "usage": {"prompt_tokens": 312, "completion_tokens": 2}}) == 312
    for usage in (None, {}, {"prompt_tokens": 0}, {"prompt_tokens": "312"}, {"prompt_tokens": True}):
        assert prompt_tokens({**chat, "usage": usage}) is None


def test_options_are_checked():
    with pytest.raises(CertkvError, match="--concurrency must be at least 1"):
        EndpointOptions(concurrency=0).check()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write(tmp_path, **model):
    import yaml

    (tmp_path / "requests.jsonl").write_text('{"id": "a", "context": "x y", "question": "Question: z", "answers": ["1"]}\n')
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    data = {**TERMS, "model": {"endpoint": url, "name": "m", **model}, "protocol": {"max_new_tokens": 4},
            "policies": [{**ENTRY, "endpoint": {"url": url, "name": "m"}}]}
    path = tmp_path / "contract.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, url


def test_an_unreachable_endpoint_is_one_line_naming_it(tmp_path, capsys):
    path, url = _write(tmp_path)
    res = run_here(capsys, "calibrate", str(path), "--retries", "1", "--quiet")
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"certkv: error: endpoint {url}/models: unreachable") and "gave up after 2 tries" in last
    assert "retrying in 0.5 s" in res.stderr  # the one retry was told


def test_an_unset_api_key_is_refused_before_the_store(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CERTKV_TEST_UNSET_KEY", raising=False)
    path, url = _write(tmp_path, api_key_env="CERTKV_TEST_UNSET_KEY")
    res = run_here(capsys, "calibrate", str(path))
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert f"environment variable CERTKV_TEST_UNSET_KEY is not set; it holds the API key of endpoint {url}" in res.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("args", "fragment"), [
    (["--executor", "ray"], "an endpoint contract sends its requests to its servers; --executor ray"),
    (["--concurrency", "0"], "--concurrency must be at least 1"),
])
def test_endpoint_options_are_refused_in_one_line(tmp_path, capsys, args, fragment):
    path, _ = _write(tmp_path)
    res = run_here(capsys, "calibrate", str(path), *args)
    assert res.returncode == 2 and fragment in res.stderr and res.stderr.count("\n") == 1
