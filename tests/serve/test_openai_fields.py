"""The OpenAI fields real clients send, through the official `openai` client against one real
`certkv serve` process (snapkv@0.5, answers of 8 tokens) run with ``--shadow-rate 0``: no shadows,
no monitor. Each field gets a 200 with its documented behaviour, checked against the in-process
runtime's answer and log-probabilities, or a one-line 422 naming the field."""

from __future__ import annotations

import json

import httpx
import pytest
from test_serve import _operating_point, _Server, _wait_for

from certkv.requests.request_set import generate_requests

MODEL = "embedded"


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    s = _Server(tmp_path_factory.mktemp("openai_fields"), _operating_point(0.5, 0.5), "--shadow-rate", "0")
    try:
        request.getfixturevalue("embedded")  # the in-process model loads while the server starts
        yield s.wait()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def expected(embedded, server):
    """Per request: the in-process runtime's answer and the log-probabilities of the decode that
    gave it (each Decode step decoded alone by its own `solo` decoder, as calibration did)."""
    from certkv.runtime.certified_runtime import CertifiedRuntime
    from certkv.runtime.steps import Decode

    runtime = CertifiedRuntime(*embedded, server.op_path)
    out = []
    for r in generate_requests("demo", n=3, seed=4243, context_length=(200, 320)):
        steps, decodes = runtime.answer_steps(r.context, r.question), []
        try:
            step = next(steps)
            while True:
                if isinstance(step, Decode):
                    step.ids, step.logprobs = step.solo()
                    decodes.append(step)
                step = steps.send(None)
        except StopIteration as stop:
            answer = stop.value
        (decode,) = [d for d in decodes if d.ids == answer.token_ids]
        assert answer.decision.mode == "evicted" and decode.logprobs is not None
        out.append((r, answer, decode.logprobs))
    return out


def _chat(r):
    return [{"role": "system", "content": r.context}, {"role": "user", "content": r.question}]


def test_shadow_rate_0_serves_without_shadows_or_monitor_and_says_so(server, client, expected):
    r, answer, _ = expected[0]
    out = client.chat.completions.create(model=MODEL, messages=_chat(r))
    assert out.choices[0].message.content == answer.answer
    ck = out.model_extra["certkv"]
    assert (ck["shadowed"], ck["stream"], ck["monitor"], ck["cut"]) == (False, None, None, None)
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert (health["monitoring"], health["shadow_rate"], health["monitor"], health["shadow_store"]) == ("off", 0.0,
                                                                                                       {}, None)
    assert health["status"] == "ok" and health["shadows"] == {"scored": 0, "abandoned": 0}
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert "certkv_monitor_enabled 0.0" in metrics and "certkv_monitor_e_value{" not in metrics
    assert "nothing watches the deployed risk" in server.output()
    assert not server.store.exists()  # no shadow store opened


def test_logprobs_are_the_certified_decodes_own(client, expected):
    """Chat (logprobs=True) and completions (logprobs=0): one entry per token of the answer, the
    end-of-answer token left out, equal to the in-process runtime's decode's log p."""
    for r, answer, logprobs in expected:
        want = logprobs[: len(answer.token_ids) - 1]  # the answers end with the stop token
        assert answer.token_ids[-1] == 2 and any(lp < -1e-3 for lp in want)  # not all certain: the check can fail
        chat = client.chat.completions.create(model=MODEL, messages=_chat(r), logprobs=True, top_logprobs=0)
        content = chat.choices[0].logprobs.content
        assert "".join(t.token for t in content) == chat.choices[0].message.content == answer.answer
        assert [t.logprob for t in content] == pytest.approx(want, abs=1e-4)
        assert all(t.bytes == list(t.token.encode()) and t.top_logprobs == [] for t in content)
        done = client.completions.create(model=MODEL, prompt="", logprobs=0,
                                         extra_body={"context": r.context, "question": r.question})
        lp = done.choices[0].logprobs
        assert lp.token_logprobs == pytest.approx(want, abs=1e-4) and "".join(lp.tokens) == answer.answer
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    plain = client.chat.completions.create(model=MODEL, messages=_chat(expected[0][0]))
    assert plain.choices[0].logprobs is None  # only when asked


