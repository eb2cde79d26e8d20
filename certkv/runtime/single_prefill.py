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
3. **The evicted answer**: the kept entries are gathered into a one-lane cache and decoded with
   their log-probabilities (:func:`~certkv.engine.batched_decode.decode_candidates`,
   :func:`~certkv.engine.probabilistic_decode.decode_probabilistic`).
4. **Post-decode gates** (certificate, confidence, learned with confidence features): an escalated
   request's full answer is decoded from the full cache; ``seconds["escalation"]`` is that
   recomputation.

Steps 2 and 4 are the one gate flow every path shares (:func:`~certkv.runtime.gate_flow.gate_flow`):
this path starts a request with its prefill (:meth:`SinglePrefillPath.start`) and supplies the
press's answer and the full answer (:class:`PrefilledContext`; a context kept in a prefix cache:
:class:`~certkv.runtime.cached_context.CachedContext`, no prefill).

The path is written as steps (:mod:`certkv.runtime.steps`). In-process (:meth:`SinglePrefillPath.answer`)
the full cache is held to the end, as calibration holds it. Run *lean* (``certkv serve``'s
scheduler) the full cache is freed as soon as the kept entries are gathered
(:func:`~certkv.engine.ragged_decode.gather_lane`, the same entries in the same order as
``padded_cache``), so a decoding request holds only its retained KV; an escalation then prefills
the context again (same kernels, same full answer). Behind no gate that reads the full cache after
the prefill, a plain top-k press gathers each layer's kept entries as soon as the layer is
prefilled (:mod:`certkv.engine.layer_pruning`), so the full prefill never exists at once and the
request reserves only that peak (:meth:`SinglePrefillPath.reservation`). The probabilistic press always holds its full
cache: its Hájek decode is its own, unbatched.

The full-cache answer is always decoded as :func:`certkv.engine.full_cache.decode_full` decodes it,
which is the store's ``full`` record token for token (calibration decodes it so, or, beside
decoding lanes, as the first lane of their batch: the same greedy answer, checked in the tests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from kvpress.utils import compute_n_kept

from certkv.engine.batched_decode import kept_count
from certkv.engine.engine import is_probabilistic_press
from certkv.engine.full_cache import prefill_full
from certkv.engine.layer_pruning import LayerPruner, pruned_peak_slots
from certkv.engine.ragged_decode import gather_lane
from certkv.engine.scoring import is_fast_path_press
from certkv.presses.response_aware import is_response_aware_press, prefill_observers
from certkv.runtime.cached_context import CachedContext
from certkv.runtime.full_path import decode_from_full, prefill_slots
from certkv.runtime.gate_flow import AnsweringPath, AnswerSource, EvictedAnswer
from certkv.runtime.gating import agreement_settings
from certkv.runtime.kept_decode import KeptSelection, evicted_decode
from certkv.runtime.prefix_cache import PrefixEntry, PrefixReserve, PrefixScope, entry_from_full, entry_from_lane
from certkv.runtime.steps import Decode, Reserve
from certkv.signals.agreement import AgreementRecorder
from certkv.signals.lookahead import evicted_mass, lookahead_probe

if TYPE_CHECKING:
    from collections.abc import Generator

    from kvpress import BasePress
    from transformers import DynamicCache, PreTrainedModel

    from certkv.core.spec import GateSettings
    from certkv.model.generation import EncodedRequest
    from certkv.runtime.steps import Step


@dataclass
class SinglePrefillPath(AnsweringPath):
    """Answer requests with `press` on the engine's single-prefill path, behind `gate`.

    `policy` names the press's candidate (the key the engine's hooks record it under). With a
    `prefix` cache, a context kept there is answered from it
    (:class:`~certkv.runtime.cached_context.CachedContext`), and any other keeps its compressed
    cache there for later questions.
    """

    model: PreTrainedModel
    press: BasePress
    gate: GateSettings
    policy: str
    stop_ids: set[int]
    prefix: PrefixScope | None = None

    def start(
        self, enc: EncodedRequest, max_new: int, signals: dict[str, Any], seconds: dict[str, float], lean: bool
    ) -> Generator[Step, None, AnswerSource]:
        """Reserve the request's KV and prefill its context (module docstring), or find it kept in the
        prefix cache; `lean` frees the full cache before the evicted decode, layer by layer during the
        prefill when no gate reads the full cache (:meth:`prunes`)."""
        pruner = LayerPruner(len(enc.context_ids), len(enc.question_ids) + max_new) if lean and self.prunes() else None
        miss = self.reservation(enc, max_new, pruned=pruner is not None)
        if self.prefix is None:
            yield Reserve(miss)
            return self._prefilled(enc, max_new, signals, seconds, lean, pruner)
        return (yield from self._start_on_prefix(self.prefix, enc, max_new, signals, seconds, lean, pruner, miss))

    def _start_on_prefix(
        self, prefix: PrefixScope, enc: EncodedRequest, max_new: int, signals: dict[str, Any], seconds: dict[str, float],
        lean: bool, pruner: LayerPruner | None, miss: int,
    ) -> Generator[Step, None, AnswerSource]:
        """:meth:`start` with a prefix cache: the context's kept entry answers when there is one (its
        copy reserved, :class:`~certkv.runtime.prefix_cache.PrefixReserve`; the agreement drop its
        prefill recorded); otherwise the context is prefilled (`miss` slots) and its compressed cache kept."""
        cache, key = prefix.cache, prefix.key(enc.context_ids)
        room, keep = len(enc.question_ids) + max_new, compute_n_kept(len(enc.context_ids), self.press.compression_ratio)
        reserve = PrefixReserve(cache, key, room, miss, keep=keep)
        yield reserve
        entry = cache.lookup(key)
        if entry is not None:
            cache.count(hit=True)
            if self.gate.needs_agreement:
                signals["agreement_drop"] = entry.agreement_drop
            return CachedContext(self, enc, max_new, entry, lean)
        cache.count(hit=False)
        if reserve.granted < miss:  # admitted to copy an entry evicted since: the prefill's KV
            yield Reserve(miss)
        reserved = reserve.kept_room
        source = self._prefilled(enc, max_new, signals, seconds, lean, pruner, prefix="miss")
        cache.put(key, source.kept_context(signals.get("agreement_drop")), reserved)
        return source

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

    def _prefilled(
        self, enc: EncodedRequest, max_new: int, signals: dict[str, Any], seconds: dict[str, float], lean: bool,
        pruner: LayerPruner | None, prefix: str | None = None,
    ) -> PrefilledContext:
        """The context's full prefill under the press's scoring (or selection) hooks, as the request's
        :class:`PrefilledContext`, with the pre-decode signals the gate reads put into `signals`
        (agreement drop, lookahead) and their times into `seconds`. With a `pruner` the kept entries
        are gathered into it layer by layer and the full cache is left empty."""
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
        return PrefilledContext(self, enc, max_new, cache, selection, lean, pruner, prefix)


