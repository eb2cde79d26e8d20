"""One request on the engine's single-prefill path: one full prefill, gates, then the kept entries.

For a fast-path press (:func:`certkv.engine.scoring.is_fast_path_press`), a response-aware press
or certkv's probabilistic press, :class:`SinglePrefillPath` does what calibration did for this
candidate, with the same engine functions:

1. **One full prefill** of the context under the engine's hooks: :func:`~certkv.engine.scoring.scoring_hooks`
   (the press's top-k indices per layer) or :func:`~certkv.engine.probabilistic_decode.selection_hooks`
   (its Poisson selection per layer), the :class:`~certkv.signals.agreement.AgreementRecorder` when the gate
   reads the drop, and :func:`~certkv.model.window_queries.capturing_window_queries`, as calibration
   prefills. Nothing is pruned: the full cache of shape (1, H_kv, n_ctx, d) per layer stays.
2. **Pre-decode signals and gates** while the full cache exists: the agreement drop, the lookahead
   probe (:func:`certkv.signals.lookahead.lookahead_probe`, its mass on the entries the press evicts)
   and a learned score without confidence features. When the gate says so, the answer is decoded
   from that same cache: no second prefill.
3. **The evicted answer**: the kept entries are gathered into a one-row cache and decoded with
   their log-probabilities (:func:`~certkv.engine.batched_decode.decode_candidates`,
   :func:`~certkv.engine.probabilistic_decode.decode_probabilistic`).
4. **Post-decode gates** (certificate, confidence, learned with confidence features): an escalated
   request's full answer is decoded from the full cache; ``seconds["escalation"]`` is that
   recomputation.

The path is written as steps (:mod:`certkv.runtime.steps`). In-process (:meth:`SinglePrefillPath.answer`)
the full cache is held to the end, as calibration holds it. Run *lean* (``certkv serve``'s
scheduler) the full cache is freed as soon as the kept entries are gathered
(:func:`~certkv.engine.ragged_decode.gather_row`, the same entries in the same order as
``padded_cache``), so a decoding request holds only its retained KV; an escalation then prefills
the context again (same kernels, same full answer). Behind no gate that reads the full cache after
the prefill, a plain top-k press gathers each layer's kept entries as soon as the layer is
prefilled (:mod:`certkv.engine.layer_pruning`), so the full prefill never exists at once and the
request reserves only that peak (:meth:`SinglePrefillPath.reservation`). The probabilistic press always holds its full
cache: its Hájek decode is its own, unbatched.

The full-cache answer is always decoded as :func:`certkv.engine.full_cache.decode_full` decodes it,
which is the store's ``full`` record token for token (calibration decodes it so, or, beside
decoding rows, as the first row of their batch: the same greedy answer, checked in the tests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from kvpress.utils import compute_n_kept

from certkv.engine.batched_decode import decode_candidates, kept_count, padded_cache, reserved_layer_class
from certkv.engine.engine import is_probabilistic_press
from certkv.engine.full_cache import prefill_full
from certkv.engine.layer_pruning import LayerPruner, pruned_peak_slots
from certkv.engine.probabilistic_decode import decode_probabilistic
from certkv.engine.ragged_decode import RowCache, gather_row
from certkv.engine.scoring import is_fast_path_press
from certkv.presses.poisson_selection import Selection
from certkv.presses.response_aware import is_response_aware_press, prefill_observers
from certkv.runtime.full_path import decode_from_full, full_answer_steps, prefill_slots
from certkv.runtime.gating import agreement_settings, post_decode_reason, pre_decode_reason
from certkv.runtime.prefix_cache import PrefixCache, PrefixEntry, PrefixReserve, PrefixScope, entry_from_full, entry_from_row
from certkv.runtime.steps import Decode, PathAnswer, Reserve, Step, Steps, run_alone
from certkv.signals.agreement import AgreementRecorder
from certkv.signals.lookahead import evicted_mass, lookahead_probe

if TYPE_CHECKING:
    from collections.abc import Generator

    from kvpress import BasePress
    from transformers import DynamicCache, PreTrainedModel

    from certkv.core.spec import GateSettings
    from certkv.model.generation import EncodedRequest

#: One candidate's kept entries of the full cache, per layer: a fast-path press's kept indices, a
#: (1, H_kv, n_kept) long tensor (None: keeps everything), or the probabilistic press's Selection.
KeptSelection = list[torch.Tensor | None] | list[Selection | None]


@dataclass
class SinglePrefillPath:
    """Answer requests with `press` on the engine's single-prefill path, behind `gate`.

    `policy` names the press's candidate (the key the engine's hooks record it under).
    """

    model: PreTrainedModel
    press: BasePress
    gate: GateSettings
    policy: str
    stop_ids: set[int]

    def answer(self, enc: EncodedRequest, max_new: int, signals: dict[str, Any]) -> PathAnswer:
        """Answer `enc` in-process, as calibration did; `signals` (every signal name, None when not
        measured) is filled with what the gate read."""
        return run_alone(self.steps(enc, max_new, signals))

    def steps(self, enc: EncodedRequest, max_new: int, signals: dict[str, Any], lean: bool = False,
              prefix: PrefixScope | None = None) -> Steps:
        """The answer as steps (module docstring); `lean` frees the full cache before the evicted decode,
        layer by layer during the prefill when no gate reads the full cache (:meth:`prunes`). With a
        `prefix` cache, a context kept there is answered from it (:meth:`_cached_steps`), and any
        other keeps its compressed cache there for later questions."""
        model, gate, stop_ids = self.model, self.gate, self.stop_ids
        n_ctx, room = len(enc.context_ids), len(enc.question_ids) + max_new
        pruner = LayerPruner(n_ctx, room) if lean and self.prunes() else None
        miss = self.reservation(enc, max_new, pruned=pruner is not None)
        key, reserved = None, 0
        if prefix is None:
            yield Reserve(miss)
        else:
            key = prefix.key(enc.context_ids)
            reserve = PrefixReserve(prefix.cache, key, room, miss, keep=compute_n_kept(n_ctx, self.press.compression_ratio))
            yield reserve
            entry = prefix.cache.lookup(key)
            if entry is not None:
                return (yield from self._cached_steps(prefix.cache, entry, enc, max_new, signals, lean))
            prefix.cache.count(hit=False)
            if reserve.granted < miss:  # admitted to copy an entry evicted since: the prefill's KV
                yield Reserve(miss)
            reserved = reserve.kept_room
        seconds: dict[str, float] = {}
        cache, selection = self._prefill(enc, signals, seconds, pruner)
        if prefix is not None and key is not None:
            prefix.cache.put(key, self._entry(enc, cache, selection, signals, pruner), reserved)
        tag = None if prefix is None else "miss"
        reason = pre_decode_reason(gate, signals)
        t = time.perf_counter()
        if reason is not None:
            ids = yield from decode_from_full(model, cache, enc, max_new, stop_ids)
            seconds["decode"] = time.perf_counter() - t
            return PathAnswer(ids, reason, signals, seconds, prefix=tag)
        row = pruner.row() if pruner is not None else None
        ids, logprobs, kept, certificate = yield from self._evicted_steps(enc, cache, selection, max_new, lean, row)
        seconds["decode"] = time.perf_counter() - t
        reason = post_decode_reason(gate, signals, logprobs, certificate)
        if reason is None:
            return PathAnswer(ids, None, signals, seconds, kept=kept, prefix=tag)
        t = time.perf_counter()
        if cache.layers:  # held to the end: the full answer from it
            ids = yield from decode_from_full(model, cache, enc, max_new, stop_ids)
        else:  # lean: freed before the decode, prefilled again
            ids = yield from full_answer_steps(model, enc, max_new, stop_ids)
        seconds["escalation"] = time.perf_counter() - t
        return PathAnswer(ids, reason, signals, seconds, escalated=True, prefix=tag)

    def _cached_steps(self, cache: PrefixCache, entry: PrefixEntry, enc: EncodedRequest, max_new: int,
                      signals: dict[str, Any], lean: bool) -> Steps:
        """The answer from the context's kept compressed cache `entry` (:mod:`certkv.runtime.prefix_cache`),
        once the request holds its KV: no prefill, the question decoded from a copy of the entry,
        behind the same gates. The agreement drop is the one the context's prefill recorded; a
        pre-decode gate that fires, and an escalation, answer from a fresh full prefill, as a lean
        request whose full cache is gone does."""
        model, gate, stop_ids = self.model, self.gate, self.stop_ids
        cache.count(hit=True)
        if gate.needs_agreement:
            signals["agreement_drop"] = entry.agreement_drop
        seconds: dict[str, float] = {}
        t = time.perf_counter()
        reason = pre_decode_reason(gate, signals)
        if reason is not None:
            ids = yield from full_answer_steps(model, enc, max_new, stop_ids)
            seconds["decode"] = time.perf_counter() - t
            return PathAnswer(ids, reason, signals, seconds, prefix="hit")
        job, kept = self._entry_decode(entry, enc, max_new, lean), entry.kept  # the question's own copy
        del entry  # the copy is all the decode holds
        yield job
        assert job.ids is not None  # whoever runs the steps fills the answer in before resuming
        seconds["decode"] = time.perf_counter() - t
        reason = post_decode_reason(gate, signals, job.logprobs, None)
        if reason is None:
            return PathAnswer(job.ids, None, signals, seconds, kept=kept, prefix="hit")
        t = time.perf_counter()
        ids = yield from full_answer_steps(model, enc, max_new, stop_ids)
        seconds["escalation"] = time.perf_counter() - t
        return PathAnswer(ids, reason, signals, seconds, escalated=True, prefix="hit")

    def _entry_decode(self, entry: PrefixEntry, enc: EncodedRequest, max_new: int, lean: bool) -> Decode:
        """The :class:`Decode` of `enc`'s question over a copy of `entry`: lean, a row the scheduler
        batches (what :func:`~certkv.engine.ragged_decode.gather_row` would have built); otherwise decoded
        alone as :func:`evicted_decode` decodes (the one-row batch :func:`padded_cache` would have built)."""
        n_ctx, final = len(enc.context_ids), not self.gate.post_decode
        question, context = list(enc.question_ids), list(enc.context_ids)
        if lean:
            return Decode(entry.row(len(question) + max_new), question, n_ctx, max_new, self.stop_ids, solo=None,
                          lookup_ids=context, want_logprobs=True, final=final)
        batch, mask = one_row_batch(entry.keys, entry.values, reserve=len(question) + 4 * max_new)
        model, stop_ids = self.model, self.stop_ids
        return Decode(None, question, n_ctx, max_new, stop_ids, batchable=False, final=final,
                      solo=lambda: decode_kept(model, batch, mask, enc, max_new, stop_ids))

    def _entry(self, enc: EncodedRequest, cache: DynamicCache, selection: KeptSelection, signals: dict[str, Any],
               pruner: LayerPruner | None) -> PrefixEntry:
        """The compressed context a prefill just chose, copied out for the prefix cache (the full cache,
        or the rows a pruned prefill gathered, left as they are)."""
        n_ctx, drop = len(enc.context_ids), signals.get("agreement_drop")
        if pruner is not None:
            return entry_from_row(pruner.row(), n_ctx, drop)
        keys, values = [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
        return entry_from_full(keys, values, list(selection), n_ctx, drop)

    def prunes(self) -> bool:
        """Whether a lean run prunes its prefill layer by layer (:mod:`certkv.engine.layer_pruning`):
        a plain top-k press, behind no gate that reads the full cache after the prefill (a pre-decode
        gate answers from it, the lookahead probe reads it)."""
        gate = self.gate
        return is_fast_path_press(self.press) and not gate.pre_decode and not gate.needs_lookahead

    def reservation(self, enc: EncodedRequest, max_new: int, pruned: bool) -> int:
        """Token slots the request holds at its peak, up to its answer: with a `pruned` prefill, every
        layer's kept entries and room plus one full layer (:func:`~certkv.engine.layer_pruning.pruned_peak_slots`);
        otherwise the whole prefill, a probe's tokens and one layer copied (:func:`prefill_slots`)."""
        n_ctx, room = len(enc.context_ids), len(enc.question_ids) + max_new
        if pruned:
            kept = compute_n_kept(n_ctx, self.press.compression_ratio)
            return pruned_peak_slots([kept] * self.model.config.num_hidden_layers, n_ctx, room)
        probe = self.gate.lookahead_tokens if self.gate.needs_lookahead else 0
        # The probabilistic decode gathers its kept entries next to the full cache it keeps.
        extra = probe + (n_ctx + room if is_probabilistic_press(self.press) else 0)
        return prefill_slots(self.model, enc, max_new, extra=extra)

    def _prefill(
        self, enc: EncodedRequest, signals: dict[str, Any], seconds: dict[str, float], pruner: LayerPruner | None
    ) -> tuple[DynamicCache, KeptSelection]:
        """The context's full prefill under the press's scoring (or selection) hooks: (the full
        cache, the press's selection), with the pre-decode signals the gate reads put into
        `signals` (agreement drop, lookahead) and their times into `seconds`. With a `pruner` the
        kept entries are gathered into it layer by layer and the cache returned is empty."""
        model, gate, press = self.model, self.gate, self.press
        probabilistic, response_aware = is_probabilistic_press(press), is_response_aware_press(press)
        t0 = time.perf_counter()
        recorder = AgreementRecorder(**agreement_settings(gate)) if gate.needs_agreement else None
        cache, fast_sel, sampled = prefill_full(
            model,
            enc.context_ids,
            fast=None if probabilistic or response_aware else {self.policy: press},
            probabilistic={self.policy: press} if probabilistic else None,
            recorder=recorder,
            observers=prefill_observers([press]) if response_aware else (),
            pruner=pruner,
        )
        if response_aware:  # chosen over the full cache right after the prefill, as the engine chooses
            selection = press.select(model, cache, enc, self.stop_ids)
        else:
            selection = sampled[self.policy] if probabilistic else fast_sel[self.policy]
        seconds["prefill"] = time.perf_counter() - t0
        if recorder:
            signals["agreement_drop"] = recorder.drop()
            recorder.reset()
        if gate.needs_lookahead:
            t = time.perf_counter()
            heads = lookahead_heads(model, cache, enc, selection, gate.lookahead_tokens, self.stop_ids)
            signals["lookahead_heads"], signals["lookahead_mass"] = heads, max(heads)
            seconds["probe"] = time.perf_counter() - t
        return cache, selection

    def _evicted_steps(
        self, enc: EncodedRequest, cache: DynamicCache, selection: KeptSelection, max_new: int, lean: bool,
        row: RowCache | None = None,
    ) -> Generator[Step, None, tuple[list[int], list[float] | None, float, float | None]]:
        """The answer from the kept entries as one :class:`Decode` step: (ids, log-probabilities,
        realised share kept, certificate or None). A probabilistic press, or a run that keeps the
        full cache (not `lean`), decodes alone next to it; otherwise the kept entries are gathered
        into a row of their own (emptying `cache`; `row`: already gathered while prefilling) that a
        scheduler can batch with others."""
        model, stop_ids, n_ctx = self.model, self.stop_ids, len(enc.context_ids)
        probabilistic = is_probabilistic_press(self.press)
        if probabilistic or not lean:
            out: dict[str, Any] = {}

            def solo() -> tuple[list[int], list[float] | None]:
                out["ids"], out["logprobs"], out["kept"], out["certificate"] = evicted_decode(
                    model, cache, enc, selection, probabilistic, max_new, stop_ids
                )
                return out["ids"], out["logprobs"]

            yield Decode(None, list(enc.question_ids), n_ctx, max_new, stop_ids, solo=solo, batchable=False,
                         final=not self.gate.post_decode)
            return out["ids"], out["logprobs"], out["kept"], out["certificate"]
        kept = kept_count(cast("list[torch.Tensor | None]", selection), n_ctx) / n_ctx  # not probabilistic
        if row is None:
            row = gather_row(cache, selection, n_ctx, len(enc.question_ids) + max_new)  # empties `cache`
        job = Decode(row, list(enc.question_ids), n_ctx, max_new, stop_ids, solo=None,
                     lookup_ids=list(enc.context_ids), want_logprobs=True, final=not self.gate.post_decode)
        yield job
        assert job.ids is not None  # whoever runs the steps fills the answer in before resuming
        return job.ids, job.logprobs, kept, None


