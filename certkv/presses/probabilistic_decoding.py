"""certkv's probabilistic press applied while decoding: the cache re-sampled every few steps
(docs/long-generations.md, "The probabilistic press while decoding").

:class:`~certkv.presses.probabilistic.ProbabilisticPress` samples the context once, at the prefill,
and a long answer then grows the cache by a token a step. This press keeps the cache bounded
while decoding: at the prefill (unless ``compress_prefill`` is off) and then every
``compression_interval`` forwards, each layer's cache is sampled again, down to ``kv_retained``
of every token seen so far in expectation (kvpress's ``compute_n_kept`` of that count), by the
same rule as the prefill press: per layer and KV head, the first ``n_sink`` and the last
``window`` entries and the top-scored ``head_share`` of the rest are kept for sure, every other
entry independently with its inclusion probability (:func:`~certkv.presses.poisson_selection.
probabilistic_selection`).

Two-phase sampling. An entry that survives several events was kept by each with its conditional
probability, so its inclusion probability is their product: the state's log π is the sum of the
events' log π, and the Hájek attention weights it by 1/π as after the prefill press. The sizes an
event's probabilities are proportional to are the *corrected* window attention of the queries
decoded since the last event (the prefill's last context queries at the prefill) times ‖v‖: an
entry standing in for 1/π entries of the full cache weighs that much, so the product π ends up
proportional to the entry's own attention, as at the prefill. The certificate each step records
is the prefill press's (the linearised survey standard error, with the compound π): the largest
over a generation is the candidate's ``certificate_max``, the gate signal. It changes at every
step (each forward's queries read the sampled entries differently), not only at events, so a
trigger that watches it reads each step's as soon as it is decoded
(:meth:`ProbabilisticDecodingPress.certificates_since`).

Layout. Within each (batch row, KV head) the kept entries stay in ascending position (so "first"
and "last" keep their meaning event after event), π = 1 entries and sampled ones interleaved: the
state's head is empty and its tail weight 1 − π is 0 wherever π = 1. Rows keep different counts
(Poisson sampling); shorter rows are padded with invalid slots, then the layers are padded to one
width (:func:`~certkv.presses.hajek_state.equalise_widths`); tokens decoded afterwards follow.
:meth:`ProbabilisticDecodingPress.entries_held` counts valid entries only, as the prefill press's
``kept_fraction`` does.

Reproducibility: the uniforms of layer ``l``, event ``e``, batch row ``b`` and KV head ``h`` come
from a CPU generator seeded from ``(seed, l, e, b, h)``, and the per-request state (events, tokens
seen, buffered queries) is reset at each prefill: the same request under the same press keeps the
same entries in calibration and at runtime.

Use it like any kvpress press, around the prefill and then around the decode; its context turns
on the Hájek attention. The states it leaves on the attention modules are read by
:meth:`~ProbabilisticDecodingPress.certificate_max` and dropped by ``clear_states``
(:func:`certkv.engine.decoding_run.run_decoding` does both).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from kvpress.presses.base_press import BasePress, is_prefilling
from kvpress.utils import compute_n_kept

from certkv.core.spec import AGREEMENT_WINDOW
from certkv.model.layers import attention_modules
from certkv.model.window_attention import window_attention
from certkv.presses._checks import check_count
from certkv.presses.hajek_attention import certificate_steps, settle_certificates, use_hajek_attention
from certkv.presses.hajek_state import CERT_ATTR, STATE_ATTR, HajekState, equalise_widths
from certkv.presses.poisson_selection import probabilistic_selection
from certkv.presses.probabilistic import ProbabilisticPress

if TYPE_CHECKING:
    from transformers import Cache, PreTrainedModel


@dataclass
class _Track:
    """One layer's per-request progress: tokens seen, events so far, the queries since the last."""

    seen: int
    events: int = 0
    steps: int = 0
    hidden: list[torch.Tensor] = field(default_factory=list)
    cos: list[torch.Tensor] = field(default_factory=list)
    sin: list[torch.Tensor] = field(default_factory=list)


