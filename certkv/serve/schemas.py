"""Request shapes of `certkv serve` (OpenAI's, plus certkv's extension fields) and the prompt split.

certkv answers a *question about a context*: the context is prefilled (and its KV cache evicted),
the question is fed after it, exactly as calibration did. A request therefore has to say which
text is which. The rule, the same for both endpoints:

1. ``context`` and ``question`` (extension fields) given: used as they are; ``prompt`` /
   ``messages`` must then be absent. An empty ``prompt`` (``""``) counts as absent, and so does a
   message with empty content: OpenAI's clients require ``prompt`` and ``messages``, so
   ``prompt=""`` with the fields in ``extra_body`` is how such a client sends rule 1. With
   ``context`` and no ``question`` field, one non-empty user message left is the question.
2. ``question`` given with a ``prompt`` (completions) or a single message (chat): that prompt or
   message is the context.
3. A plain ``prompt`` (or a single user message) with no ``question``: it must contain the marker
   ``Question:`` exactly once; the context is everything before it and the question everything
   from it on (so a prompt built as ``context + question`` from certkv's request sets splits back
   into the calibrated strings exactly).
4. Chat ``messages`` of exactly two: a ``system`` or ``user`` message holding the context, then a
   ``user`` message holding the question (no split marker needed).

An ``answer_prefix`` (extension field) is text the answer starts with, placed after the question
as a calibration request's is (after the chat template's assistant header); the answer returned is
what follows it.

Anything else (no text, the marker missing or repeated, assistant or tool turns, more than two
messages, a prompt list) is refused with 422 and the reason.

What the certificate covers decides the OpenAI fields (:meth:`_Request.refusal` names the field
and why, as a one-line 422): the answer is the greedy decode at the calibrated length, so
``temperature`` may only be 0 or absent (``top_p`` then changes nothing: the greedy token is in
every nucleus), ``n`` only 1, ``presence_penalty`` / ``frequency_penalty`` only 0, ``logit_bias``
only empty, and ``max_tokens`` / ``max_completion_tokens`` at most the calibrated length. A
smaller limit and ``stop`` strings cut the certified answer after it is decoded (the gates decide
on the whole answer, as calibration did); the response's ``certkv.cut`` says so. ``logprobs`` are
the certified decode's own token log-probabilities; its alternatives are not recorded, so
``top_logprobs`` (chat) and ``logprobs`` (completions) may only be 0. ``seed``, ``user`` and
``metadata`` are accepted and ignored; any other field is ignored with a logged warning, as vLLM's
server does (:meth:`_Request.unknown_fields`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

#: The marker a plain prompt is split at (rule 3).
SPLIT_MARKER = "Question:"


#: The most stop strings a request may give (OpenAI's limit).
MAX_STOP_STRINGS = 4


class FieldError(ValueError):
    """A request field certkv refuses (422); ``param`` names the field, the message says why."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class SplitError(FieldError):
    """A request whose text does not split into context and question; ``param`` names the field."""