def evicted_decode(
    model: PreTrainedModel,
    cache: DynamicCache,
    enc: EncodedRequest,
    selection: KeptSelection,
    probabilistic: bool,
    max_new: int,
    stop_ids: set[int],
) -> tuple[list[int], list[float] | None, float, float | None]:
    """The candidate's answer from its kept entries of the full `cache` (left intact).

    `cache` holds the full prefill, (1, H_kv, n_ctx, d) keys and values per layer; `selection` the
    candidate's kept entries per layer (:data:`KeptSelection`).

    Returns (token ids, per-token log p, realised kept fraction, certificate maximum or None).
    Fast path: the kept entries in one row (:func:`~certkv.engine.batched_decode.padded_cache`,
    with the engine's reserve for the question and answer) decoded by ``decode_candidates``;
    probabilistic press: ``decode_probabilistic`` (Hájek attention, certificate per step).
    """
    n_ctx = len(enc.context_ids)
    if probabilistic:
        (result,) = decode_probabilistic(model, cache, [selection], enc.question_ids, n_ctx, max_new, stop_ids)
        return result.token_ids, result.logprobs, result.kept_fraction, result.certificate_max
    reserve = len(enc.question_ids) + 4 * max_new
    batch, mask, lengths = padded_cache(cache, [selection], n_ctx, reserve=reserve)
    ids, logprobs = decode_kept(model, batch, mask, enc, max_new, stop_ids)
    return ids, logprobs, lengths[0] / n_ctx, None


