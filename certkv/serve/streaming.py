"""Server-sent events for ``"stream": true``: the answer as it is decoded, then ``[DONE]``.

A streamed request's tokens leave as the scheduler decodes them (:mod:`certkv.serve.scheduler`:
the job's listener hears its answer so far after each batched step). The scheduler runs on a
thread of its own and the routes on the event loop, so a :class:`TokenFeed` hands the answers over
(``call_soon_threadsafe`` into an ``asyncio.Queue``, in the order they were decoded, then the end),
and a :class:`PieceStream` turns each into the new text it settles. What streams is the decoding
of an answer no later gate can replace (a decode marked ``final``, :mod:`certkv.runtime.steps`):

* a full-cache answer, an evicted answer behind no post-decode gate, and a decoding-time press's
  answer behind the recompute gate stream token by token (a batched step may settle several at
  once, accepted prompt-lookup tokens);
* an evicted answer behind a post-decode gate (confidence, certificate, a learned model reading
  them) is decoded in full before the gate decides: nothing is sent until then; if the gate keeps
  it the whole answer is flushed at once, if it escalates the full cache's answer streams as it is
  decoded;
* when the recompute gate restarts an answer on the full cache after its first k tokens, a chunk
  with no text whose ``certkv`` object is ``{"event": "recompute", "recomputed_at": k}`` says so.
  The k tokens already sent stand: under greedy decoding the restart prefills them after the
  context and continues from them, so nothing sent is withdrawn and a client just appends.

Every chunk is OpenAI's shape; the last carries the finish reason, the usage and the ``certkv``
object, then ``data: [DONE]``; with ``stream_options.include_usage`` the usage comes instead in a
chunk of its own with no choices, before ``[DONE]``, as OpenAI sends it. The text of the chunks
concatenates to exactly the final answer's (as cut by ``stop`` or a token limit: :class:`StopHold`
holds back text that may turn out to begin a stop string).
A failure after the first chunk (the status line is sent by then) arrives as an ``error`` event
(OpenAI's error body), which the ``openai`` client raises as an ``APIError``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel

from certkv.serve.answer_cut import first_stop, token_texts
from certkv.serve.responses import (
    CertkvInfo,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    ErrorResponse,
    Usage,
)

if TYPE_CHECKING:
    from concurrent.futures import Future

    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("certkv.serve")

#: What a stream holds back at the end of the text decoded so far: the replacement character of a
#: UTF-8 sequence the next token completes, and, for a tokenizer that cleans up spaces on decoding
#: (" ." becomes "."), trailing whitespace the next token may fold.
_UNSETTLED = re.compile("\ufffd+$")
_UNSETTLED_SPACES = re.compile("[\\s\ufffd]+$")


def token_pieces(tokenizer: PreTrainedTokenizerBase, ids: list[int], text: str) -> list[str]:
    """`text` cut at token boundaries: the non-empty texts the tokens `ids` add
    (:func:`~certkv.serve.answer_cut.token_texts`), clipped where `text` ends (a stop string cut
    it inside a token); the whole text as one piece when the tokens do not rebuild it."""
    out, length = [], 0
    for piece in (t for t in token_texts(tokenizer, ids) if t):
        if length >= len(text):
            break
        piece = piece[: len(text) - length]
        out.append(piece)
        length += len(piece)
    return out if "".join(out) == text else [text]


class PieceStream:
    """The text of an answer whose tokens come in growing lists: :meth:`add` gives the new text each
    settles (``sent``: all of it so far)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.sent = ""
        self._unsettled = _UNSETTLED_SPACES if getattr(tokenizer, "clean_up_tokenization_spaces", False) else _UNSETTLED

    def add(self, ids: list[int]) -> str:
        """The settled text of `ids` (the answer so far) beyond what was sent; "" when none."""
        settled = self._unsettled.sub("", self.tokenizer.decode(ids, skip_special_tokens=True))
        if len(settled) <= len(self.sent) or not settled.startswith(self.sent):
            return ""
        piece, self.sent = settled[len(self.sent):], settled
        return piece


#: What a :class:`TokenFeed` holds: (the answer so far, restarted_at), or None once the request ended.
Item = tuple[list[int], int | None] | None