@dataclass
class ProbabilisticDecodingPress(BasePress):
    """Poisson-sampled, Hájek-corrected eviction at the prefill and every few decoding steps.

    ``compression_ratio`` is the share of the tokens seen so far that each event evicts in
    expectation (1 − kv_retained, the registry's knob); the other settings are those of
    :class:`~certkv.presses.probabilistic.ProbabilisticPress`.
    """

    compression_ratio: float = 0.0
    """Expected share of the tokens seen so far evicted at each event."""
    compression_interval: int = 16
    """Forwards (the question feed, then one per token) between two events of a layer."""
    compress_prefill: bool = True
    """Sample the context at the prefill too (False: the whole prompt is held until the first event)."""
    window_size: int = AGREEMENT_WINDOW
    """The last queries whose corrected attention sizes the probabilities."""
    n_sink: int = 4
    window: int = 16
    head_share: float = 0.5
    seed: int = 0
    score_floor: float = 0.01

    def __post_init__(self) -> None:
        # the shared settings are checked by the prefill press's own validation
        ProbabilisticPress(compression_ratio=self.compression_ratio, n_sink=self.n_sink, window=self.window,
                           head_share=self.head_share, seed=self.seed, score_floor=self.score_floor)
        check_count("compression_interval", self.compression_interval, 1)
        check_count("window_size", self.window_size, 1)
        if not isinstance(self.compress_prefill, bool):
            raise ValueError(f"compress_prefill must be true or false, got {self.compress_prefill!r}")
        self._tracks: dict[int, _Track] = {}

    def post_init_from_model(self, model: PreTrainedModel) -> None:
        self._modules = attention_modules(model)

    @contextmanager
    def __call__(self, model: PreTrainedModel) -> Generator:
        """kvpress's hooks, under the Hájek attention. The states stay on the modules when the
        block exits (the prefill's block is followed by the decode's)."""
        with use_hajek_attention(model), super().__call__(model):
            try:
                yield
            finally:
                for track in self._tracks.values():
                    track.hidden, track.cos, track.sin = [], [], []

    def forward_hook(self, module: torch.nn.Module, input: Any, kwargs: dict[str, Any], output: Any) -> Any:
        """At the prefill: start the request (and sample); while decoding: buffer, and sample every
        ``compression_interval`` forwards; after the last layer's event, equalise the widths."""
        hidden = kwargs["hidden_states"]
        layer_idx = int(module.layer_idx)
        if is_prefilling(kwargs["cache_position"], hidden.shape[1]):
            start = self._tracks[layer_idx] = _Track(seen=hidden.shape[1])
            if self.compress_prefill:
                self._event(module, kwargs, hidden, kwargs["position_embeddings"], start)
            return output
        track = self._tracks.get(layer_idx)
        if track is None:
            raise RuntimeError("ProbabilisticDecodingPress decodes a request whose prefill it did not see; "
                               "prefill under the press first")
        cos, sin = kwargs["position_embeddings"]
        track.seen += hidden.shape[1]
        track.steps += 1
        track.hidden.append(hidden.detach().clone())
        track.cos.append(cos)
        track.sin.append(sin)
        if track.steps >= self.compression_interval:
            position = (torch.cat(track.cos, dim=1), torch.cat(track.sin, dim=1))
            self._event(module, kwargs, torch.cat(track.hidden, dim=1), position, track)
            track.steps, track.hidden, track.cos, track.sin = 0, [], [], []
        return output

    def _event(self, module: torch.nn.Module, kwargs: dict[str, Any], hidden: torch.Tensor,
               position: tuple[torch.Tensor, torch.Tensor], track: _Track) -> None:
        """Sample layer `module`'s cache again (nothing at compression ratio 0)."""
        if self.compression_ratio == 0:
            return
        cache = kwargs["past_key_values"]
        layer = cache.layers[module.layer_idx]
        state = getattr(module, STATE_ATTR, None)
        steps = getattr(module, CERT_ATTR, None)
        if steps:  # pending steps belong to the state about to be replaced
            settle_certificates(steps)
        log_pi, valid = slot_weights(state, layer.keys.shape)
        sizes = corrected_sizes(module, hidden, layer.keys, layer.values, position, log_pi, valid, self.window_size)
        keys, values, new_state = self._resample(layer.keys, layer.values, log_pi, valid, sizes, track, module.layer_idx)
        layer.keys, layer.values = keys, values
        setattr(module, STATE_ATTR, new_state)
        setattr(module, CERT_ATTR, steps if steps is not None else [])
        track.events += 1
        modules = getattr(self, "_modules", None)
        if modules and module is modules[-1]:
            equalise_widths(cache, modules)

    def generator(self, layer_idx: int, event: int, row: int, head: int) -> torch.Generator:
        """The CPU generator of one (layer, event, batch row, KV head): fresh and identically seeded."""
        mixed = ((self.seed * 1_000_003 + layer_idx) * 1_000_033 + event) * 1_000_037 + row * 4099 + head
        return torch.Generator().manual_seed(mixed % (2**63))

    def _resample(self, keys: torch.Tensor, values: torch.Tensor, log_pi: torch.Tensor, valid: torch.Tensor,
                  sizes: torch.Tensor, track: _Track, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, HajekState]:
        """Each (row, KV head)'s valid slots sampled down to the event's budget: the gathered
        (B, H_kv, W, d) keys and values and their state (compound log π, validity, counts)."""
        batch, heads = keys.shape[:2]
        n_kept = compute_n_kept(track.seen, self.compression_ratio)
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        for b in range(batch):
            for h in range(heads):
                slots = valid[b, h].nonzero().squeeze(-1)
                selection = probabilistic_selection(
                    sizes[b, h, slots].view(1, 1, -1), min(n_kept, slots.numel()), n_sink=self.n_sink,
                    window=self.window, head_share=self.head_share, score_floor=self.score_floor,
                    generator=self.generator(layer_idx, track.events, b, h),
                )
                chosen = selection.valid[0, 0]
                order = selection.indices[0, 0][chosen].argsort()
                picked = selection.indices[0, 0][chosen][order]
                kept.append((slots[picked], log_pi[b, h, slots[picked]] + selection.log_pi[0, 0][chosen][order]))
        width = max(index.numel() for index, _ in kept)
        index = torch.zeros(batch * heads, width, dtype=torch.long, device=keys.device)
        new_log_pi = torch.zeros(batch * heads, width, dtype=torch.float32, device=keys.device)
        new_valid = torch.zeros(batch * heads, width, dtype=torch.bool, device=keys.device)
        for row, (slot_index, slot_log_pi) in enumerate(kept):
            n = slot_index.numel()
            index[row, :n], new_log_pi[row, :n], new_valid[row, :n] = slot_index, slot_log_pi, True
        index, new_log_pi, new_valid = (t.view(batch, heads, width) for t in (index, new_log_pi, new_valid))
        gather = index.unsqueeze(-1)
        keys = keys.gather(2, gather.expand(-1, -1, -1, keys.shape[-1])).contiguous()
        values = values.gather(2, gather.expand(-1, -1, -1, values.shape[-1])).contiguous()
        counts = new_valid.sum(-1)
        return keys, values, HajekState(new_log_pi, new_valid, counts, 0, track.seen)

    def entries_held(self, cache: Cache) -> float:
        """The entries `cache` holds, mean over layers and KV heads: valid sampled slots plus the
        tokens appended since the layer's last event (padding slots are not counted)."""
        modules = getattr(self, "_modules", None) or []
        total = 0.0
        for layer_idx, layer in enumerate(cache.layers):
            length = layer.keys.shape[-2]
            state = getattr(modules[layer_idx], STATE_ATTR, None) if layer_idx < len(modules) else None
            total += length if state is None else float(state.counts.float().mean()) + length - state.n_slots
        return total / len(cache.layers)

    def certificate_max(self, model: PreTrainedModel) -> float:
        """The largest survey-variance certificate over the steps decoded since the prefill
        (0 when nothing was sampled), batch row 0 (the decode runs one request)."""
        rows = certificate_steps(model)
        return max(rows[0], default=0.0) if rows else 0.0

    def certificates_since(self, model: PreTrainedModel, start: int) -> list[float]:
        """The certificates of the steps recorded from step `start` on, oldest first, batch row 0.

        A step is a forward under a sampled cache: none is recorded before the first event (a
        press that does not compress the prefill holds the exact prompt until then), then one per
        forward, the question's first. Reading after each forward computes that step's
        certificate at once (a handful of kernel calls for all layers together) instead of in a
        batch of pending steps: what a mid-generation trigger pays to decide before the next token.
        """
        rows = certificate_steps(model, start)
        return list(rows[0]) if rows else []


