"""Server-sent events for ``"stream": true``: the answer, cut at token boundaries, then ``[DONE]``.

certkv decides and decodes a request before it answers (a post-decode gate may replace the evicted
answer by the full cache's), so a stream carries a finished answer: one chunk per token's new text,
then a last chunk with the finish reason, the usage and the ``certkv`` object, then
``data: [DONE]``, as OpenAI's clients expect; with ``stream_options.include_usage`` the usage comes
once more in a chunk of its own with no choices before ``[DONE]``, as OpenAI sends it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING

from certkv.serve.responses import (
    CertkvInfo,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    Usage,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def token_pieces(tokenizer: PreTrainedTokenizerBase, ids: list[int], text: str) -> list[str]:
    """The answer's text cut at token boundaries (each piece the new text its token adds); the
    whole text as one piece when decoding token by token does not rebuild it."""
    out, prev = [], ""
    for i in range(len(ids)):
        cur = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        if cur.startswith(prev) and cur != prev:
            out.append(cur[len(prev):])
            prev = cur
    if prev != text:
        return [text]
    return out


def sse_events(answer_id: str, created: int, model: str, pieces: list[str], *, chat: bool, finish_reason: str,
               usage: Usage, certkv: CertkvInfo, include_usage: bool = False) -> Iterator[str]:
    """The ``data:`` lines of a streamed answer: one chunk per piece, a last chunk with the finish
    reason, usage and certkv, (`include_usage`: a chunk with the usage and no choices,) then ``[DONE]``."""

    def chunk(piece: str | None, finish: str | None, first: bool = False, last: bool = False) -> str:
        body: ChatCompletionChunk | CompletionResponse
        if chat:
            delta = ChatDelta(role="assistant" if first else None, content=piece)
            body = ChatCompletionChunk(id=answer_id, created=created, model=model,
                                       choices=[ChatChunkChoice(delta=delta, finish_reason=finish)],
                                       usage=usage if last else None, certkv=certkv if last else None)
        else:
            body = CompletionResponse(id=answer_id, created=created, model=model,
                                      choices=[CompletionChoice(text=piece or "", finish_reason=finish)],
                                      usage=usage if last else None, certkv=certkv if last else None)
        # through pydantic-core's JSON, which writes a NaN or an infinity (a signal not measured) as
        # null; json.dumps of model_dump would write a bare NaN, which is not JSON
        data = json.loads(body.model_dump_json(exclude=None if last else {"usage", "certkv"}))
        if chat:  # a delta names only what it carries
            data["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        return f"data: {json.dumps(data)}\n\n"

    for i, piece in enumerate(pieces or [""]):
        yield chunk(piece, None, first=i == 0)
    yield chunk(None, finish_reason, last=True)
    if include_usage:
        shape = ChatCompletionChunk if chat else CompletionResponse
        yield f"data: {shape(id=answer_id, created=created, model=model, choices=[], usage=usage).model_dump_json()}\n\n"
    yield "data: [DONE]\n\n"
