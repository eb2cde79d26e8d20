"""A certified answer cut as a request asks (a token limit, stop strings), and its log-probabilities in OpenAI's shapes.

The certified answer is always decoded whole, at the calibrated length: a post-decode gate decides
on the whole answer, as calibration did, and greedy decoding is causal, so the first k tokens of
that answer are exactly what a greedy decode of k tokens gives. A request's token limit
(``max_tokens`` / ``max_completion_tokens``) and its ``stop`` strings therefore cut the certified
answer after it is decoded: first at the limit, then at the earliest occurrence of any stop string
in what is left (the stop string itself left out, as OpenAI does). What is returned is a prefix
of a certified answer, and the response's ``certkv.cut`` (:class:`~certkv.serve.responses.CutInfo`)
says where and why. The log-probabilities are those the certified decode computed for the tokens
the returned text comes from, each token's own text beside its log p (a token that adds no
text, such as a leading space a tokenizer drops, is there with ``""``; the end-of-answer token is
left out).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING

from certkv.model.stopping import ends_on_stop
from certkv.serve.responses import ChatLogprobs, CompletionLogprobs, CutInfo, TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class Cut:
    """What is returned of a certified answer: `text`, from its first `tokens` tokens; the
    `finish_reason` OpenAI's clients read; `info` the response's ``certkv.cut`` (None: not cut)."""

    text: str
    tokens: int
    finish_reason: str
    info: CutInfo | None = None


def token_texts(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    """The text each of `ids` adds to the decoded answer (``""`` for a token that adds none, such
    as the end-of-answer token, or the first bytes of a character a later token completes)."""
    out, prev = [], ""
    for i in range(len(ids)):
        cur = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        if "\ufffd" in cur[len(prev):]:
            out.append("")  # a character not yet complete: its text comes with a later token
        elif cur.startswith(prev):
            out.append(cur[len(prev):])
            prev = cur
        else:  # the text so far was rewritten (a tokenizer that cleans up spaces): start again from it
            out.append("")
            prev = cur
    return out


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Where `text` is cut by `stops`: (start, stop string) of the occurrence that is complete
    first as the text grows (the smallest end; among those, the earliest start), or None. A stream
    checks its text as it grows, so this is the rule that cuts a streamed answer and a whole one
    alike (:class:`~certkv.serve.streaming.StopHold`).

    Examples
    --------
    >>> first_stop("xabcd rest", ["abcd", "bc"])
    (2, 'bc')
    >>> first_stop("no stop here", ["#"]) is None
    True
    """
    found = [(at + len(s), at, s) for s in stops if s and (at := text.find(s)) >= 0]
    if not found:
        return None
    _, at, stop = min(found)
    return at, stop


def cut_answer(text: str, texts: list[str], finish_reason: str, *, limit: int | None, stops: list[str]) -> Cut:
    """Cut the certified answer `text` (whose tokens add `texts`, :func:`token_texts`) at `limit`
    tokens, then before the first of `stops` complete (:func:`first_stop`); unchanged (and
    `finish_reason` kept) when neither cuts.

    Examples
    --------
    >>> pieces = ["The", " answer", " is", " 42", "."]
    >>> cut_answer("The answer is 42.", pieces, "stop", limit=None, stops=[" is", "."]).text
    'The answer'
    >>> cut = cut_answer("The answer is 42.", pieces, "stop", limit=2, stops=["42"])
    >>> cut.text, cut.tokens, cut.finish_reason, cut.info.by
    ('The answer', 2, 'length', 'max_tokens')
    """
    n = kept = len(texts)
    info = None
    if limit is not None and limit < n:
        text, finish_reason, kept = "".join(texts[:limit]), "length", limit
        info = CutInfo(by="max_tokens", certified_tokens=n, tokens=limit)
    found = first_stop(text, stops)
    if found is None:
        return Cut(text, kept, finish_reason, info)
    at, stop = found
    start, tokens = 0, 0
    for piece in texts[:kept]:  # the tokens whose text begins before the cut
        if start >= at:
            break
        start, tokens = start + len(piece), tokens + 1
    return Cut(text[:at], tokens, "stop", CutInfo(by="stop", stop=stop, certified_tokens=n, tokens=tokens))


def _returned(texts: list[str], logprobs: list[float], tokens: int, text: str) -> list[tuple[str, float]]:
    """(text, log p) of the first `tokens` tokens, each token's text clipped to the returned `text`."""
    out, start = [], 0
    for piece, logprob in zip(texts[:tokens], logprobs[:tokens], strict=True):
        out.append((piece[: max(len(text) - start, 0)], logprob))
        start += len(piece)
    return out


def chat_logprobs(texts: list[str], logprobs: list[float], tokens: int, text: str) -> ChatLogprobs:
    """A chat choice's ``logprobs``: one entry per returned token (its text, log p and UTF-8 bytes)
    of the first `tokens` (:func:`logprob_tokens`) that the returned `text` comes from."""
    return ChatLogprobs(content=[TokenLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                                 for t, lp in _returned(texts, logprobs, tokens, text)])


def completion_logprobs(texts: list[str], logprobs: list[float], tokens: int, text: str) -> CompletionLogprobs:
    """A completion choice's ``logprobs``: the first `tokens` tokens, their log p and their offsets in `text`."""
    pairs = _returned(texts, logprobs, tokens, text)
    offsets, at = [], 0
    for t, _ in pairs:
        offsets.append(at)
        at += len(t)
    return CompletionLogprobs(tokens=[t for t, _ in pairs], token_logprobs=[lp for _, lp in pairs], text_offset=offsets)


def finish_reason(ids: list[int], max_new_tokens: int, stop_ids: Container[int]) -> str:
    """Why the certified answer `ids` ended, as OpenAI's ``finish_reason``: ``stop`` when it ended on
    a stop token, ``length`` when it reached `max_new_tokens` otherwise. A stop token counts as the
    decoders' one stopping rule counts it (:func:`certkv.model.stopping.ends_on_stop`): never the
    first token, which decoding keeps and goes on from.

    Examples
    --------
    >>> finish_reason([5, 2], 8, {2}), finish_reason([5, 6], 2, {2})
    ('stop', 'length')
    >>> finish_reason([2], 1, {2})  # a first stop token did not end the answer: the limit did
    'length'
    """
    return "length" if len(ids) >= max_new_tokens and not ends_on_stop(ids, stop_ids) else "stop"


def logprob_tokens(cut: Cut, ids: list[int], stop_ids: Container[int]) -> int:
    """How many tokens of the certified answer `ids` the log-probabilities cover: those the returned
    text comes from, less the stop token that ended the answer (:func:`~certkv.model.stopping.ends_on_stop`:
    it has no text; a first token is never one).

    Examples
    --------
    >>> logprob_tokens(Cut("6386", 6, "stop"), [4, 11, 8, 13, 11, 2], {2})
    5
    """
    return cut.tokens - (cut.info is None and ends_on_stop(ids, stop_ids))