def test_logprobs_of_a_full_cache_answer_are_a_teacher_forced_forwards(client, embedded):
    """A context shorter than the press's window is answered from the full cache (reason
    ``precondition``); its log-probabilities equal an independent computation: one forward of the
    model over context, question and answer, read at the answer's tokens."""
    import torch

    from certkv.model.generation import encode_request

    model, tokenizer = embedded
    context = "The magic number for lilac is 6386. The magic number for fox is 1234."
    question = "Question: What is the magic number for fox? Answer: The magic number for fox is"
    out = client.completions.create(model=MODEL, prompt="", logprobs=0,
                                    extra_body={"context": context, "question": question})
    assert out.model_extra["certkv"]["decision"]["reason"] == "precondition"
    enc = encode_request(tokenizer, context, question, "")
    answer = tokenizer(out.choices[0].text, add_special_tokens=False)["input_ids"]
    prompt = list(enc.context_ids) + list(enc.question_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(answer)[:, None])[:, 0].tolist()
    got = out.choices[0].logprobs
    assert "".join(got.tokens) == out.choices[0].text
    assert got.token_logprobs == pytest.approx(want, abs=1e-4)  # as many tokens, and the same log p


def test_stop_strings_cut_the_certified_answer(client, expected, embedded):
    """The answer is cut before the earliest stop string it contains (a string, or a list), exactly
    where the full answer contains it; the certkv object says a stop string cut it; a stop string the
    answer does not contain changes nothing."""
    tokenizer = embedded[1]
    for r, answer, logprobs in expected:
        text = answer.answer
        first, later = text[2], text[1:3]  # as a list, the one found first in the answer cuts it
        for stop in (first, [first, later]):
            at, cut_by = min((text.index(s), s) for s in ([stop] if isinstance(stop, str) else stop))
            out = client.chat.completions.create(model=MODEL, messages=_chat(r), stop=stop, logprobs=True)
            choice, ck = out.choices[0], out.model_extra["certkv"]
            assert (choice.message.content, choice.finish_reason) == (text[:at], "stop")
            cut = ck["cut"]
            assert (cut["by"], cut["stop"], cut["certified_tokens"]) == ("stop", cut_by, len(answer.token_ids))
            # the tokens the returned text comes from: decoded, they give the text up to the cut's token
            tokens = ck["cut"]["tokens"]
            assert out.usage.completion_tokens == tokens == len(choice.logprobs.content)
            assert tokenizer.decode(answer.token_ids[:tokens], skip_special_tokens=True).startswith(text[:at])
            assert [t.logprob for t in choice.logprobs.content] == pytest.approx(logprobs[:tokens], abs=1e-4)
        streamed = client.completions.create(model=MODEL, prompt=r.context + r.question, stop=first, stream=True)
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks) == text[: text.index(first)]
        assert chunks[-1].choices[0].finish_reason == "stop"
        same = client.completions.create(model=MODEL, prompt=r.context + r.question, stop=["#", "zz"])
        assert same.choices[0].text == text and same.model_extra["certkv"]["cut"] is None


