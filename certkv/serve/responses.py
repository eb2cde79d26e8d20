"""Response shapes of `certkv serve`: OpenAI's, typed, plus the ``certkv`` object and certkv's own routes.

Every body the server sends is one of these pydantic models, so a field cannot drift between a route
and its documentation: completions and chat completions (whole and as stream chunks), the model
list, errors (``{"error": {"message", "type", "param", "code"}}``, OpenAI's shape) and ``/health``.
The ``certkv`` object in every answer carries the runtime's Decision record, the monitor stream it
was counted in and that stream's state, whether it was shadowed, the request id, the runtime's
seconds and, when the certified answer was cut (a token limit, a stop string), how. Fields OpenAI's
clients read as absent-or-null (``logprobs``, an error's ``param``) are always present, null when
there is nothing to say.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body; the message is one line (whitespace collapsed)."""

    error: ErrorDetail

    @classmethod
    def of(cls, message: str, type_: str, param: str | None = None, code: str | None = None) -> ErrorResponse:
        return cls(error=ErrorDetail(message=" ".join(str(message).split()), type=type_, param=param, code=code))


class CutInfo(BaseModel):
    """How a certified answer was cut after it was decoded: ``by`` a ``stop`` string (``stop``
    names the one found) or the request's token limit (``max_tokens``); the certified answer had
    ``certified_tokens`` tokens, the returned text comes from the first ``tokens`` of them."""

    by: Literal["stop", "max_tokens"]
    stop: str | None = None
    certified_tokens: int
    tokens: int


class CertkvInfo(BaseModel):
    """How certkv answered: ``decision`` is :class:`~certkv.runtime.certified_runtime.Decision`'s record,
    ``seconds`` the runtime's time per stage (prefill, decode, ..., total)."""

    request_id: str
    decision: dict[str, Any]
    stream: str | None
    monitor: dict[str, Any] | None
    shadowed: bool
    seconds: dict[str, float]
    cut: CutInfo | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """A completion's ``logprobs``: each returned token's text, log p and offset in the answer's
    text; ``top_logprobs`` is null (the certified decode records no alternatives)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class TokenLogprob(BaseModel):
    """One returned token of a chat answer: its text, log p and UTF-8 bytes (no alternatives)."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatDelta(BaseModel):
    """A stream chunk's delta; unset fields are left out of the chunk (``exclude_unset``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None


class _Answer(BaseModel):
    id: str
    created: int
    model: str


class _Streamable(_Answer):
    """A shape a stream's chunks share: only the last chunk carries usage and certkv."""

    usage: Usage | None = None
    certkv: CertkvInfo | None = None


class CompletionResponse(_Streamable):
    """POST /v1/completions, whole; as a stream, each chunk has this shape too."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionResponse(_Answer):
    """POST /v1/chat/completions, whole."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    certkv: CertkvInfo


class ChatCompletionChunk(_Streamable):
    """One event of a streamed chat completion."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "certkv"
    certkv: dict[str, str]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PointSummary(BaseModel):
    """The deployed operating point, as /health names it."""

    path: str | None
    policy: str
    press: str
    kv_retained: float
    fallback: bool
    stratified: bool
    risk: float
    confidence: float
    tolerance: float
    utility: str | None
    query_aware: bool


class QueueState(BaseModel):
    depth: int
    max: int
    shadow_pending: int


class KVState(BaseModel):
    """The scheduler's KV in token slots (``budget`` null: unlimited); ``peak`` is sampled after every
    admission and decode step; ``max_batch`` is the most requests one decode step advanced;
    ``given_back`` the slots lanes gave back mid-answer at a decoding-time press's compression events."""

    budget: int | None
    in_use: float
    peak: float
    requests_in_flight: int
    admissions_waiting: int
    decode_steps: int
    max_batch: int
    given_back: float = 0.0


class ShadowCounts(BaseModel):
    scored: int
    abandoned: int


class MonitoredHealth(BaseModel):
    """What GET /health of ``certkv serve`` and of ``certkv gateway`` share: the model and point
    deployed, ``in_flight`` (HTTP requests received and not yet answered), the live monitor
    (``monitoring`` is ``off`` under ``--shadow-rate 0``: no shadows, no monitor, nothing watches
    the deployed risk), its shadows, streams and tripped streams, and the uptime. Each server
    narrows ``status`` and adds its own state."""

    status: str
    model: str
    operating_point: PointSummary
    in_flight: int
    monitoring: Literal["on", "off"]
    shadow_rate: float
    shadow_store: str | None
    shadows: ShadowCounts
    monitor: dict[str, dict[str, Any]]
    tripped: list[str]
    uptime_s: float


class HealthResponse(MonitoredHealth):
    """GET /health of ``certkv serve``: ``status`` is ``ok``, ``tripped`` (a monitor stream
    tripped) or ``stopping``; its queue and KV budget beside :class:`MonitoredHealth`'s fields."""

    status: Literal["ok", "tripped", "stopping"]
    queue: QueueState
    kv: KVState
