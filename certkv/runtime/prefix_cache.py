"""Compress once, answer many: a question-agnostic point's compressed contexts, kept for later questions.

Under the question-agnostic protocol (``query_aware: false``) the context is prefilled and
compressed before the question exists, so what the press keeps of a context (per layer its kept
keys and values, (1, H_kv, n_kept, d)) is the same for every question asked of it. kvpress feeds
the question at positions continuing from the *uncompressed* context length, so an entry also
records that length (its context's token count). :class:`PrefixCache` keeps such entries, keyed
by the operating point's stratum and the context's exact token ids (:func:`context_key`: a hash
match is followed by a comparison of the whole key, so two contexts never share an entry),
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
evicts entries before it keeps a request waiting (:mod:`certkv.serve.admission`). A request waits
for its KV with a :class:`PrefixReserve`: the copy of its context's entry when one is kept, its
prefill otherwise, read afresh whenever the admission policy looks (a question that arrived before
its context was kept needs only the copy once it is). Eviction never frees memory a request uses:
a decoding request holds its own copy, and a waiting one holds no reference to an entry (it looks
its context up once admitted, and reserves its prefill if the entry was evicted meanwhile), so what
the cache counts is what it holds.
"""

from __future__ import annotations

import math
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from certkv.errors import CertkvError
from certkv.runtime.steps import Reserve

if TYPE_CHECKING:
    from kvpress import BasePress

    from certkv.core.spec import GateSettings
    from certkv.engine.ragged_decode import LaneCache

#: An entry's key (:func:`context_key`): (the runtime's namespace, its stratum's name or "", the
#: context's token ids as int64 bytes).
Key = tuple[str, bytes]


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

    def lane(self, room: int) -> LaneCache:
        """A copy of the entry as one request's :class:`~certkv.engine.ragged_decode.LaneCache` with
        `room` free slots per layer (the question and answer), what a lean gather would have built."""
        from certkv.engine.ragged_decode import LaneCache, LaneLayer

        return LaneCache([LaneLayer.holding(k, v, room) for k, v in zip(self.keys, self.values)])


def entry_from_lane(lane: LaneCache, context_length: int, agreement_drop: float | None) -> PrefixEntry:
    """An entry copied from a freshly gathered lane (its first ``length`` slots per layer: the kept
    entries, before any question token is fed)."""
    keys = [layer.keys.clone() for layer in lane.layers]
    values = [layer.values.clone() for layer in lane.layers]
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


def context_key(namespace: str, context_ids: list[int]) -> Key:
    """The exact key of a context: the ids as int64 bytes (whose hash Python computes once and caches;
    a dict compares the whole key on a hash match, so two contexts never share an entry).

    Examples
    --------
    >>> context_key("", [1, 2]) == context_key("", [1, 2]), context_key("", [1, 2]) == context_key("", [1, 3])
    (True, False)
    """
    return namespace, array("q", context_ids).tobytes()


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
        self.slots = 0.0
        """Token slots the kept entries hold (what they count against a KV budget)."""
        self.limit: Callable[[], float] | None = None
        """The token slots the KV budget leaves the cache in all (the scheduler's; None: no KV budget)."""
        self.kv_budget: int | None = None
        """The scheduler's KV budget in token slots (None: none), which no reservation may exceed."""

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: Key) -> PrefixEntry | None:
        """The entry of `key` (:func:`context_key`), marked most recently used, or None; counts nothing."""
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

    def put(self, key: Key, entry: PrefixEntry, reserved: float = 0.0) -> bool:
        """Keep `entry` under `key`, evicting least recently used entries to make room under the byte
        budget and the KV budget's :attr:`limit` (plus `reserved`: slots the keeping request reserved
        for it, :attr:`PrefixReserve.kept_room`); False (nothing evicted, nothing kept) when it cannot
        fit even alone."""
        with self._lock:
            if key in self._entries:
                return True
            limit = self.limit() + reserved if self.limit is not None else None
            if entry.nbytes > self.capacity_bytes or (limit is not None and entry.slots > limit):
                self.refused += 1
                return False
            while self.bytes + entry.nbytes > self.capacity_bytes or (
                limit is not None and self.slots + entry.slots > limit
            ):
                self._evict_one()
            self._entries[key] = entry
            self.bytes += entry.nbytes
            self.slots += entry.slots
            return True

    def evict_slots(self, slots: float, spare: Collection[Key] = ()) -> float:
        """Evict least recently used entries until `slots` token slots are free, those under a key in
        `spare` (contexts waiting requests will copy) only once no other is left; the slots freed."""
        freed = 0.0
        with self._lock:
            for key in [k for k in self._entries if k not in spare] + [k for k in self._entries if k in spare]:
                if freed >= slots:
                    break
                freed += self._evict(key)
        return freed

    def wanted_slots(self, keys: Collection[Key]) -> float:
        """Slots of the kept entries under `keys` (each counted once)."""
        with self._lock:
            return sum(self._entries[k].slots for k in set(keys) if k in self._entries)

    def _evict_one(self) -> float:
        """Drop the least recently used entry; its slots."""
        return self._evict(next(iter(self._entries)))

    def _evict(self, key: Key) -> float:
        """Drop the entry under `key`; its slots."""
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes
        self.slots = max(0.0, self.slots - entry.slots) if self._entries else 0.0
        self.evictions += 1
        return entry.slots


