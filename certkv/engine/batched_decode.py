"""Greedy answers of many compressed caches of one request, decoded together.

Every candidate of a request shares the same context, so their caches differ only in which entries
were kept. They are stacked into one padded batch (padding masked out) and answered together:

1. *Verify.* The full-KV answer is a draft. One batched, teacher-forced forward of the question and
   the draft over every compressed cache gives each candidate's greedy choice at every draft
   position. A candidate that agrees with the draft everywhere has the draft as its answer.
2. *Continue.* A candidate that diverges at position j keeps the draft's first j tokens, takes its
   own token j, and decodes on from there. The draft tokens it did not choose are masked out of its
   cache, so each lane attends to exactly the tokens of its own answer.

Positions follow kvpress: `position_ids` continue from the uncompressed context length, the cache
index from the (padded) pruned length. Stopping is the decoders' shared rule, kvpress's pipeline's
(:func:`certkv.model.stopping.is_finished`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from certkv.engine.prompt_lookup import PromptLookup
from certkv.engine.speculation import Proposer, accept
from certkv.model.attention import NAME, attention_lane_groups, register, use_attention
from certkv.model.generation import chosen_logprobs
from certkv.model.stopping import is_finished

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: Reusable buffers of :func:`padded_cache`, keyed by (layer, "k" or "v").
BufferPool = dict[Hashable, torch.Tensor]


class ReservedLayer(DynamicLayer):
    """A DynamicLayer that writes new tokens into reserved space instead of re-concatenating.

    The candidate batch is tens of caches wide; DynamicLayer's ``torch.cat`` per step would copy
    all of them at every decoding step. Keys and values stay views of one preallocated buffer:
    `keys` and `values` (B, H_kv, length + reserve, d), of which the first `length` slots are filled.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._keys, self._values, self._length = keys, values, length
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def select_lanes(self, lanes: list[int]) -> None:
        """Keep only the batch lanes `lanes` (ascending), moved in place to the front.

        A compaction once most lanes are done. Copying the kept lanes into fresh tensors costs
        more in page faults than the forwards it saves (tens of MB per layer at 2048 tokens);
        moving them down within the buffer they already occupy allocates nothing, and lanes
        already in place are not copied at all (the finished lanes' memory is not given back
        before the request ends).
        """
        if any(a >= b for a, b in zip(lanes, lanes[1:])):
            raise ValueError(f"select_lanes needs strictly ascending lanes, got {lanes}")
        n = self._length
        for to, lane in enumerate(lanes):
            if lane != to:  # to < lane: the source has not been overwritten yet
                self._keys[to, :, :n].copy_(self._keys[lane, :, :n])
                self._values[to, :, :n].copy_(self._values[lane, :, :n])
        self._keys, self._values = self._keys[: len(lanes)], self._values[: len(lanes)]
        self.keys, self.values = self._keys[:, :, : self._length], self._values[:, :, : self._length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new `key_states` / `value_states`, (B, H_kv, new, d), after the filled slots;
        return the layer's keys and values so far, (B, H_kv, length + new, d)."""
        new = key_states.shape[-2]
        end = self._length + new
        if end > self._keys.shape[2]:  # out of reserved room: grow like DynamicLayer
            self._keys = torch.cat([self._keys[:, :, : self._length], key_states], dim=-2)
            self._values = torch.cat([self._values[:, :, : self._length], value_states], dim=-2)
        else:
            self._keys[:, :, self._length : end] = key_states
            self._values[:, :, self._length : end] = value_states
        self._length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values


def reserved_layer_class() -> type[ReservedLayer]:
    """The cache layer class of :func:`padded_cache` (:class:`ReservedLayer`)."""
    return ReservedLayer


def _pooled(pool: BufferPool | None, key: Hashable, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A tensor of `shape` backed by a buffer reused across requests (None: a fresh tensor).

    Fresh multi-GB buffers cost more in page faults than the copy into them; a calibration run
    allocates the same sizes request after request, so the engine keeps them.
    """
    numel = math.prod(shape)
    if pool is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    buf = pool.get(key)
    if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
        buf = pool[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel].view(shape)


def kept_count(selection: Sequence[torch.Tensor | None], context_length: int) -> int:
    """The context entries a candidate's `selection` keeps, as its first layer counts them (what
    its kept fraction reports): `selection[layer]` its kept indices (1, kv_heads, n_kept), or None
    for the whole `context_length`."""
    first = selection[0]
    return context_length if first is None else first.shape[2]


def padded_cache(
    full_cache: DynamicCache,
    selections: list[list[torch.Tensor | None]],
    context_length: int,
    reserve: int = 0,
    pool: BufferPool | None = None,
) -> tuple[DynamicCache, torch.Tensor, list[int]]:
    """Gather every candidate's kept entries into one padded batch cache.

    `selections[c][layer]` holds candidate c's kept indices (1, kv_heads, n_kept) in kvpress's
    topk order, or None for "keep everything" (kvpress leaves such a cache untouched). Returns a
    cache of shape (candidates, kv_heads, longest, head_dim) per layer with room for `reserve`
    more tokens, the 0/1 mask of real (non-padding) entries, and each candidate's kept count.

    Lanes are right-aligned: a lane's kept entries end at slot ``longest`` and its padding comes
    first, so the lanes that keep at most n entries only need the keys from ``longest - n`` on —
    one slice of the batch, which is how attention skips the padding (:func:`lane_groups`).
    """
    layer_class = reserved_layer_class()
    n = len(selections)
    n_layers = len(selections[0])
    lengths: list[int] = [kept_count(sel, context_length) for sel in selections]
    width = max(lengths)
    device = full_cache.layers[0].keys.device
    cache = DynamicCache()
    for layer_idx in range(n_layers):
        keys = full_cache.layers[layer_idx].keys[:, :, :context_length]
        values = full_cache.layers[layer_idx].values[:, :, :context_length]
        # Index 0 fills padding and the reserved room; both are masked out or overwritten.
        n_heads, length, dim = keys.shape[1], keys.shape[2], keys.shape[3]
        idx = torch.zeros((n, n_heads, width + reserve), dtype=torch.long, device=device)
        for lane, sel in enumerate(selections):
            kept = sel[layer_idx]
            if kept is None:
                idx[lane, :, width - context_length : width] = torch.arange(context_length, device=device)
            else:
                idx[lane, :, width - kept.shape[2] : width] = kept[0]
        # Whole head_dim vectors are copied by index_select on (heads * length, dim) rows, much
        # faster than an element-wise gather with an index expanded over head_dim.
        flat = (idx + torch.arange(n_heads, device=device).view(1, -1, 1) * length).view(-1)
        batch_keys = _pooled(pool, (layer_idx, "k"), (n * n_heads * (width + reserve), dim), keys)
        torch.index_select(keys[0].reshape(n_heads * length, dim), 0, flat, out=batch_keys)
        v_dim = values.shape[3]
        batch_values = _pooled(pool, (layer_idx, "v"), (n * n_heads * (width + reserve), v_dim), values)
        torch.index_select(values[0].reshape(n_heads * length, v_dim), 0, flat, out=batch_values)
        batch_keys = batch_keys.view(n, n_heads, width + reserve, dim)
        batch_values = batch_values.view(n, n_heads, width + reserve, v_dim)
        cache.layers.append(layer_class(batch_keys, batch_values, width))
    positions = torch.arange(width, device=device).unsqueeze(0)
    valid = (positions >= width - torch.as_tensor(lengths, device=device).unsqueeze(1)).long()
    return cache, valid, lengths


def lane_groups(mask: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """Consecutive batch lanes that share their first real slot, as (first lane, end lane, slot).

    `mask` is the batch's (lanes, slots) 0/1 mask of the cache slots each lane sees.

    With right-aligned lanes (:func:`padded_cache`) the slots before a lane's first real one are
    padding for it; attention over each group's slice of the keys from that slot on computes the
    same outputs as attention over the whole padded width, without the padded part. None when
    grouping saves nothing (one group starting at slot 0).
    """
    # The first 1 of each lane; a lane that keeps no context entry has its first 1 among the new
    # tokens, or none yet (argmax 0): both give a correct, merely unsliced, group.
    first = mask.argmax(dim=1).tolist()
    groups: list[tuple[int, int, int]] = []
    for lane, slot in enumerate(first):
        if groups and groups[-1][2] == slot:
            groups[-1] = (groups[-1][0], lane + 1, slot)
        else:
            groups.append((lane, lane + 1, slot))
    if len(groups) == 1 and groups[0][2] == 0:
        return None
    return groups


def decode_candidates(
    model: PreTrainedModel,
    cache: DynamicCache,
    mask: torch.Tensor,
    question_ids: list[int],
    draft: list[int],
    context_length: int,
    max_new_tokens: int,
    stop_ids: set[int],
    context_ids: list[int] | None = None,
    timings: dict[str, float] | None = None,
    logprobs: list[list[float]] | None = None,
) -> list[list[int]]:
    """Greedy answers (token ids) of every lane of a padded batch cache, verified against the `draft`.

    `cache` holds (lanes, H_kv, slots, d) keys and values per layer; `mask` is its (lanes, slots)
    0/1 mask of the slots each lane sees (:func:`padded_cache`).

    With an empty `draft` this is plain speculative greedy decoding with prompt-lookup proposals
    (the engine answers the full cache this way: one lane, every slot visible).

    `context_ids` (the uncompressed context) feeds prompt-lookup proposals for lanes that leave the
    draft: retrieval answers are mostly copied from the context, so a proposal is usually accepted
    whole and a lane finishes in one or two batched forwards instead of one forward per token.
    Proposals only save forwards; every accepted token is the lane's own greedy choice. Each lane's
    proposal length follows its acceptance (:class:`~certkv.engine.prompt_lookup.ProposalLength`):
    a lane that writes its own text is not fed a long proposal it will reject every forward. Both
    the proposals and their acceptance are :mod:`certkv.engine.speculation`'s, as the ragged lanes'.

    `timings`, when given, accumulates the seconds of the verifying forward under ``"verify"``:
    every lane must at least read the question and an answer over its own cache, so that forward is
    the part of the cost no exact calibrator can skip.

    `logprobs`, when given (a list with one slot per lane), receives in ``logprobs[lane]`` the log p
    of every token of that lane's answer (python floats: ``logit_tok − logsumexp(logits)`` in
    float64, from the logits the token was chosen from: the verifying forward's or a continuation
    round's). The answers themselves do not depend on it.
    """
    register()
    state = _Decoding(
        model, cache, mask, len(question_ids), context_length, max_new_tokens, stop_ids, with_logprobs=logprobs is not None
    )
    with use_attention(model, NAME):
        t0 = time.perf_counter()
        state.verify_draft(question_ids, draft)
        if timings is not None:
            timings["verify"] = timings.get("verify", 0.0) + time.perf_counter() - t0
        lookup = PromptLookup(list(context_ids or []) + list(question_ids))  # one index, every lane's proposals
        proposers = {r: Proposer(lookup) for r in state.active}
        while state.active:
            state.step(proposers)
    if logprobs is not None:
        logprobs[:] = state.logprobs
    return state.answers


class _Decoding:
    """The batch's decoding state: each lane's answer so far and which cache slots it may see.

    Lanes are candidates; ``self.lanes[b]`` is the candidate held at batch position b. Once most lanes
    have finished, the batch is compacted to the unfinished ones, so later forwards only pay for
    caches still being decoded.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        cache: DynamicCache,
        mask: torch.Tensor,
        q_len: int,
        context_length: int,
        max_new_tokens: int,
        stop_ids: set[int],
        with_logprobs: bool = False,
    ) -> None:
        self.model, self.cache, self.mask = model, cache, mask
        self.n = mask.shape[0]
        self.lanes = list(range(self.n))
        self.q_len, self.context_length = q_len, context_length
        self.max_new_tokens, self.stop_ids = max_new_tokens, stop_ids
        self.answers: list[list[int]] = [[] for _ in range(self.n)]
        # Per lane, the log p of each answer token (kept only when asked for).
        self.with_logprobs = with_logprobs
        self.logprobs: list[list[float]] = [[] for _ in range(self.n)]
        self.active: list[int] = []
        self.groups = lane_groups(mask)  # attention skips each lane's padding

    def finished(self, tokens: list[int]) -> bool:
        """Whether a lane's answer `tokens` is complete (the decoders' shared rule)."""
        return is_finished(tokens, self.max_new_tokens, self.stop_ids)

    def _forward(
        self, inputs: torch.Tensor, positions: torch.Tensor, new_mask: torch.Tensor, keep: int = 0
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """Greedy token after each fed position (after the last `keep` ones when keep > 0), and
        their log p (batch, positions) as nested lists, or None when not asked for."""
        self.mask = torch.cat([self.mask, new_mask], dim=1)
        with torch.no_grad(), attention_lane_groups(self.groups):
            out = self.model(
                input_ids=inputs,
                past_key_values=self.cache,
                position_ids=positions,
                attention_mask=self.mask,
                logits_to_keep=keep,
            )
        tokens = out.logits.argmax(-1)
        logprobs = chosen_logprobs(out.logits, tokens).tolist() if self.with_logprobs else None
        return tokens.tolist(), logprobs

    def verify_draft(self, question_ids: list[int], draft: list[int]) -> None:
        """One teacher-forced forward of question + draft for every lane; keep each lane's agreeing prefix."""
        device = self.model.device
        fed = list(question_ids) + list(draft[:-1])
        inputs = torch.as_tensor(fed, device=device).view(1, -1).expand(self.n, -1)
        start = self.context_length
        positions = torch.arange(start, start + len(fed), device=device).view(1, -1).expand(self.n, -1)
        base = self.mask.shape[1]
        keep = len(fed) - self.q_len + 1  # the question's last position and every draft position
        choices, logprobs = self._forward(
            inputs, positions, torch.ones((self.n, len(fed)), dtype=self.mask.dtype, device=device), keep=keep
        )
        for lane in range(self.n):
            # The question's last token is the pending one, the draft its proposal.
            tokens = self.answers[lane]
            kept, scored = (self.logprobs[lane], logprobs[lane]) if logprobs is not None else (None, None)
            accept(tokens, choices[lane], draft, self.max_new_tokens, self.stop_ids, kept, scored)
            # Slots the lane saw: the question and the draft tokens it agreed with before its last token.
            self.mask[lane, base + self.q_len + len(tokens) - 1 :] = 0
            if not self.finished(tokens):
                self.active.append(lane)

    def compact(self) -> None:
        """Drop finished lanes from the batch when they are the majority."""
        if 2 * len(self.active) > len(self.lanes):
            return
        keep = [self.lanes.index(r) for r in self.active]  # ascending: active keeps the lanes' order
        for layer in self.cache.layers:
            layer.select_lanes(keep)
        self.mask = self.mask.index_select(0, torch.as_tensor(keep, device=self.mask.device))
        self.lanes = list(self.active)
        self.groups = lane_groups(self.mask)

    def step(self, proposers: dict[int, Proposer]) -> None:
        """Feed each active lane its pending token plus its proposer's proposal; accept what its
        greedy choice confirms (:func:`~certkv.engine.speculation.accept`)."""
        proposals = {r: proposers[r].propose(self.answers[r], self.max_new_tokens - len(self.answers[r]))
                     for r in self.active}
        self.compact()
        device = self.model.device
        size = len(self.lanes)
        width = 1 + max(len(proposals[r]) for r in self.active)
        inputs = torch.zeros((size, width), dtype=torch.long, device=device)
        positions = torch.zeros((size, width), dtype=torch.long, device=device)
        new_mask = torch.zeros((size, width), dtype=self.mask.dtype, device=device)
        where = {r: b for b, r in enumerate(self.lanes)}
        for r in self.active:
            b = where[r]
            fed = [self.answers[r][-1]] + proposals[r]
            inputs[b, : len(fed)] = torch.as_tensor(fed, device=device)
            first = self.context_length + self.q_len + len(self.answers[r]) - 1
            positions[b] = torch.arange(first, first + width, device=device)
            new_mask[b, : len(fed)] = 1
        base = self.mask.shape[1]
        choices, logprobs = self._forward(inputs, positions, new_mask)
        still = []
        for r in self.active:
            b = where[r]
            kept, scored = (self.logprobs[r], logprobs[b]) if logprobs is not None else (None, None)
            accepted = accept(self.answers[r], choices[b], proposals[r], self.max_new_tokens, self.stop_ids, kept, scored)
            proposers[r].accepted(accepted - 1)  # the pending token's choice, then the confirmed proposal tokens
            # The pending token and the proposal tokens that were confirmed stay visible; the rest go.
            self.mask[b, base + accepted :] = 0
            if not self.finished(self.answers[r]):
                still.append(r)
        self.active = still
