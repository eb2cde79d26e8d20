"""The full-cache answer as steps (:mod:`certkv.runtime.steps`): one plain prefill, then its decode.

Every path answers from the full cache the same way, :func:`certkv.engine.full_cache.decode_full`,
whose answer is calibration's ``full`` record token for token; this module gives that answer with a prefill of its
own (a fallback, a request outside the certificate, an override, an escalation whose full cache is
gone), from a full prefill a path already holds (:func:`decode_from_full`), and after the tokens a
recompute gate kept (:func:`restart_steps`).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from certkv.engine.decoding_run import finish_on_full_cache
from certkv.engine.full_cache import decode_full, prefill_full
from certkv.runtime.steps import Decode, Reserve

if TYPE_CHECKING:
    from collections.abc import Generator

    from transformers import DynamicCache, PreTrainedModel

    from certkv.model.generation import EncodedRequest
    from certkv.runtime.steps import Step


def prefill_slots(model: PreTrainedModel, enc: EncodedRequest, max_new_tokens: int, extra: int = 0) -> int:
    """Token slots a request may hold from its prefill until its answer is decoded: the full
    prefill, its question and answer, `extra` (a probe's tokens), and one layer of that copied
    once (a cache moved into the decoding batch, or gathered, one layer at a time)."""
    held = len(enc.context_ids) + len(enc.question_ids) + max_new_tokens + extra
    return held + math.ceil(held / model.config.num_hidden_layers)


def decode_from_full(
    model: PreTrainedModel, cache: DynamicCache, enc: EncodedRequest, max_new_tokens: int, stop_ids: set[int]
) -> Generator[Step, None, list[int]]:
    """The full-cache answer from a full prefill's `cache` (which the step may take over), cropped
    back to the context first (a probe or an evicted decode may have fed tokens after it)."""
    cache.crop(len(enc.context_ids))
    job = Decode(
        cache,
        list(enc.question_ids),
        len(enc.context_ids),
        max_new_tokens,
        stop_ids,
        solo=lambda: (decode_full(model, cache, enc, max_new_tokens, stop_ids), None),
        lookup_ids=list(enc.context_ids),
        final=True,  # nothing replaces the full cache's answer: it may stream as decoded
    )
    yield job
    assert job.ids is not None  # whoever runs the steps fills the answer in before resuming
    return job.ids


def full_answer_steps(
    model: PreTrainedModel, enc: EncodedRequest, max_new_tokens: int, stop_ids: set[int], seconds: dict[str, float] | None = None
) -> Generator[Step, None, list[int]]:
    """The full-cache answer with a prefill of its own; its ``prefill`` and ``decode`` seconds go
    into `seconds` when given (the prefill's from the moment its KV was reserved)."""
    yield Reserve(prefill_slots(model, enc, max_new_tokens))
    t0 = time.perf_counter()
    cache, _, _ = prefill_full(model, enc.context_ids)
    t1 = time.perf_counter()
    ids = yield from decode_from_full(model, cache, enc, max_new_tokens, stop_ids)
    if seconds is not None:
        seconds.update(prefill=t1 - t0, decode=time.perf_counter() - t1)
    return ids


def restart_steps(
    model: PreTrainedModel, enc: EncodedRequest, kept: list[int], restarted_at: int, max_new_tokens: int, stop_ids: set[int]
) -> Generator[Step, None, list[int]]:
    """The answer a recompute gate restarted after its first `restarted_at` tokens, `kept`: the
    context prefilled afresh with the full cache, the question and `kept` fed in one forward, the
    answer finished on the full cache (:func:`~certkv.engine.decoding_run.finish_on_full_cache`),
    as one solo, final :class:`Decode` within the request's reservation (the press's cache is gone by
    then). Its listener hears the restart at once, then each token; the ids include `kept`."""

    def solo() -> tuple[list[int], list[float] | None]:
        job.tell(kept)  # the restart is heard at once, before the full cache's first token
        return finish_on_full_cache(model, enc, kept, max_new_tokens, on_token=job.tell).token_ids, None

    job = Decode(None, [*enc.question_ids, *kept], len(enc.context_ids), max_new_tokens, stop_ids, solo=solo,
                 batchable=False, final=True, restarted_at=restarted_at)
    yield job
    assert job.ids is not None  # whoever runs the steps fills the answer in before resuming
    return job.ids