def decode_kept(
    model: PreTrainedModel, batch: DynamicCache, mask: torch.Tensor, enc: EncodedRequest, max_new: int,
    stop_ids: set[int],
) -> tuple[list[int], list[float] | None]:
    """(ids, per-token log p) of `enc`'s question decoded alone over `batch`, a one-row cache of kept
    entries with its (1, n_kept) 0/1 `mask` (:func:`padded_cache`, :func:`one_row_batch`), positions
    continuing from the uncompressed context length."""
    logprobs: list = [None]
    (ids,) = decode_candidates(
        model,
        batch,
        mask,
        enc.question_ids,
        [],
        len(enc.context_ids),
        max_new,
        stop_ids,
        context_ids=enc.context_ids,
        logprobs=logprobs,
    )
    return ids, logprobs[0]


def one_row_batch(keys: list[torch.Tensor], values: list[torch.Tensor], reserve: int) -> tuple[DynamicCache, torch.Tensor]:
    """Kept entries, (1, H_kv, n_kept, d) per layer, copied into the one-row batch cache that
    :func:`padded_cache` builds for one candidate (its buffers, `reserve` slots of room, its mask)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for k, v in zip(keys, values):
        n = k.shape[2]
        batch_keys = k.new_empty((1, k.shape[1], n + reserve, k.shape[3]))
        batch_values = v.new_empty((1, v.shape[1], n + reserve, v.shape[3]))
        batch_keys[:, :, :n].copy_(k)
        batch_values[:, :, :n].copy_(v)
        cache.layers.append(reserved_layer_class()(batch_keys, batch_values, n))
    return cache, torch.ones((1, keys[0].shape[2]), dtype=torch.long, device=keys[0].device)


def lookahead_heads(
    model: PreTrainedModel, cache: DynamicCache, enc: EncodedRequest, selection: KeptSelection, tokens: int, stop_ids: set[int]
) -> list[float]:
    """Per (layer, KV head), layer-major, the full-cache attention mass the probe's queries put on
    the context entries the candidate evicts, as the engine records it
    (:func:`~certkv.signals.lookahead.lookahead_probe`, then :func:`~certkv.signals.lookahead.evicted_mass`
    of the candidate's per-layer selection); the probe leaves the cache cropped to the context.

    `cache` holds the full prefill, (1, H_kv, n_ctx, d) keys and values per layer; `selection` the
    candidate's kept entries per layer (:data:`KeptSelection`)."""
    probe = lookahead_probe(model, cache, enc.question_ids, len(enc.context_ids), tokens, stop_ids)
    return evicted_mass(probe.weights, selection, cache.layers[0].keys.shape[1])