class TokenFeed:
    """One streamed request's tokens, from the scheduler's thread to the event loop.

    Called (as a :data:`~certkv.runtime.steps.TokenListener`) on the scheduler's thread; read with
    :meth:`first` and :meth:`next` on `loop`.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._pending: collections.deque[Item] = collections.deque()  # taken from the queue, not yet read

    def __call__(self, ids: list[int], restarted_at: int | None) -> None:
        self._put((ids, restarted_at))

    def _put(self, item: Item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass  # the loop has closed: nobody reads any more

    async def first(self, future: Future) -> Item:
        """The first answer so far of the request whose outcome is `future`, or None when it ended
        first (its answer was never heard as decoded, or it failed)."""
        future.add_done_callback(lambda _: self._put(None))  # after every token: the same thread's order
        return await self.next()

    async def next(self) -> Item:
        """The latest answer so far waiting (earlier ones of the same restart are contained in it),
        or None once the request ended."""
        if not self._pending:
            self._pending.append(await self._queue.get())
        while not self._queue.empty():
            self._pending.append(self._queue.get_nowait())
        item = self._pending.popleft()
        while item is not None and self._pending and self._pending[0] is not None and self._pending[0][1] == item[1]:
            item = self._pending.popleft()
        return item


class StreamRestart(BaseModel):
    """The ``certkv`` object of the chunk that says a recompute gate restarted the answer on the
    full cache after its first `recomputed_at` tokens (module docstring: those stand)."""

    event: Literal["recompute"] = "recompute"
    recomputed_at: int


@dataclass
class Chunks:
    """The ``data:`` lines of one streamed answer; the first chunk of a chat names the role."""

    answer_id: str
    created: int
    model: str
    chat: bool
    _started: bool = False

    @classmethod
    def new(cls, model: str, chat: bool) -> Chunks:
        return cls(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time()), model, chat)

    def piece(self, text: str | None, finish: str | None = None, usage: Usage | None = None,
              certkv: CertkvInfo | StreamRestart | None = None) -> str:
        """A chunk with `text` (None: none); `usage` and `certkv` only on the last and the restart chunk."""
        body: ChatCompletionChunk | CompletionResponse
        info = certkv if isinstance(certkv, CertkvInfo) else None
        if self.chat:
            delta = ChatDelta(role=None if self._started else "assistant", content=text)
            body = ChatCompletionChunk(id=self.answer_id, created=self.created, model=self.model, usage=usage,
                                       choices=[ChatChunkChoice(delta=delta, finish_reason=finish)], certkv=info)
        else:
            body = CompletionResponse(id=self.answer_id, created=self.created, model=self.model, usage=usage,
                                      choices=[CompletionChoice(text=text or "", finish_reason=finish)], certkv=info)
        self._started = True
        # through pydantic-core's JSON, which writes a NaN or an infinity (a signal not measured) as
        # null; json.dumps of model_dump would write a bare NaN, which is not JSON
        data = json.loads(body.model_dump_json(exclude=None if info is not None else {"usage", "certkv"}))
        if self.chat:  # a delta names only what it carries
            data["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        if isinstance(certkv, StreamRestart):
            data["certkv"] = certkv.model_dump()
        return f"data: {json.dumps(data)}\n\n"

    def last(self, finish: str, usage: Usage | None, certkv: CertkvInfo) -> str:
        return self.piece(None, finish, usage, certkv)

    def ending(self, finish: str, usage: Usage, certkv: CertkvInfo, include_usage: bool) -> Iterator[str]:
        """The last chunk, then ``[DONE]``; with `include_usage` the usage moves from the last chunk
        to a chunk of its own (a client that sums the usage of every chunk counts it once)."""
        yield self.last(finish, None if include_usage else usage, certkv)
        if include_usage:
            yield self.usage_only(usage)
        yield self.done()

    def usage_only(self, usage: Usage) -> str:
        """``stream_options.include_usage``'s chunk: the usage and no choices."""
        shape = ChatCompletionChunk if self.chat else CompletionResponse
        body = shape(id=self.answer_id, created=self.created, model=self.model, choices=[], usage=usage)
        return f"data: {body.model_dump_json()}\n\n"

    def restart(self, recomputed_at: int) -> str:
        return self.piece(None, certkv=StreamRestart(recomputed_at=recomputed_at))

    @staticmethod
    def error(body: ErrorResponse) -> str:
        """An error after the stream began: OpenAI's error body as an event (the client raises it)."""
        return f"data: {body.model_dump_json()}\n\n"

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"


def sse_events(chunks: Chunks, pieces: list[str], *, finish_reason: str, usage: Usage,
               certkv: CertkvInfo, include_usage: bool = False) -> Iterator[str]:
    """The ``data:`` lines of an answer finished before any of it was sent (a post-decode gate
    kept it): one chunk per piece, a last chunk with the finish reason, usage and certkv,
    (`include_usage`: a chunk with the usage and no choices,) then ``[DONE]``."""
    for piece in pieces or [""]:
        yield chunks.piece(piece)
    yield from chunks.ending(finish_reason, usage, certkv, include_usage)


class StopHold:
    """Streamed text cut at the first of `stops`: :meth:`add` gives what may be sent of the text
    settled so far, holding back an end that could still grow into a stop string; once a stop
    string appears, nothing more is sent (the text before it is the answer's, as
    :func:`~certkv.serve.answer_cut.cut_answer` cuts the finished answer: both cut where
    :func:`~certkv.serve.answer_cut.first_stop` says).

    >>> hold = StopHold(["END"])
    >>> hold.add("one E"), hold.add("N"), hold.add("D two")
    ('one ', '', '')
    >>> hold.sent
    'one '
    >>> overlapping = StopHold(["abcd", "bc"])  # "bc" is complete first: the cut is before it
    >>> overlapping.add("xab"), overlapping.add("cd rest"), overlapping.sent
    ('x', 'a', 'xa')
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.sent = ""
        self._text = ""
        self.stopped = False

    def add(self, piece: str) -> str:
        if self.stopped or not piece:
            return ""
        self._text += piece
        found = first_stop(self._text, self.stops)
        if found is not None:
            self.stopped = True
            safe = found[0]
        else:
            safe = len(self._text) - self._held_back()
        out, self.sent = self._text[len(self.sent):safe], self._text[:max(safe, len(self.sent))]
        return out

    def rest(self, text: str) -> str:
        """What the final (cut) `text` adds to the text sent ("" and a warning in the log when the
        text sent is not its start, which greedy decoding's growing answers never give)."""
        if not text.startswith(self.sent):
            log.warning("certkv serve: a streamed answer's text does not start with the text sent; the rest is left out")
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece

    def _held_back(self) -> int:
        """The longest end of the text that is the start of a stop string (0: none)."""
        text = self._text
        return max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)