def slot_weights(state: HajekState | None, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H_kv, K) float32 log π and bool validity of every slot of a layer of `shape`
    (B, H_kv, K, d): the state's first N slots, then tokens appended since (π = 1, valid)."""
    batch, heads, k_len = shape[:3]
    log_pi = torch.zeros(batch, heads, k_len, dtype=torch.float32)
    valid = torch.ones(batch, heads, k_len, dtype=torch.bool)
    if state is not None:
        log_pi = log_pi.to(state.log_pi.device)
        valid = valid.to(state.valid.device)
        log_pi[..., : state.n_slots] = state.log_pi
        valid[..., : state.n_slots] = state.valid
    return log_pi, valid


def corrected_sizes(module: torch.nn.Module, hidden: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    position: tuple[torch.Tensor, torch.Tensor], log_pi: torch.Tensor, valid: torch.Tensor,
                    window: int) -> torch.Tensor:
    """(B, H_kv, K) float32 sizes: the Hájek-corrected attention of the last `window` queries of
    `hidden` (B, Q, hidden), mean over those queries and each KV group's query heads, times ‖v‖.

    The window attention over every slot is reweighted by 1/π (0 for padding) and normalised again,
    which is the softmax with the Hájek bias added to its logits: what the decode itself attends.
    `position` is the (cos, sin) of `hidden`'s positions, (B, Q, d) each.
    """
    batch, kv_heads, k_len, _ = keys.shape
    probs = window_attention(module, hidden, keys, position, window)  # (B, H, W, K)
    weight = torch.where(valid, (-log_pi).exp(), torch.zeros_like(log_pi)).to(probs.device)
    grouped = probs.view(batch, kv_heads, -1, k_len) * weight.unsqueeze(2)
    grouped = grouped / grouped.sum(-1, keepdim=True).clamp_min(torch.finfo(grouped.dtype).tiny)
    return grouped.mean(dim=2) * torch.linalg.vector_norm(values, dim=-1, dtype=torch.float32)


__all__ = ["ProbabilisticDecodingPress", "corrected_sizes", "slot_weights"]
