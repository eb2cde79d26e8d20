"""Compress once, answer many: a question-agnostic point's compressed contexts, kept for later questions.

Under the question-agnostic protocol (``query_aware: false``) the context is prefilled and
compressed before the question exists, so what the press keeps of a context (per layer its kept
keys and values, (1, H_kv, n_kept, d)) is the same for every question asked of it. kvpress feeds
the question at positions continuing from the *uncompressed* context length, so an entry also
records that length (its context's token count). :class:`PrefixCache` keeps such entries, keyed
by the operating point's stratum and the context's exact token ids (a dict of the ids' tuple:
Python compares the whole key on a hash match, so two contexts that collide never share an entry),
under a byte budget with least-recently-used eviction. A later question on a cached context skips
the prefill and the compression: the entry is copied into the question's own cache (the entry
itself is never written to), and the question is decoded from the copy exactly as from the kept
entries its own prefill would have gathered (the same values in the same order), so its answer is
the uncached path's, token for token.

What else an entry holds is what a gate needs before the decode and could not recompute without
the full prefill: the agreement drop, recorded during the context's prefill (question-independent
under this protocol). Gates read after the decode (confidence, certificate) run per question as
ever; an escalation prefills the full cache afresh, as a lean uncached request does. Which points
cannot use the cache at all is :func:`bypass_reason`.

Under ``certkv serve --kv-budget`` the entries count against the budget: :attr:`PrefixCache.limit`
(set by the scheduler) says how many token slots the budget leaves the cache, and the scheduler
evicts entries before it keeps a request waiting (:mod:`certkv.serve.admission`). Eviction never
frees memory a request uses: a decoding request holds its own copy, and a request waiting for its
KV holds no reference to the entry it found (it looks the entry up again once admitted, and
prefills the context if it was evicted meanwhile), so what the cache counts is what it holds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from certkv.errors import CertkvError

if TYPE_CHECKING:
    from kvpress import BasePress

    from certkv.core.spec import GateSettings
    from certkv.engine.ragged_decode import RowCache

#: An entry's key: (the runtime's namespace, its stratum's name or "", the context's token ids).
Key = tuple[str, tuple[int, ...]]


@dataclass(eq=False)
class PrefixEntry:
    """One compressed context: per layer its kept `keys` / `values`, (1, H_kv, n_kept, d), in the
    press's order; `kept` the realised share kept (layer 0's n_kept / `context_length`);
    `agreement_drop` the drop its prefill recorded (None: not measured)."""

    context_length: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    kept: float
    agreement_drop: float | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def slots(self) -> float:
        """Token slots held (:mod:`certkv.engine.ragged_decode`'s unit: the mean over layers of n_kept)."""
        return sum(k.shape[2] for k in self.keys) / len(self.keys)

    def row(self, room: int) -> RowCache:
        """A copy of the entry as one request's :class:`~certkv.engine.ragged_decode.RowCache` with
        `room` free slots per layer (the question and answer), what a lean gather would have built."""
        from certkv.engine.ragged_decode import RowCache, RowLayer

        return RowCache([RowLayer.holding(k, v, room) for k, v in zip(self.keys, self.values)])


def entry_from_row(row: RowCache, context_length: int, agreement_drop: float | None) -> PrefixEntry:
    """An entry copied from a freshly gathered row (its first ``length`` slots per layer: the kept
    entries, before any question token is fed)."""
    keys = [layer.keys.clone() for layer in row.layers]
    values = [layer.values.clone() for layer in row.layers]
    return PrefixEntry(context_length, keys, values, keys[0].shape[2] / context_length, agreement_drop)


def entry_from_full(full_keys: list[torch.Tensor], full_values: list[torch.Tensor], selection: list,
                    context_length: int, agreement_drop: float | None) -> PrefixEntry:
    """An entry gathered from a full prefill, (1, H_kv, n, d) per layer, left intact: `selection[layer]`
    the kept indices (1, H_kv, n_kept) in the press's order, or None (the first `context_length`
    entries), the entries and order of :func:`~certkv.engine.ragged_decode.gather_layer`."""
    from certkv.engine.ragged_decode import gather_layer

    layers = [gather_layer(k, v, kept, context_length, 0) for k, v, kept in zip(full_keys, full_values, selection)]
    keys, values = [layer.keys for layer in layers], [layer.values for layer in layers]
    return PrefixEntry(context_length, keys, values, keys[0].shape[2] / context_length, agreement_drop)


class PrefixCache:
    """Compressed contexts under a budget of `mib` MiB, least recently used evicted first (module docstring).

    Thread-safe: the scheduler's worker uses it while ``/metrics`` reads its counters.
    """

    def __init__(self, mib: float) -> None:
        if isinstance(mib, bool) or not isinstance(mib, (int, float)) or not 0 < mib < float("inf"):
            raise CertkvError(f"the prefix cache's budget must be a positive number of MiB, got {mib!r}")
        self.capacity_bytes = int(mib * (1 << 20))
        self._entries: OrderedDict[Key, PrefixEntry] = OrderedDict()
        self._lock = threading.RLock()
        self.hits = self.misses = self.evictions = self.refused = 0
        self.bytes = 0
        self.limit: Callable[[], float] | None = None
        """The token slots the KV budget leaves the cache in all (the scheduler's; None: no KV budget)."""

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def slots(self) -> float:
        with self._lock:
            return sum(e.slots for e in self._entries.values())

    def lookup(self, namespace: str, context_ids: list[int]) -> PrefixEntry | None:
        """The entry of this context (marked most recently used), or None; counts nothing."""
        key = (namespace, tuple(context_ids))
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def count(self, hit: bool) -> None:
        """Count one question answered from an entry (`hit`) or one that prefilled its context."""
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def put(self, namespace: str, context_ids: list[int], entry: PrefixEntry) -> bool:
        """Keep `entry` for this context, evicting least recently used entries to make room under the
        byte budget and the KV budget's :attr:`limit`; False (nothing evicted, nothing kept) when it
        cannot fit even alone."""
        key = (namespace, tuple(context_ids))
        with self._lock:
            if key in self._entries:
                return True
            limit = self.limit() if self.limit is not None else None
            if entry.nbytes > self.capacity_bytes or (limit is not None and entry.slots > limit):
                self.refused += 1
                return False
            while self.bytes + entry.nbytes > self.capacity_bytes or (
                limit is not None and self.slots + entry.slots > limit
            ):
                self._evict_one()
            self._entries[key] = entry
            self.bytes += entry.nbytes
            return True

    def evict_slots(self, slots: float) -> float:
        """Evict least recently used entries until `slots` token slots are free (or none is left); the
        slots freed."""
        freed = 0.0
        with self._lock:
            while freed < slots and self._entries:
                freed += self._evict_one()
        return freed

    def _evict_one(self) -> float:
        """Drop the least recently used entry; its slots."""
        _, entry = self._entries.popitem(last=False)
        self.bytes -= entry.nbytes
        self.evictions += 1
        return entry.slots


@dataclass
class PrefixScope:
    """A :class:`PrefixCache` as one runtime (a stratum's, or a pooled point's: `namespace` "") sees it."""

    cache: PrefixCache
    namespace: str = ""

    def lookup(self, context_ids: list[int]) -> PrefixEntry | None:
        return self.cache.lookup(self.namespace, context_ids)

    def put(self, context_ids: list[int], entry: PrefixEntry) -> bool:
        return self.cache.put(self.namespace, context_ids, entry)


def bypass_reason(query_aware: bool, press: BasePress | None, single_prefill: bool, gate: GateSettings) -> str | None:
    """Why a point cannot answer from compressed contexts kept across questions (None: it can).

    `press` is None for a fallback point; `single_prefill` whether it runs on the engine's
    single-prefill path."""
    from certkv.engine.decoding_run import is_decoding_press
    from certkv.engine.engine import is_probabilistic_press
    from certkv.presses.response_aware import is_response_aware_press

    if press is None:
        return "it answers from the full cache (nothing is compressed)"
    if query_aware:
        return "it is query-aware: the question is prefilled and compressed with the context"
    if is_decoding_press(press):
        return "its press compresses while the answer decodes, so no compressed context precedes the question"
    if not single_prefill:
        return "its press runs inside kvpress's pipeline, which never hands certkv the compressed cache"
    if is_probabilistic_press(press):
        return "certkv's probabilistic press decodes from the full cache (Hajek attention)"
    if is_response_aware_press(press):
        return "its press chooses what to keep from the question's response, after the prefill"
    if gate.needs_lookahead:
        return "its gate's lookahead probe feeds each question over the full cache"
    return None


__all__ = ["PrefixCache", "PrefixEntry", "PrefixScope", "bypass_reason", "entry_from_full", "entry_from_row"]
