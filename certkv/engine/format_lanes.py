"""A KV format alone as a ragged lane: certkv's per-token formats decode in the batch, drafted.

A lane's attention reads its layer's ``keys`` / ``values`` after each forward's entries are written
(:mod:`certkv.engine.ragged_decode`), which is how certkv's per-token formats read their cache
(:class:`~certkv.kv_formats.caches.TokenFormatLayer`: every entry as stored, the step's own
included). :class:`FormatLaneLayer` stores the lane's entries in the format (float8, or integers
and their float16 scales) and dequantises them when the attention reads them, so a lane holds the
format's bytes and its tokens are :func:`~certkv.engine.format_run.run_in_format`'s: a token reads
the same numbers fed alone or in a chunk, as long as no full-precision window moves within a
chunk. So a format with no window follows a draft (calibration's full answer, prompt lookup) and
confirms many tokens a forward; one with a window decodes a token a forward, still batched.
A plain scorer press beside such a format keeps the entries it chose in the request's full prefill
(as computed, at full precision: the engine's single prefill scores every scorer so), and those are
stored in the format; a ``tiered`` format keeps the press's highest-scored of them (the first of
its top-k order, per layer and KV head) at full precision instead. transformers' formats (quanto,
HQQ) re-quantise their whole cache when the window fills, and any other press beside a format
prunes through kvpress's hooks (which score the dequantised cache); both decode alone
(:mod:`~certkv.engine.format_run`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from certkv.engine.decoding_run import DecodingRun
from certkv.engine.ragged_decode import Lane, LaneCache, LaneLayer, gather_layer
from certkv.engine.scoring import is_fast_path_press
from certkv.kv_formats.spec import Fp8Format, IntFormat, KvFormat, SplitFormat, TieredFormat, stored_share
from certkv.kv_formats.token_quantisers import StoredTokens, token_quantiser

if TYPE_CHECKING:
    from certkv.kv_formats.caches import TokenFormatCache
    from certkv.model.generation import EncodedRequest


def format_parts(fmt: KvFormat) -> tuple[Fp8Format | IntFormat, Fp8Format | IntFormat] | None:
    """(keys' format, values' format) of a per-token format (a tiered one's quantised tier's); None
    for transformers' formats."""
    if isinstance(fmt, TieredFormat):
        return format_parts(fmt.quantised)
    if isinstance(fmt, SplitFormat):
        return fmt.keys, fmt.values  # type: ignore[return-value]  # SplitFormat refuses transformers' parts
    if isinstance(fmt, (Fp8Format, IntFormat)):
        return fmt, fmt
    return None


def lane_format(fmt: KvFormat | None, press: object) -> bool:
    """Whether a candidate decodes as a format lane: a per-token format alone (no press) or beside a
    plain scorer press (:func:`~certkv.engine.scoring.is_fast_path_press`: its kept entries are
    chosen in the request's full prefill, as computed, and stored in the format); a tiered format
    beside a plain scorer only."""
    if fmt is None or format_parts(fmt) is None:
        return False
    return is_fast_path_press(press) if press is not None or isinstance(fmt, TieredFormat) else True


def drafts_exactly(fmt: KvFormat) -> bool:
    """Whether a lane in `fmt` may confirm several tokens a forward: no full-precision window moves."""
    parts = format_parts(fmt)
    return parts is not None and all(p.residual_length == 0 for p in parts)