def test_a_token_limit_cuts_the_certified_answer(client, expected, embedded):
    """``max_completion_tokens`` / ``max_tokens`` below the calibrated 8: the certified answer's first
    tokens, finish_reason "length"; at 8 the whole answer."""
    tokenizer = embedded[1]
    r, answer, logprobs = expected[1]
    out = client.chat.completions.create(model=MODEL, messages=_chat(r), max_completion_tokens=3, logprobs=True)
    choice, cut = out.choices[0], out.model_extra["certkv"]["cut"]
    assert choice.message.content == tokenizer.decode(answer.token_ids[:3], skip_special_tokens=True) != answer.answer
    assert (choice.finish_reason, cut["by"], cut["tokens"], out.usage.completion_tokens) == ("length", "max_tokens",
                                                                                            3, 3)
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(logprobs[:3], abs=1e-4)
    done = client.completions.create(model=MODEL, prompt=r.context + r.question, max_tokens=4)
    assert done.choices[0].text == tokenizer.decode(answer.token_ids[:4], skip_special_tokens=True)
    streamed = list(client.completions.create(model=MODEL, prompt=r.context + r.question, max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.message.content  # tokens past it are never sent
    assert streamed[-1].choices[0].finish_reason == "length"
    whole = client.completions.create(model=MODEL, prompt=r.context + r.question, max_tokens=8)
    assert whole.choices[0].text == answer.answer and whole.model_extra["certkv"]["cut"] is None


def test_include_usage_ends_the_stream_with_a_usage_chunk(client, expected):
    r, answer, _ = expected[2]
    for chunks in (list(client.chat.completions.create(model=MODEL, messages=_chat(r), stream=True,
                                                       stream_options={"include_usage": True})),
                   list(client.completions.create(model=MODEL, prompt=r.context + r.question, stream=True,
                                                  stream_options={"include_usage": True}))):
        last = chunks[-1]
        assert last.choices == [] and last.usage.completion_tokens == len(answer.token_ids)
        assert all(c.usage is None for c in chunks[:-1]), "the usage is sent once, in its own chunk"
        assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
        text = "".join((c.choices[0].delta.content or "") if hasattr(c.choices[0], "delta") else c.choices[0].text
                       for c in chunks[:-1])
        assert text == answer.answer


def test_unknown_fields_and_greedy_preserving_values_are_accepted(server, client, expected):
    """Fields that leave the greedy answer as certified (temperature 0, any top_p, penalties at 0,
    metadata, seed, user, other servers' fields at their neutral values) answer as a plain request
    does; a field the server does not know is ignored and named in a logged warning, as vLLM's
    server does."""
    r, answer, _ = expected[0]
    out = client.chat.completions.create(
        model=MODEL, messages=_chat(r), temperature=0, top_p=0.2, presence_penalty=0, frequency_penalty=0, n=1,
        metadata={"team": "qa"}, seed=7, user="u1", response_format={"type": "text"},
        extra_body={"top_k": 1, "zz_unheard_of": 1, "best_of": 1, "repetition_penalty": 1.0})
    assert out.choices[0].message.content == answer.answer
    _wait_for(lambda: "ignored the fields this server does not know: top_k, zz_unheard_of" in server.output(),
              "the server to log the fields it ignored")


REFUSED = [
    ("temperature", {"temperature": 0.7}, "sampling"),
    ("n", {"n": 2}, "one certified greedy answer"),
    ("presence_penalty", {"presence_penalty": 0.5}, "penalty"),
    ("frequency_penalty", {"frequency_penalty": -1.0}, "penalty"),
    ("logit_bias", {"logit_bias": {"5": 10}}, "bias"),
    ("max_tokens", {"max_tokens": 9}, "at most 8 tokens"),
    ("max_completion_tokens", {"max_completion_tokens": 9}, "at most 8 tokens"),
    ("max_completion_tokens", {"max_completion_tokens": 3, "max_tokens": 4}, "differs from max_tokens"),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 2}, "alternatives"),
    ("stop", {"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ("stream_options", {"stream_options": {"include_usage": True}}, "stream"),
    ("logprobs", {"logprobs": True, "stream": True}, "stream"),
    # other servers' fields that change the answer (vLLM's, OpenAI's): refused, not ignored
    ("response_format", {"response_format": {"type": "json_object"}}, "constrained output"),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool calls"),
    ("repetition_penalty", {"extra_body": {"repetition_penalty": 1.3}}, "penalty"),
    ("ignore_eos", {"extra_body": {"ignore_eos": True}}, "past the end"),
    ("best_of", {"extra_body": {"best_of": 3}}, "best_of may only be 1"),
]


def test_fields_outside_the_certificate_are_one_line_422s_naming_them(server, client, expected):
    import openai

    r = expected[0][0]
    for param, fields, why in REFUSED:
        with pytest.raises(openai.UnprocessableEntityError) as info:
            client.chat.completions.create(model=MODEL, messages=_chat(r), **fields)
        err = info.value.body  # the error object: message, type, param, code
        assert (err["param"], err["message"].split(":")[0]) == (param, param) and why in err["message"], err
        assert "\n" not in err["message"] and err["code"] == "invalid_value"
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.completions.create(model=MODEL, prompt=r.context + r.question, logprobs=2)
    assert info.value.param == "logprobs" and "alternatives" in info.value.message
    body = httpx.post(server.url + "/v1/completions", json={"prompt": r.context + r.question, "temperature": 5},
                      timeout=10).json()["error"]
    assert body["param"] == "temperature" and json.dumps(body).count("\\n") == 0


def test_finish_reason_and_logprobs_follow_the_decoders_stopping_rule():
    """A stop token ends an answer, except as its first token (certkv.model.stopping: decoding keeps
    it and goes on): such an answer ends by its length, and its first token is an answer token
    whose log-probability is returned, not an end-of-answer token left out."""
    from certkv.serve.answer_cut import Cut, finish_reason, logprob_tokens

    assert finish_reason([5, 2], 8, {2}) == "stop" and finish_reason([2, 7, 2], 8, {2}) == "stop"
    assert finish_reason([5, 6], 2, {2}) == "length" and finish_reason([2, 7], 2, {2}) == "length"
    assert finish_reason([2], 1, {2}) == "length"  # the first token never stops an answer
    assert logprob_tokens(Cut("", 1, "length"), [2], {2}) == 1
    assert logprob_tokens(Cut("ab", 3, "stop"), [4, 5, 2], {2}) == 2
