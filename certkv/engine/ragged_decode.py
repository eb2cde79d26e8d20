"""Greedy decoding of many requests at once, each over its own compressed cache, with no padding.

``certkv serve`` decodes every in-flight request in one forward per step (continuous batching).
Their caches differ in everything: length, which entries were kept, the position the question
starts at. Padding them to one width would spend on padding the memory that eviction freed, so
each request keeps its own cache (:class:`LaneCache`: per layer one (1, H_kv, capacity, d) buffer,
filled to its length) and only the projections and MLPs run batched, over the lanes' fed tokens
packed one lane after another into one (1, T) sequence (:func:`packed_spans`), so a lane fed one
token costs one token's work beside a lane fed sixteen. Attention runs once per lane,
over that lane's keys alone (:func:`ragged_attention`, registered with transformers' attention
interface under :data:`NAME`): the same shapes and the same kernel choice as the one-lane decode of
:func:`certkv.engine.batched_decode.decode_candidates`, so that each lane's answer is that of the
runtime decoding it alone.

Terms. A *lane* is one sequence of a decode batch: one request (or candidate) with its own cache and
answer, advanced by the batch's forwards (:class:`Lane` here; the padded candidate batch of
:mod:`certkv.engine.batched_decode` calls its batch positions lanes too). "Row" in certkv means a row
of a table only (the loss table's, a printed report's), and "record" one request × candidate entry of
the calibration store (docs/design.md, "Terms").

Decoding follows ``decode_candidates`` with an empty draft, lane by lane: a lane's first forward feeds
its question (positions from the lane's ``position``), then each step feeds the lane's pending token
plus a proposal (its draft's next tokens while it follows one, else prompt lookup's, as long as the
lane's acceptance so far warrants; none for a lane decoded plainly greedy, as kvpress's pipeline
decodes); the tokens its greedy choice confirms stay in its cache, the rest are cropped away. The
proposals and their acceptance are ``decode_candidates``'s own, written once in
:mod:`certkv.engine.speculation`. A lane stops by the decoders' shared rule, kvpress's
(:func:`certkv.model.stopping.is_finished`: after ``max_new_tokens`` tokens, or after a stop token
but never on the first).

KV held is counted in *token slots*: one slot is one token's keys and values in every layer and KV
head, so a request of n tokens with the full cache holds n slots, and a cache that keeps a share r
of every layer holds r·n. :attr:`LaneCache.slots` counts the allocated capacity, what a KV budget
must cover.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface

from certkv.engine.decoding_compression import DecodingCompression
from certkv.engine.first_layer_keys import pipeline_first_layer_keys, ranks_by_key_norm
from certkv.engine.prompt_lookup import PromptLookup
from certkv.engine.speculation import Proposer, accept, following
from certkv.model.attention import _grouped_matmul_attention, _sdpa, use_attention
from certkv.model.generation import chosen_logprobs
from certkv.model.layers import attention_modules
from certkv.model.stopping import is_finished

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

NAME = "certkv_ragged"

logger = logging.getLogger(__name__)


class LaneLayer:
    """One layer of one request's cache: `keys` / `values` buffers (1, H_kv, capacity, d), of which
    the first `length` slots are filled."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        self._keys, self._values, self.length = keys, values, length
        self._outgrown = False

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, room: int) -> LaneLayer:
        """A layer holding `keys` / `values` (1, H_kv, n, d), with `room` more slots allocated."""
        n = keys.shape[2]
        k = keys.new_empty((1, keys.shape[1], n + room, keys.shape[3]))
        v = values.new_empty((1, values.shape[1], n + room, values.shape[3]))
        k[:, :, :n].copy_(keys)
        v[:, :, :n].copy_(values)
        return cls(k, v, n)

    @property
    def capacity(self) -> int:
        return self._keys.shape[2]

    @property
    def keys(self) -> torch.Tensor:
        return self._keys[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self._values[:, :, : self.length]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write (1, H_kv, n, d) new entries after the filled slots. Out of room, the buffers grow,
        and a warning says so: a lane is allocated all it can need (``certkv serve`` reserves that
        much of its KV budget), so growing means some reservation was too small."""
        end = self.length + keys.shape[2]
        if end > self.capacity:
            if not self._outgrown:  # once per layer: every later forward would say it again
                logger.warning("a decoding lane's layer outgrew its allocation (%d > %d slots): the KV budget "
                               "reserved too little for it", end, self.capacity)
                self._outgrown = True
            self._grow(end + max(keys.shape[2], self.capacity // 4))
        self._keys[:, :, self.length : end] = keys
        self._values[:, :, self.length : end] = values
        self.length = end

    def _grow(self, capacity: int) -> None:
        """New buffers of `capacity` slots holding the filled ones (spare room, so the next appends fit)."""
        keys, values = self.keys, self.values
        self._keys = keys.new_empty((*keys.shape[:2], capacity, keys.shape[3]))
        self._values = values.new_empty((*values.shape[:2], capacity, values.shape[3]))
        self._keys[:, :, : self.length] = keys
        self._values[:, :, : self.length] = values

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def fit(self, capacity: int) -> None:
        """Cut the buffers down to `capacity` slots (never below the filled ones), freeing the rest:
        a lane whose decoding-time press compressed gives back what it can no longer need."""
        capacity = max(capacity, self.length)
        if capacity < self.capacity:
            self._keys = self._keys[:, :, :capacity].clone()
            self._values = self._values[:, :, :capacity].clone()

    def keep(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold only `keys` / `values` (1, H_kv, n, d), a decoding-time press's choice among the
        filled entries (:mod:`certkv.engine.decoding_compression`), at the front of the buffers."""
        n = keys.shape[2]
        self._keys[:, :, :n].copy_(keys)
        self._values[:, :, :n].copy_(values)
        self.length = n


class LaneCache:
    """One request's cache, one :class:`LaneLayer` per model layer."""

    def __init__(self, layers: list[LaneLayer]) -> None:
        self.layers = layers

    @classmethod
    def adopt(cls, cache: DynamicCache, room: int) -> LaneCache:
        """Take over a one-lane transformers cache, leaving `cache` empty.

        A layer that already has `room` free slots (the engine's reserved layers) is used as it
        is; any other is copied into a buffer with that room, one layer at a time, and its tensors
        are dropped from `cache` as soon as they are copied, so the copy never holds more than one
        layer twice.
        """
        from certkv.engine.batched_decode import ReservedLayer

        layers: list[LaneLayer] = []
        for layer in cache.layers:
            if isinstance(layer, ReservedLayer) and layer._keys.shape[2] - layer._length >= room:
                layers.append(LaneLayer(layer._keys[:1], layer._values[:1], layer._length))
            else:
                layers.append(LaneLayer.holding(layer.keys, layer.values, room))
            layer.keys = layer.values = None
            if isinstance(layer, ReservedLayer):
                layer._keys = layer._values = None
        cache.layers.clear()
        return cls(layers)

    @property
    def slots(self) -> float:
        """Allocated capacity in token slots: the mean over layers (and KV heads) of each layer's
        buffer length (see the module docstring)."""
        return sum(layer.capacity for layer in self.layers) / len(self.layers)

    def crop(self, lengths: list[int]) -> None:
        for layer, length in zip(self.layers, lengths):
            layer.crop(length)


@dataclass
class Lane:
    """One request being decoded.

    `question_ids` are fed first, at positions from `position` (kvpress's: the uncompressed
    context length, or the pruned length for presses that continue from it); `lookup_ids` seed
    the prompt-lookup proposals (None: plain greedy, one token per step). `answer` and
    `logprobs` fill as the lane decodes; `done` once it has stopped. `draft`, when given, is
    proposed while the answer follows it (calibration's full-cache answer, possibly a list still
    growing: the full answer's own lane in the same batch), prompt lookup after or beyond its end.
    `compression`: the lane's decoding-time press books (None: its cache only grows); a forward
    then feeds no further than the press's next compression event, which follows it.
    `stop_below`: the recompute gate's threshold r (None: off; needs `want_logprobs`): the lane
    stops at its first token of probability < r, without it (``stopped_at``, its index), as the
    token-by-token decode does (:class:`~certkv.engine.decoding_run.StopWatch`), whatever else the
    same forward confirmed after it."""

    cache: LaneCache
    question_ids: list[int]
    position: int
    max_new_tokens: int
    stop_ids: set[int]
    lookup_ids: list[int] | None = None
    want_logprobs: bool = False
    answer: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    held: list[float] = field(default_factory=list)
    """Per answer token, the entries (mean over layers) held after the forward that chose it."""
    draft: list[int] | None = None
    compression: DecodingCompression | None = None
    tag: Any = None
    """The caller's handle on the lane (the scheduler's request)."""
    stop_below: float | None = None
    stopped_at: int | None = None
    _proposer: Proposer = field(default_factory=lambda: Proposer(None))

    def __post_init__(self) -> None:
        if not self.question_ids:
            raise ValueError("a lane needs at least one question token to feed")
        if self.stop_below is not None and not self.want_logprobs:
            raise ValueError("a lane that stops below a probability needs its tokens' log p (want_logprobs)")
        if self.lookup_ids is not None:
            self._proposer.lookup = PromptLookup(list(self.lookup_ids) + list(self.question_ids))

    def plain(self) -> None:
        """Decode plainly greedy from now on: no prompt-lookup proposals (the same answer, one
        token a forward)."""
        self.lookup_ids, self._proposer.lookup = None, None

    @property
    def done(self) -> bool:
        """Whether the lane's answer is complete (the decoders' shared rule), or stopped below its threshold."""
        return self.stopped_at is not None or is_finished(self.answer, self.max_new_tokens, self.stop_ids)

    def cut_below(self) -> None:
        """Stop at the first token whose probability is under ``stop_below`` (recorded in
        ``stopped_at``), dropping it and what followed it (answer, log p, held entries)."""
        if self.stop_below is None or self.stop_below <= 0 or self.stopped_at is not None:
            return
        floor = math.log(self.stop_below)
        cut = next((t for t, lp in enumerate(self.logprobs) if lp < floor), None)
        if cut is not None:
            del self.answer[cut:], self.logprobs[cut:], self.held[cut:]
            self.stopped_at = cut

    def feed(self) -> tuple[list[int], int]:
        """The tokens to feed next and the position of the first."""
        if not self.answer:
            return list(self.question_ids), self.position
        position = self.position + len(self.question_ids) + len(self.answer) - 1
        return [self.answer[-1], *self._proposer.propose(self.answer, self.proposal_budget(), self.draft)], position

    def proposal_budget(self) -> int:
        """How many tokens the next forward may feed after the pending one: what the answer may
        still take, and no further than the press's next compression event."""
        budget = self.max_new_tokens - len(self.answer)
        if self.compression is not None:
            budget = min(budget, self.compression.room() - 1)
        return budget

    def followed_draft(self) -> list[int] | None:
        """The draft while the answer so far is its beginning (it proposes what follows), else None."""
        return following(self.draft, self.answer)

    def most_held(self) -> list[int]:
        """Per layer, the most entries the cache of a lane under a decoding-time press may hold from
        now to the answer's end (:meth:`~certkv.engine.decoding_compression.DecodingCompression.most_held`)."""
        books = self.compression
        if books is None:
            raise ValueError("only a lane under a decoding-time press shrinks; this one only grows")
        if not self.answer:
            return [books.first_peak(layer.length, len(self.question_ids), self.max_new_tokens, self.position)
                    for layer in self.cache.layers]
        to_feed = self.max_new_tokens - len(self.answer) + 1
        last = self.position + len(self.question_ids) + self.max_new_tokens - 1
        return [books.most_held(layer.length, to_feed, last) for layer in self.cache.layers]

    def give_back(self) -> None:
        """Cut each layer's buffers to :meth:`most_held` (after a compression event: the press's
        target and one interval, or what is left to feed)."""
        for layer, most in zip(self.cache.layers, self.most_held()):
            layer.fit(most)

    def accepted(self, confirmed: int) -> None:
        """Record that `confirmed` tokens of the last proposal were accepted (sizes the next
        prompt-lookup proposal: :meth:`~certkv.engine.speculation.Proposer.accepted`)."""
        self._proposer.accepted(confirmed)


#: The lanes of the forward in progress, where each one's fed tokens sit in the packed sequence, and
#: the causal masks built so far, by (new tokens, keys): every layer of a lane needs the same one
#: (read by the attention).
_FORWARD: ContextVar[tuple[Sequence[Lane], Sequence[slice], dict[tuple[int, int], torch.Tensor]] | None] = ContextVar(
    "certkv_ragged_forward", default=None)


def packed_spans(fed: Sequence[int]) -> list[slice]:
    """Where each lane's `fed` tokens sit in a ragged forward's one packed sequence, in lane order.

    >>> packed_spans([3, 1, 2])
    [slice(0, 3, None), slice(3, 4, None), slice(4, 6, None)]
    """
    ends = list(accumulate(fed))
    return [slice(end - n, end) for n, end in zip(fed, ends)]


class _LanesCache:
    """What the model sees as its cache during a ragged forward: ``update`` writes each lane's new
    entries into its own :class:`LaneCache`; the attention reads the lanes back (:func:`ragged_attention`)."""

    def __init__(self, lanes: Sequence[Lane], spans: Sequence[slice]) -> None:
        self.lanes, self.spans = lanes, spans

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`key_states` / `value_states` (1, H_kv, T, d), the packed sequence: lane b's are at spans[b]."""
        for lane, span in zip(self.lanes, self.spans):
            lane.cache.layers[layer_idx].append(key_states[:, :, span], value_states[:, :, span])
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def ragged_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: each lane's queries (query (1, H, T, d), the packed
    sequence; lane b's at spans[b]) over that lane's own keys and values, causal within its new
    tokens. `key` / `value` (what the cache's ``update`` returned) are ignored. Returns (1, T, H, d)
    and no weights.

    Per lane this is :func:`certkv.model.attention.gqa_sdpa_attention` on a one-lane batch: grouped
    matmuls for at most 4 float32 queries on CPU, sdpa otherwise, with an additive mask (none for
    one query on the grouped matmuls, where it would be all zeros)."""
    state = _FORWARD.get()
    if state is None:
        raise RuntimeError(f"the {NAME} attention runs only inside a ragged batch's forward")
    lanes, spans, masks = state
    layer_idx = module.layer_idx
    out = query.new_empty((1, query.shape[2], query.shape[1], value.shape[-1]))
    on_cpu = query.device.type == "cpu"
    for lane, span in zip(lanes, spans):
        layer = lane.cache.layers[layer_idx]
        k, v = layer.keys, layer.values
        q = query[:, :, span]
        n, k_len = q.shape[2], k.shape[2]
        gqa = k.shape[1] != q.shape[1]
        attend = _grouped_matmul_attention if on_cpu and q.dtype == torch.float32 and n <= 4 else _sdpa
        # one query sees every key: the grouped matmuls' additive mask would be all zeros (adding it
        # changes no bit), so none is built
        mask = None
        if n > 1 or attend is not _grouped_matmul_attention:
            mask = masks.get((n, k_len))
            if mask is None:
                mask = masks[n, k_len] = _causal_mask(n, k_len, query)
        out[0, span] = attend(q, k, v, mask, dropout, scaling, False, gqa)[0].transpose(0, 1)
    return out, None


def _causal_mask(n: int, k_len: int, query: torch.Tensor) -> torch.Tensor:
    """The additive mask (1, 1, n, k_len) of n new queries over k_len keys, the last n their own."""
    allowed = torch.ones(n, k_len, dtype=torch.bool, device=query.device).tril(k_len - n)
    mask = torch.zeros((1, 1, n, k_len), dtype=query.dtype, device=query.device)
    return mask.masked_fill_(~allowed.view(1, 1, n, k_len), float("-inf"))


def register() -> None:
    """Register :func:`ragged_attention` with transformers (idempotent). No mask function is
    registered under its name, so the model builds no mask: the attention makes its own."""
    AttentionInterface.register(NAME, ragged_attention)


@contextmanager
def _forward_lanes(lanes: Sequence[Lane], spans: Sequence[slice]) -> Iterator[None]:
    token = _FORWARD.set((lanes, spans, {}))
    try:
        yield
    finally:
        _FORWARD.reset(token)


class RaggedBatch:
    """The requests being decoded together; :meth:`step` advances every one of them by one forward.

    Lanes join (:meth:`add`) whenever their cache is ready and leave when done (:meth:`step`
    returns them); nothing else about the batch changes when they do.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.lanes: list[Lane] = []
        register()

    def add(self, lane: Lane) -> None:
        self.lanes.append(lane)

    def remove(self, lane: Lane) -> None:
        self.lanes.remove(lane)

    def step(self) -> list[Lane]:
        """One batched forward for every lane but those waiting for their draft (:meth:`_waiting`);
        returns the lanes that finished (removed from the batch)."""
        if not self.lanes:
            return []
        growing = {id(lane.answer) for lane in self.lanes}
        model = self.model
        lanes = [lane for lane in self.lanes if not _waiting(lane, growing)] or list(self.lanes)
        feeds = [lane.feed() for lane in lanes]
        fed = [len(tokens) for tokens, _ in feeds]
        spans = packed_spans(fed)
        inputs, positions = _packed(feeds, model.device)
        lengths = [[layer.length for layer in lane.cache.layers] for lane in lanes]
        with (torch.no_grad(), use_attention(model, NAME), _forward_lanes(lanes, spans), _capturing(model, lanes, spans),
              pipeline_first_layer_keys(model, _key_norm_lanes(lanes, spans))):
            hidden = model.model(
                input_ids=inputs,
                position_ids=positions,
                past_key_values=_LanesCache(lanes, spans),
                cache_position=torch.arange(inputs.shape[1], device=model.device),
                use_cache=True,
            ).last_hidden_state
        # The logits a lane needs: after its question's last token on its first forward, after
        # every fed token afterwards (the pending token's, then each proposal token's).
        picks = [j for lane, span in zip(lanes, spans)
                 for j in ([span.stop - 1] if not lane.answer else range(span.start, span.stop))]
        with torch.no_grad():
            logits = model.get_output_embeddings()(hidden[0, torch.as_tensor(picks, device=model.device)])
        tokens = logits.argmax(-1)
        chosen = tokens.tolist()
        finished, at, appended = [], 0, []
        for b, lane in enumerate(lanes):
            first = not lane.answer
            taken = 1 if first else fed[b]
            before = sum(lengths[b]) / len(lengths[b])
            had = len(lane.answer)
            kept = _accept(lane, chosen[at : at + taken], feeds[b][0][1:], lengths[b])
            appended.append((lane, at, len(lane.answer) - had))
            at += taken
            compressed = lane.compression is not None and lane.compression.confirm(
                model, lane.cache.layers, kept, feeds[b][1], question=first)
            _note_held(lane, before, kept, first, compressed)
            if compressed and not lane.done:
                lane.give_back()
        _append_logprobs(logits, tokens, appended)
        for lane in lanes:
            lane.cut_below()
            if lane.done:
                finished.append(lane)
                self.lanes.remove(lane)
        return finished


def _append_logprobs(logits: torch.Tensor, tokens: torch.Tensor, appended: Sequence[tuple[Lane, int, int]]) -> None:
    """Each lane that wants them gets the log p of the tokens its forward appended to its answer:
    `appended` holds (lane, its first pick in `logits` (P, vocab) and `tokens` (P,), how many it
    appended). Only those picks are scored (:func:`chosen_logprobs`, float64 over the vocabulary):
    a rejected proposal token's pick needs its argmax, never its log p."""
    wanted = [(lane, at, n) for lane, at, n in appended if lane.want_logprobs and n]
    if not wanted:
        return
    index = torch.as_tensor([at + i for _, at, n in wanted for i in range(n)], device=logits.device)
    values = chosen_logprobs(logits[index], tokens[index]).tolist()
    start = 0
    for lane, _, n in wanted:
        lane.logprobs.extend(values[start : start + n])
        start += n


#: A lane that follows a draft still being decoded waits until the draft is this many tokens ahead
#: of it (or reaches the lane's next compression event, or its end).
DRAFT_LEAD = 16


def _waiting(lane: Lane, growing: set[int]) -> bool:
    """Whether `lane` skips this forward: its answer so far is its draft, and that draft is the
    answer of a lane still decoding in the batch (`growing`: ids of those answer lists) that is not
    yet :data:`DRAFT_LEAD` tokens, the lane's next compression event or its end ahead. Fed a token
    a forward as the draft grows, the lane would cost a forward's per-lane work for every token;
    waiting, it is fed the draft a chunk at a time, as when the draft is known (the same tokens:
    the feeding never changes an answer)."""
    draft = lane.followed_draft()
    if draft is None or not lane.answer or id(draft) not in growing:
        return False
    return len(draft) - len(lane.answer) < min(DRAFT_LEAD, lane.proposal_budget())


def _key_norm_lanes(lanes: Sequence[Lane], spans: Sequence[slice]) -> list[tuple[slice, bool]]:
    """The lanes whose decoding press ranks keys by norm: where their tokens sit, and whether they
    are their question (:func:`~certkv.engine.first_layer_keys.pipeline_first_layer_keys`)."""
    return [(span, not lane.answer) for lane, span in zip(lanes, spans)
            if lane.compression is not None and ranks_by_key_norm(lane.compression.press)]


def _packed(feeds: Sequence[tuple[list[int], int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every lane's fed tokens and their positions, one lane after another: (1, T) input ids and
    (1, T) position ids. Packed, not padded: the projections and MLPs, most of a forward's work,
    run over the tokens fed and no padding (lanes feed 1 to ``compression_interval`` or more)."""
    ids = [token for tokens, _ in feeds for token in tokens]
    positions = [first + i for tokens, first in feeds for i in range(len(tokens))]
    return (torch.as_tensor(ids, dtype=torch.long, device=device).view(1, -1),
            torch.as_tensor(positions, dtype=torch.long, device=device).view(1, -1))


def _accept(lane: Lane, choices: list[int], proposal: list[int], lengths: list[int]) -> int:
    """Append to `lane` the greedy `choices` its forward confirmed (their log p follow:
    :func:`_append_logprobs`) and crop its cache back to its `lengths` per layer before the forward
    plus the fed tokens that stay: on its first forward one token, afterwards the pending token's
    choice and each proposal token the greedy choice agreed with (:func:`~certkv.engine.speculation.accept`).
    Returns how many fed tokens stay (the whole question on the first forward)."""
    if len(lane.answer) == 0:  # the question's forward: its last position's choice, nothing proposed
        accept(lane.answer, choices, [], lane.max_new_tokens, lane.stop_ids)
        return len(lane.question_ids)
    accepted = accept(lane.answer, choices, proposal, lane.max_new_tokens, lane.stop_ids)
    lane.accepted(accepted - 1)  # the pending token's choice, then the confirmed proposal tokens
    # The pending token and the confirmed proposal tokens stay; the rest are dropped.
    lane.cache.crop([n + accepted for n in lengths])
    return accepted


def _note_held(lane: Lane, before: float, kept: int, first: bool, compressed: bool) -> None:
    """Append to ``lane.held`` the entries (mean over layers) the cache held after the forward that
    chose each token this step settled, as the pipeline's one forward per token leaves them: the
    cache before this step plus the fed tokens up to that token's, or, after a compression event
    (always this step's last token), what the press kept."""
    after = sum(layer.length for layer in lane.cache.layers) / len(lane.cache.layers)
    settled = 1 if first else kept
    for i in range(settled):
        last = i == settled - 1
        lane.held.append(after if last and compressed else before + (kept if first else i + 1))


@contextmanager
def _capturing(model: PreTrainedModel, lanes: Sequence[Lane], spans: Sequence[slice]) -> Iterator[None]:
    """Within the block, each attention layer hands its input hidden states (1, T, hidden), the
    packed sequence, to the lanes that compress while decoding (their own spans[b]), as kvpress's
    hook reads them."""
    compressing = [(span, lane.compression) for lane, span in zip(lanes, spans) if lane.compression is not None]
    if not compressing:
        yield
        return

    def keep_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs["hidden_states"]
        for span, compression in compressing:
            compression.capture(module.layer_idx, hidden[:, span])

    handles = [m.register_forward_pre_hook(keep_inputs, with_kwargs=True) for m in attention_modules(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def gather_lane(full_cache: DynamicCache, selection: Sequence[torch.Tensor | None], context_length: int, room: int) -> LaneCache:
    """One candidate's kept entries of a full prefill as a :class:`LaneCache` with `room` free slots.

    `full_cache` holds (1, H_kv, n, d) per layer; `selection[layer]` the kept indices
    (1, H_kv, n_kept) in kvpress's order, or None (the layer keeps its first `context_length`
    entries). The entries and their order are :func:`~certkv.engine.batched_decode.padded_cache`'s
    for one lane. Each full layer is dropped from `full_cache` as soon as it is gathered, so the
    gather never holds more than the full cache and one kept layer; `full_cache` is left empty.
    """
    layers = []
    for layer_idx, kept in enumerate(selection):
        full = full_cache.layers[layer_idx]
        layers.append(gather_layer(full.keys, full.values, kept, context_length, room))
        full.keys = full.values = None
    full_cache.layers.clear()
    return LaneCache(layers)


def gather_layer(keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor | None, context_length: int,
                 room: int) -> LaneLayer:
    """One layer's kept entries as a :class:`LaneLayer` with `room` free slots.

    `keys` / `values` (1, H_kv, n, d) are a full prefill's layer; `kept` (1, H_kv, n_kept) the
    press's kept indices in kvpress's order, or None (the first `context_length` entries)."""
    keys, values = keys[:, :, :context_length], values[:, :, :context_length]
    if kept is None:
        return LaneLayer.holding(keys, values, room)
    # gathered straight into the lane's buffers: no kept copy beside them (a layer-by-layer pruned
    # prefill's peak is the full layer plus its buffers, :func:`~certkv.engine.layer_pruning.pruned_peak_slots`)
    index, n = kept[0].unsqueeze(-1).unsqueeze(0), kept.shape[-1]
    k = keys.new_empty((1, keys.shape[1], n + room, keys.shape[3]))
    v = values.new_empty((1, values.shape[1], n + room, values.shape[3]))
    torch.gather(keys, 2, index.expand(1, keys.shape[1], n, keys.shape[3]), out=k[:, :, :n])
    torch.gather(values, 2, index.expand(1, values.shape[1], n, values.shape[3]), out=v[:, :, :n])
    return LaneLayer(k, v, n)