class FormatLaneLayer(LaneLayer):
    """One layer of a lane stored in a per-token format: each of keys and values as
    :class:`StoredTokens` (batch 1, KV heads, tokens, head size) and a full-precision window of the
    most recent ones (the part's ``residual_length``); before them, a tiered format's full tier
    (`exact`: (1, KV heads, n_full, head size) keys and values at the model's dtype)."""

    def __init__(self, keys: StoredTokens, values: StoredTokens, parts: tuple[Fp8Format | IntFormat, ...],
                 slot_bytes: float, index: int, room: int = 0, exact: dict[str, torch.Tensor] | None = None) -> None:
        self.parts = dict(zip(("keys", "values"), parts))
        self.index = index  # the model layer's (an fp8 scale may be the layer's own)
        self.stored = {"keys": keys, "values": values}
        self.exact = exact if exact is not None else {
            which: stored.data.new_empty((*stored.shape[:2], 0, stored.shape[3]), dtype=stored.dtype)
            for which, stored in self.stored.items()}
        self.window = {which: torch.empty((*stored.shape[:2], 0, stored.shape[3]), dtype=stored.dtype,
                                          device=stored.data.device) for which, stored in self.stored.items()}
        self.slot_bytes = slot_bytes
        # What it will store for the question and answer still to come (its :attr:`capacity` counts it).
        self.room = room
        heads, size = keys.shape[1], keys.shape[3]
        self._token_bytes = sum(stored_share(part, size) * heads * size * 2 for part in parts)  # 2 bytes: 16 bits

    @classmethod
    def quantising(cls, keys: torch.Tensor, values: torch.Tensor, parts: tuple[Fp8Format | IntFormat, ...],
                   index: int, room: int, n_exact: int = 0) -> FormatLaneLayer:
        """Model layer `index`'s `keys` / `values` (1, H_kv, n, d), stored in the parts' formats but
        the first `n_exact` of each head (kept as they are: a tiered format's full tier), with `room`
        tokens to come."""
        tensors = {"keys": keys, "values": values}
        exact = {which: tensor[:, :, :n_exact].clone() for which, tensor in tensors.items()}
        stored = [token_quantiser(part, tensor.shape[-1], index, which).quantize(tensor[:, :, n_exact:].contiguous())
                  for part, (which, tensor) in zip(parts, tensors.items())]
        slot_bytes = 2 * keys.shape[1] * keys.shape[3] * keys.element_size()
        return cls(stored[0], stored[1], parts, slot_bytes, index, room, exact)

    def _quantise(self, which: str, tensor: torch.Tensor) -> StoredTokens:
        return token_quantiser(self.parts[which], tensor.shape[-1], self.index, which).quantize(tensor.contiguous())

    @property
    def exact_tokens(self) -> int:
        """Tokens of the full tier (a tiered format's; 0 otherwise)."""
        return self.exact["keys"].shape[2]

    @property
    def length(self) -> int:  # type: ignore[override]
        return self.exact_tokens + self.stored["keys"].tokens + self.window["keys"].shape[2]

    @property
    def capacity(self) -> int:
        """The token slots of the model's dtype the stored tensors and windows take, and what the
        tokens still to come will (what a server's KV budget counts: integers of b < 8 bits packed
        eight to b bytes where the head size allows, :func:`~certkv.kv_formats.spec.stored_share`)."""
        held = sum(s.nbytes for s in self.stored.values()) + sum(t.nbytes for t in (*self.window.values(), *self.exact.values()))
        return math.ceil((held + max(0, self.room) * self._token_bytes) / self.slot_bytes)

    def _read(self, which: str) -> torch.Tensor:
        return torch.cat([self.exact[which], self.stored[which].dequantize(), self.window[which]], dim=2)

    @property
    def keys(self) -> torch.Tensor:
        return self._read("keys")

    @property
    def values(self) -> torch.Tensor:
        return self._read("values")

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store (1, H_kv, n, d) new entries: into the window, whose oldest beyond its length are quantised."""
        self.room -= keys.shape[2]
        for which, new in (("keys", keys), ("values", values)):
            window = torch.cat([self.window[which], new], dim=2)
            leaving = window.shape[2] - self.parts[which].residual_length
            if leaving > 0:
                self.stored[which] = self.stored[which].cat(self._quantise(which, window[:, :, :leaving]))
                window = window[:, :, leaving:]
            self.window[which] = window

    def crop(self, length: int) -> None:
        """Drop the entries after `length` (rejected proposals): only a lane with no window follows a
        draft, so they are all stored ones."""
        if length >= self.length:
            return
        if length < self.exact_tokens:
            raise ValueError("a crop never reaches into the context's full tier")
        self.room += self.length - length  # rejected proposals: their room is still to come
        for which in self.parts:
            if self.window[which].shape[2]:
                raise ValueError("a lane with a full-precision window decodes a token a forward; it has nothing to crop")
            self.stored[which] = self.stored[which][:, :, : length - self.exact_tokens]

    def fit(self, capacity: int) -> None:
        """Nothing to free: a format lane allocates what it stores."""

    def keep(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        raise ValueError("a decoding-time press beside a KV format decodes alone, through kvpress's hooks")


def format_lane(fmt: KvFormat, full_layers: list, enc: EncodedRequest, max_new_tokens: int, stop_ids: set[int],
                draft: list[int] | None, selection: list[torch.Tensor | None] | None = None) -> Lane:
    """A lane for `enc` in `fmt`, its context's entries taken from a full prefill's `full_layers`
    (keys / values (1, H_kv, ≥ n_ctx, d) each, read and left unchanged): every one, or per layer the
    press's kept indices `selection` ((1, H_kv, n_kept) in kvpress's order; None: the whole layer),
    a tiered format's first :func:`full_tier` of them kept at full precision. It follows `draft`
    when its format drafts exactly, else decodes a token a forward."""
    parts = format_parts(fmt)
    if parts is None:
        raise ValueError(f"{fmt.name} is transformers' format; it decodes alone")
    n_ctx = len(enc.context_ids)
    layers: list[LaneLayer] = []
    for index, (layer, kept) in enumerate(zip(full_layers, selection or [None] * len(full_layers))):
        gathered = gather_layer(layer.keys, layer.values, kept, n_ctx, 0)
        layers.append(FormatLaneLayer.quantising(gathered.keys, gathered.values, parts, index,
                                                 len(enc.question_ids) + max_new_tokens, full_tier(fmt, kept, n_ctx)))
    return _lane(fmt, LaneCache(layers), enc, max_new_tokens, stop_ids, draft)


def full_tier(fmt: KvFormat, kept: torch.Tensor | None, n_ctx: int) -> int:
    """How many of a layer's kept entries (`kept`: (1, H_kv, n_kept) in the press's top-k order, the
    highest-scored first) a tiered format keeps at full precision: its ``full`` share of the
    `n_ctx` context tokens, rounded down as kvpress rounds its kept count; 0 for other formats.

    Examples
    --------
    >>> from certkv.kv_formats.spec import parse_format
    >>> tiered = parse_format({"backend": "tiered", "full": 0.1, "quantised": {"backend": "int", "nbits": 4}})
    >>> full_tier(tiered, torch.zeros(1, 2, 60, dtype=torch.long), 205)
    20
    """
    if not isinstance(fmt, TieredFormat):
        return 0
    if kept is None:
        raise ValueError(f"{fmt.name} ranks the context by a scorer press's choice; it needs one beside it")
    return min(kept.shape[-1], int(fmt.full * n_ctx))


def stored_lane(fmt: KvFormat, cache: TokenFormatCache, enc: EncodedRequest, max_new_tokens: int, stop_ids: set[int],
                slot_bytes: float) -> Lane:
    """A lane for `enc` over `cache`, the format's cache its context was prefilled into (its stored
    tensors taken over as they are: nothing is quantised again); `slot_bytes`, one token's keys and
    values in one layer at the model's dtype."""
    parts = format_parts(fmt)
    assert parts is not None  # a TokenFormatCache stores a per-token format
    room = len(enc.question_ids) + max_new_tokens
    layers: list[LaneLayer] = [FormatLaneLayer(layer._quantized_keys, layer._quantized_values, parts, slot_bytes, i, room)
                               for i, layer in enumerate(cache.layers)]
    cache.layers.clear()
    return _lane(fmt, LaneCache(layers), enc, max_new_tokens, stop_ids, None)