@dataclass
class PrefixScope:
    """A :class:`PrefixCache` as one runtime (a stratum's, or a pooled point's: `namespace` "") sees it."""

    cache: PrefixCache
    namespace: str = ""

    def key(self, context_ids: list[int]) -> Key:
        return context_key(self.namespace, context_ids)


class PrefixReserve(Reserve):
    """The reservation of a request that may find its context kept: while it waits, its
    :attr:`slots` are a copy of the kept entry and its room when one is kept (looked up afresh each
    time the admission policy reads them, which also marks the entry recently used), else `miss`
    (its prefill's) plus `keep` (the entry it will keep, so that keeping it never crowds out the
    requests in flight; within the cache's :attr:`PrefixCache.kv_budget`). :attr:`granted` is the
    value last read: what the scheduler admitted it with; :attr:`prefills` whether no entry was
    kept then."""

    def __init__(self, cache: PrefixCache, key: Key, room: int, miss: int, keep: int = 0) -> None:
        self.cache, self.key, self.room, self.miss, self.keep = cache, key, room, miss, keep
        self.granted, self.found = miss, False

    @property
    def slots(self) -> int:  # type: ignore[override]  # read afresh, never assigned
        entry = self.cache.lookup(self.key)
        self.found = entry is not None
        if entry is not None:
            self.granted = min(self.miss, math.ceil(entry.slots) + self.room)
        else:
            budget = self.cache.kv_budget
            self.granted = max(self.miss, min(self.miss + self.keep, budget if budget is not None else self.miss + self.keep))
        return self.granted

    @property
    def prefills(self) -> bool:  # type: ignore[override]
        """Whether the request prefills once admitted: no entry was kept when :attr:`slots` was last read."""
        return not self.found

    @property
    def kept_room(self) -> int:
        """Slots of the reservation granted for the entry a prefill will keep (0 for a copy)."""
        return 0 if self.found else max(0, self.granted - self.miss)


def bypass_reason(query_aware: bool, press: BasePress | None, single_prefill: bool, gate: GateSettings,
                  formatted: bool = False) -> str | None:
    """Why a point cannot answer from compressed contexts kept across questions (None: it can).

    `press` is None for a fallback point (or a KV format alone); `single_prefill` whether it runs on
    the engine's single-prefill path; `formatted` whether its KV is stored in a KV format."""
    from certkv.engine.decoding_run import is_decoding_press
    from certkv.engine.engine import is_probabilistic_press
    from certkv.presses.response_aware import is_response_aware_press

    if formatted:
        return "its KV is stored in a KV format, which each request prefills and decodes on its own"
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


__all__ = ["PrefixCache", "PrefixEntry", "PrefixReserve", "PrefixScope", "bypass_reason", "context_key", "entry_from_full",
           "entry_from_lane"]