class PrefilledContext(AnswerSource):
    """A request whose context :class:`SinglePrefillPath` has just prefilled in full: the press's
    answer from its kept entries (`selection`) of the full `cache`, the full answer from `cache`
    while it is held (in-process, or behind a pre-decode gate), from a prefill of its own once
    a lean decode has freed it. With a `pruner` the kept entries were gathered layer by layer
    during the prefill and `cache` is empty."""

    path: SinglePrefillPath

    def __init__(self, path: SinglePrefillPath, enc: EncodedRequest, max_new: int, cache: DynamicCache,
                 selection: KeptSelection, lean: bool, pruner: LayerPruner | None, prefix: str | None) -> None:
        super().__init__(path, enc, max_new, prefix)
        self.cache, self.selection, self.lean, self.pruner = cache, selection, lean, pruner

    def decode(self) -> Generator[Step, None, EvictedAnswer]:
        """The press's answer as one :class:`Decode`: a probabilistic press, or a run that keeps the
        full cache (not lean), decodes alone next to it (:func:`~certkv.runtime.kept_decode.evicted_decode`);
        otherwise the kept entries are gathered into a lane of their own (emptying the full cache) that
        a scheduler can batch with others."""
        enc, max_new, stop_ids, n_ctx = self.enc, self.max_new, self.path.stop_ids, len(self.enc.context_ids)
        probabilistic = is_probabilistic_press(self.path.press)
        if probabilistic or not self.lean:
            model, cache, selection = self.path.model, self.cache, self.selection
            out: list[tuple[list[int], list[float] | None, float, float | None]] = []

            def solo() -> tuple[list[int], list[float] | None]:
                out.append(evicted_decode(model, cache, enc, selection, probabilistic, max_new, stop_ids))
                return out[0][0], out[0][1]

            yield Decode(None, list(enc.question_ids), n_ctx, max_new, stop_ids, solo=solo, batchable=False, final=self.final)
            return EvictedAnswer(*out[0])
        kept = kept_count(cast("list[torch.Tensor | None]", self.selection), n_ctx) / n_ctx  # not probabilistic
        if self.pruner is not None:  # gathered while prefilling
            lane = self.pruner.lane()
        else:
            lane = gather_lane(self.cache, self.selection, n_ctx, len(enc.question_ids) + max_new)  # empties the cache
        job = Decode(lane, list(enc.question_ids), n_ctx, max_new, stop_ids, solo=None,
                     lookup_ids=list(enc.context_ids), want_logprobs=True, final=self.final)
        yield job
        assert job.ids is not None  # whoever runs the steps fills the answer in before resuming
        return EvictedAnswer(job.ids, job.logprobs, kept)

    def full_answer(self) -> Generator[Step, None, list[int]]:
        if self.cache.layers:  # held: the full answer from it, no second prefill
            path = self.path
            return decode_from_full(path.model, self.cache, self.enc, self.max_new, path.stop_ids)
        return super().full_answer()  # lean: freed before the decode, prefilled again

    def kept_context(self, agreement_drop: float | None) -> PrefixEntry:
        """The compressed context the prefill chose, copied out for the prefix cache (the full cache,
        or the lanes a pruned prefill gathered, left as they are)."""
        n_ctx = len(self.enc.context_ids)
        if self.pruner is not None:
            return entry_from_lane(self.pruner.lane(), n_ctx, agreement_drop)
        keys, values = [layer.keys for layer in self.cache.layers], [layer.values for layer in self.cache.layers]
        return entry_from_full(keys, values, list(self.selection), n_ctx, agreement_drop)


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
