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
messages, a prompt list) is refused with 422 and the reason. Decoding is greedy at the calibrated
length (that is what the certificate covers): ``max_tokens`` may only equal it, ``n`` may only be
1, ``temperature``/``top_p``/``seed``/``user`` are accepted and ignored.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: The marker a plain prompt is split at (rule 3).
SPLIT_MARKER = "Question:"


class SplitError(ValueError):
    """A request whose text does not split into context and question; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    context: str | None = None
    question: str | None = None
    stratum: str | None = None
    answer_prefix: str = Field(
        default="", description="text the answer starts with, after the question (as a calibration request's answer_prefix)")
    answers: list[str] | str | None = Field(
        default=None, description="reference answers, read only by the shadow's utility (else agreement)")
    stream: bool = False
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    user: str | None = None

    def reference_answers(self) -> list[str] | None:
        if self.answers is None:
            return None
        return [self.answers] if isinstance(self.answers, str) else list(self.answers)


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