def _lane(fmt: KvFormat, cache: LaneCache, enc: EncodedRequest, max_new_tokens: int, stop_ids: set[int],
          draft: list[int] | None) -> Lane:
    exact = drafts_exactly(fmt)
    return Lane(cache, list(enc.question_ids), len(enc.context_ids), max_new_tokens, stop_ids,
                lookup_ids=list(enc.context_ids) if exact else None, want_logprobs=True, draft=draft if exact else None)


def lane_run(lane: Lane, fmt: KvFormat, head_dim: int, kept: int) -> DecodingRun:
    """A decoded format lane as the :class:`~certkv.engine.decoding_run.DecodingRun` the solo decode
    gives: its answer, and after each token the entries held (its `kept` context entries, the
    question and the answer so far) and their bytes (:func:`plain_held_units`); where it stopped
    below its recompute threshold, if it did."""
    n_q, steps = len(lane.question_ids), max(1, len(lane.answer))
    first = lane.cache.layers[0]
    n_full = first.exact_tokens if isinstance(first, FormatLaneLayer) else 0
    return DecodingRun(token_ids=list(lane.answer), logprobs=list(lane.logprobs), prefill_kept=float(kept),
                       held=[float(kept + n_q + t) for t in range(steps)],
                       held_units=plain_held_units(fmt, head_dim, kept, n_q, steps, n_full), stopped_at=lane.stopped_at)


def plain_held_units(fmt: KvFormat, head_dim: int, n_ctx: int, n_question: int, steps: int,
                     n_full: int = 0) -> list[float]:
    """What a format lane holds after each decoding step, in 16-bit token slots
    (:func:`~certkv.kv_formats.caches.held_units`): the `n_ctx` context entries it kept, stored
    (but a tiered format's `n_full` of them, at 16 bits), then the question and the answer, the
    most recent of them in each part's window.

    Examples
    --------
    >>> from certkv.kv_formats.spec import parse_format
    >>> plain_held_units(parse_format({"backend": "fp8"}), 64, 100, 5, 2)  # 105 then 106 tokens at half a slot
    [52.5, 53.0]
    """
    parts = format_parts(fmt)
    if parts is None:
        raise ValueError(f"{fmt.name} re-quantises its cache as its window fills: price it from the cache (held_units)")
    out = []
    for t in range(steps):
        total, decoded = n_ctx + n_question + t, n_question + t
        units = 0.0
        for part in parts:
            window = min(part.residual_length, decoded)
            units += ((total - window - n_full) * part.bytes_share(head_dim) + window + n_full) / 2
        out.append(units)
    return out


__all__ = ["FormatLaneLayer", "drafts_exactly", "format_lane", "format_parts", "full_tier", "lane_format", "lane_run",
           "plain_held_units", "stored_lane"]
