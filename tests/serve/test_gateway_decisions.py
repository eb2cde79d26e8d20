"""`certkv gateway`'s decisions on a candidate's answer that need no server: the context range it was
certified on (the point's, or its stratum's own) and whether an answer without its tokens can be
returned whole. The gateway against real upstreams is tests/e2e/test_endpoints.py."""

from __future__ import annotations

import pytest
from conftest import run_here
from endpoint_servers import snapkv_point

from certkv.core.coverage import Coverage
from certkv.gateway.gateway import Ask, Gateway
from certkv.gateway.upstream import Upstream, UpstreamAnswer
from certkv.serve.metrics import AnswerMetrics


def _stratified():
    """snapkv@0.50 certified per task: task a on prompts of 100-200 tokens, task b on 400-500 (the
    point's merged range, 100-500, covers 300, which neither task was certified on)."""
    from certkv.core.operating_point import StrataResult

    def entry(task: str, span: tuple[int, int]):
        return snapkv_point(0.5).model_copy(update={"coverage": Coverage(by="task", strata=[task], context_tokens=span)})

    entries = {"a": entry("a", (100, 200)), "b": entry("b", (400, 500))}
    return snapkv_point(0.5).model_copy(update={
        "policy": "stratified", "base_policy": "stratified",
        "coverage": Coverage(by="task", strata=["a", "b"], context_tokens=(100, 500)),
        "strata": StrataResult(by="task", simultaneous=False, confidence=0.9, entries=entries)})


@pytest.fixture
def gateway():
    full = Upstream("http://127.0.0.1:9/v1", "m", None, timeout=1, retry_after=1)
    candidate = Upstream("http://127.0.0.1:9/v1", "m", None, timeout=1, retry_after=1)
    return Gateway(_stratified(), full, {"snapkv@0.50": candidate}, "chat", None, None, AnswerMetrics())


def _answer(text: str, prompt_tokens: int, completion_tokens: int, texts: list[str] | None = None) -> UpstreamAnswer:
    return UpstreamAnswer(text, "stop", texts, None, prompt_tokens, completion_tokens, 0.1)


def _ask(limit: int | None = None, stops: list[str] | None = None) -> Ask:
    return Ask("context", "question", "", "a", limit, stops or [], logprobs=False)


def test_a_stratum_is_held_to_its_own_context_range(gateway):
    a, b = (gateway.op.entry_for(task) for task in ("a", "b"))
    assert gateway.outside_context(a, 150) is None and gateway.outside_context(b, 450) is None
    assert gateway.outside_context(a, 300) == "context of 300 tokens is outside the calibrated 100-200 tokens"
    assert gateway.outside_context(b, 300) == "context of 300 tokens is outside the calibrated 400-500 tokens"
    assert gateway.outside_context(a, 0) is None  # a server that reports no usage is not checked


def test_an_answer_without_its_tokens_is_kept_only_when_nothing_needs_cutting(gateway):
    answer = _answer("The value is 42.", 150, 6)
    assert gateway.whole_without_tokens(answer, _ask())
    assert gateway.whole_without_tokens(answer, _ask(limit=6))
    assert not gateway.whole_without_tokens(answer, _ask(limit=5))  # longer than max_tokens: no tokens to cut at
    assert not gateway.whole_without_tokens(answer, _ask(stops=["42"]))  # a stop string to cut before
    assert not gateway.whole_without_tokens(_answer("The value is 42.", 150, 0), _ask(limit=8))  # length unknown
    cut = gateway.cut(answer, _ask(limit=8))
    assert (cut.text, cut.tokens, cut.finish_reason, cut.info) == ("The value is 42.", 6, "stop", None)
    with_tokens = gateway.cut(_answer("The value is 42.", 150, 5, ["The", " value", " is", " 42", "."]), _ask(limit=2))
    assert (with_tokens.text, with_tokens.tokens, with_tokens.finish_reason) == ("The value", 2, "length")


@pytest.mark.parametrize("flag, value, fragment", [
    ("--shadow-concurrency", "0", "--shadow-concurrency must be at least 1, got 0"),
    ("--shadow-queue", "-1", "--shadow-queue must be at least 0, got -1"),
    ("--candidate-timeout", "0", "--candidate-timeout must be positive seconds, got 0"),
])
def test_gateway_limits_out_of_range_are_one_line(flag, value, fragment, tmp_path, capsys):
    """Checked before the point is read or a port bound: one line naming the flag, exit 2."""
    result = run_here(capsys, "gateway", str(tmp_path / "operating_point.json"), flag, value)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"certkv: error: {fragment}"], result.stderr
