"""A question on a kept compressed context: the single-prefill path's answer source on a prefix-cache hit.

When its context's compressed cache is kept (:mod:`certkv.runtime.prefix_cache`), a request on the
engine's single-prefill path skips its prefill: its question is decoded from a copy of the kept
entries, exactly as from the entries its own prefill would have gathered, behind the same gates
(:func:`~certkv.runtime.gate_flow.gate_flow`). No full cache exists, so its full answer, when a
pre-decode gate fires or a post-decode gate escalates, comes from a prefill of its own, as a lean
request's whose full cache is gone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from certkv.engine.decode_reserve import decode_reserve
from certkv.runtime.gate_flow import AnsweringPath, AnswerSource, EvictedAnswer
from certkv.runtime.kept_decode import decode_kept, one_lane_batch
from certkv.runtime.steps import Decode

if TYPE_CHECKING:
    from collections.abc import Generator

    from certkv.model.generation import EncodedRequest
    from certkv.runtime.prefix_cache import PrefixEntry
    from certkv.runtime.steps import Step


class CachedContext(AnswerSource):
    """`enc` answered from its context's kept `entry`; `lean`: the copy is a lane ``certkv serve``'s
    scheduler batches, otherwise it decodes alone as :func:`~certkv.runtime.kept_decode.evicted_decode`
    decodes. The source drops its reference to `entry` once it has copied it (or needs no copy), so
    that evicting the entry frees it (:mod:`certkv.runtime.prefix_cache`)."""

    def __init__(self, path: AnsweringPath, enc: EncodedRequest, max_new: int, entry: PrefixEntry, lean: bool) -> None:
        super().__init__(path, enc, max_new, prefix="hit")
        self.entry: PrefixEntry | None = entry
        self.lean = lean

    def decode(self) -> Generator[Step, None, EvictedAnswer]:
        entry, self.entry = self.entry, None
        assert entry is not None  # decoded once
        job, kept = self._job(entry), entry.kept  # the question's own copy
        del entry  # the copy is all the decode holds
        yield job
        assert job.ids is not None  # whoever runs the steps fills the answer in before resuming
        return EvictedAnswer(job.ids, job.logprobs, kept)

    def full_answer(self) -> Generator[Step, None, list[int]]:
        self.entry = None  # the full answer prefills its own cache
        return super().full_answer()

    def _job(self, entry: PrefixEntry) -> Decode:
        """The :class:`Decode` of the question over a copy of `entry`: lean, a lane the scheduler
        batches (what :func:`~certkv.engine.ragged_decode.gather_lane` would have built); otherwise decoded
        alone (the one-lane batch :func:`~certkv.engine.batched_decode.padded_cache` would have built)."""
        model, stop_ids, enc, max_new = self.path.model, self.path.stop_ids, self.enc, self.max_new
        question, n_ctx = list(enc.question_ids), len(enc.context_ids)
        if self.lean:
            return Decode(entry.lane(len(question) + max_new), question, n_ctx, max_new, stop_ids, solo=None,
                          lookup_ids=list(enc.context_ids), want_logprobs=True, final=self.final)
        batch, mask = one_lane_batch(entry.keys, entry.values, reserve=decode_reserve(len(question), max_new))
        return Decode(None, question, n_ctx, max_new, stop_ids, batchable=False, final=self.final,
                      solo=lambda: decode_kept(model, batch, mask, enc, max_new, stop_ids))


__all__ = ["CachedContext"]