#: Fields other servers (OpenAI's, vLLM's) know that would change the certified answer or what is
#: returned of it: (does the value change it?, why). Any other unknown field is ignored with a warning.
ANSWER_CHANGING_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (lambda v: v not in (None, 1), "certkv returns the one certified greedy answer; best_of may only be 1"),
    "use_beam_search": (bool, "beam search is not the greedy decoding that was certified; omit it"),
    "repetition_penalty": (lambda v: v not in (None, 1, 1.0), "a penalty changes the greedy answer that was "
                           "certified; pass 1 or omit it"),
    "min_tokens": (bool, "forbidding the end of the answer changes the greedy answer that was certified; omit it"),
    "ignore_eos": (bool, "decoding past the end of the answer was never certified; omit it"),
    "echo": (bool, "the prompt is not returned with the certified answer; omit it"),
    "suffix": (bool, "insertion after a suffix was never certified; omit it"),
    "response_format": (lambda v: v not in (None, {"type": "text"}), "constrained output is not the greedy "
                        "answer that was certified; omit it"),
    "tools": (bool, "tool calls were never certified; omit tools"),
    "functions": (bool, "function calls were never certified; omit functions"),
    "guided_json": (lambda v: v is not None, "guided decoding is not the greedy answer that was certified; omit it"),
    "guided_regex": (lambda v: v is not None, "guided decoding is not the greedy answer that was certified; omit it"),
    "guided_choice": (lambda v: v is not None, "guided decoding is not the greedy answer that was certified; omit it"),
    "guided_grammar": (lambda v: v is not None, "guided decoding is not the greedy answer that was certified; "
                       "omit it"),
}


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` asks for a last chunk with the usage and no choices."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields: ignored with a warning (unknown_fields)
    model: str | None = None
    context: str | None = None
    question: str | None = None
    stratum: str | None = None
    answer_prefix: str = Field(
        default="", description="text the answer starts with, after the question (as a calibration request's answer_prefix)")
    answers: list[str] | str | None = Field(
        default=None, description="reference answers, read only by the shadow's utility (else agreement)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None

    def reference_answers(self) -> list[str] | None:
        if self.answers is None:
            return None
        return [self.answers] if isinstance(self.answers, str) else list(self.answers)

    def unknown_fields(self) -> list[str]:
        """Fields this server does not know (ignored: the route logs a warning naming them); fields of
        :data:`ANSWER_CHANGING_FIELDS` at a value that changes nothing are not counted."""
        return sorted(k for k in self.model_extra or {} if k not in ANSWER_CHANGING_FIELDS)

    def _extra_refusal(self) -> FieldError | None:
        """The first field of :data:`ANSWER_CHANGING_FIELDS` given at a value that changes the answer."""
        for name, value in sorted((self.model_extra or {}).items()):
            if name in ANSWER_CHANGING_FIELDS:
                changes, why = ANSWER_CHANGING_FIELDS[name]
                if changes(value):
                    return FieldError(f"{name}: {why}", name)
        return None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a chunk carrying the usage and no choices (OpenAI's
        ``stream_options.include_usage``): the hook a streamed answer reads."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> list[str]:
        """The stop strings, as a list (none: ``[]``)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_limit(self) -> int | None:
        """The tokens the answer may have (``max_completion_tokens``, else ``max_tokens``), or None."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def wants_logprobs(self) -> bool:
        """Whether the answer's token log-probabilities are asked for (each endpoint says how)."""
        return False

    def refusal(self, certified_tokens: int) -> FieldError | None:
        """The first field that asks for an answer the certificate does not cover (a
        :class:`FieldError` naming it and why), or None. `certified_tokens` is the calibrated length."""
        checks = (
            ("n", self.n not in (None, 1), "certkv returns the one certified greedy answer; n may only be 1"),
            ("temperature", bool(self.temperature), "sampling (temperature > 0) is not what was certified: the "
             "certificate covers the greedy answer; pass 0 or omit it"),
            ("presence_penalty", bool(self.presence_penalty), "a penalty changes the greedy answer that was "
             "certified; pass 0 or omit it"),
            ("frequency_penalty", bool(self.frequency_penalty), "a penalty changes the greedy answer that was "
             "certified; pass 0 or omit it"),
            ("logit_bias", bool(self.logit_bias), "a bias changes the greedy answer that was certified; omit it"),
        )
        for param, refused, why in checks:
            if refused:
                return FieldError(f"{param}: {why}", param)
        return self._extra_refusal() or self._length_refusal(certified_tokens) or self._output_refusal()

    def _length_refusal(self, certified_tokens: int) -> FieldError | None:
        """A token limit above the calibrated length (never certified), or two limits that differ."""
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            return FieldError("max_completion_tokens: differs from max_tokens; give one of them", "max_completion_tokens")
        limit = self.token_limit()
        if limit is not None and limit > certified_tokens:
            param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
            return FieldError(f"{param}: the operating point is certified for answers of at most {certified_tokens} "
                              "tokens; a longer answer was never certified: pass at most that or omit it", param)
        return None

    def _output_refusal(self) -> FieldError | None:
        """Stop strings, stream options and log-probabilities certkv cannot give as asked."""
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            return FieldError(f"stop: give a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty "
                              "strings", "stop")
        if self.stream_options is not None and not self.stream:
            return FieldError("stream_options: only allowed with stream: true", "stream_options")
        if self.wants_logprobs() and self.stream:
            return FieldError("logprobs: not returned on a stream yet; ask without stream", "logprobs")
        return None


def split_prompt(text: str, param: str) -> tuple[str, str]:
    """Rule 3: split at the single ``Question:``."""
    count = text.count(SPLIT_MARKER)
    if count != 1:
        raise SplitError(
            f"{param}: a plain prompt must contain {SPLIT_MARKER!r} exactly once to split into context and "
            f"question (found {count}); or pass the fields context and question, or question with the prompt",
            param)
    at = text.index(SPLIT_MARKER)
    return text[:at], text[at:]


class CompletionRequest(_Request):
    """POST /v1/completions (see the module docstring for how the text is split)."""

    prompt: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5, description="0: the chosen tokens' log-probabilities")

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def refusal(self, certified_tokens: int) -> FieldError | None:
        if self.logprobs:
            return FieldError(f"logprobs: certkv returns the certified greedy decode's own token log-probabilities; "
                              f"the {self.logprobs} most likely alternatives per token are not recorded: pass 0",
                              "logprobs")
        return super().refusal(certified_tokens)

    def split(self) -> tuple[str, str]:
        if self.context is not None and self.prompt == "":
            return self.model_copy(update={"prompt": None}).split()  # an empty prompt is an absent prompt
        if self.context is not None or (self.question is not None and self.prompt is None):
            if self.prompt is not None:
                raise SplitError("prompt: give either prompt or context, not both", "prompt")
            if self.context is None or self.question is None:
                raise SplitError("context: context and question must be given together", "context")
            return self.context, self.question
        if self.prompt is None:
            raise SplitError("prompt: give a prompt, or the fields context and question", "prompt")
        if self.question is not None:
            return self.prompt, self.question
        return split_prompt(self.prompt, "prompt")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict] | None = None
    name: str | None = None

    def is_empty(self) -> bool:
        """No text: content absent, ``""`` or an empty list of parts (counts as an absent message)."""
        return self.content in (None, "", [])

    def text(self, param: str) -> str:
        if isinstance(self.content, str):
            return self.content
        if isinstance(self.content, list) and all(p.get("type") == "text" and isinstance(p.get("text"), str)
                                                  for p in self.content):
            return "".join(p["text"] for p in self.content)
        raise SplitError(f"{param}.content: must be a string or a list of text parts", f"{param}.content")


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions (see the module docstring for how the messages are split)."""

    messages: list[ChatMessage] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def refusal(self, certified_tokens: int) -> FieldError | None:
        if self.top_logprobs:
            return FieldError(f"top_logprobs: certkv returns the certified greedy decode's own token "
                              f"log-probabilities; the {self.top_logprobs} most likely alternatives per token are "
                              "not recorded: pass 0 or omit it", "top_logprobs")
        return super().refusal(certified_tokens)

    def split(self) -> tuple[str, str]:
        msgs = self.messages or []
        if self.context is not None:
            return self.context, self._question_beside_context(msgs)
        for i, m in enumerate(msgs):
            if m.role not in ("system", "user"):
                raise SplitError(f"messages.{i}.role: only system and user messages can be split into context and "
                                 f"question, got {m.role!r}", f"messages.{i}.role")
        if len(msgs) == 1 and msgs[0].role == "user":
            text = msgs[0].text("messages.0")
            return (text, self.question) if self.question is not None else split_prompt(text, "messages.0.content")
        if len(msgs) == 1 and msgs[0].role == "system" and self.question is not None:
            return msgs[0].text("messages.0"), self.question
        if len(msgs) == 2 and msgs[1].role == "user" and self.question is None:
            return msgs[0].text("messages.0"), msgs[1].text("messages.1")
        raise SplitError(
            "messages: must be one user message (split at 'Question:', or the context when question is given) or "
            f"two messages: a system or user message with the context, then a user message with the question "
            f"(got {len(msgs)}{' plus question' if self.question is not None else ''})", "messages")

    def _question_beside_context(self, msgs: list[ChatMessage]) -> str:
        """The question of a request that gives ``context``: the ``question`` field, with every
        message empty; or, without the field, the one non-empty message, a user message."""
        given = [(i, m) for i, m in enumerate(msgs) if not m.is_empty()]
        if self.question is not None:
            if given:
                raise SplitError("messages: give either messages or context and question, not both "
                                 f"(messages.{given[0][0]} is not empty)", "messages")
            return self.question
        if len(given) == 1 and given[0][1].role == "user":
            i, message = given[0]
            return message.text(f"messages.{i}")
        raise SplitError("question: with context, give the question field, or the question as the one non-empty "
                         f"user message (got {len(given)} non-empty messages)", "question")
