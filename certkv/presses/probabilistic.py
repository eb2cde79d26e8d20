"""Probabilistic (Poisson-sampled) eviction with Hájek-corrected attention (docs/design.md,
"Gate signals").

A deterministic eviction press has no handle on its own error: the entries it drops are simply
gone. Sampling the low-score tail instead, with known inclusion probabilities π_i, turns the kept
cache into a survey sample of the full one: weighting each kept tail entry by 1/π_i inside the
softmax (adding −log π_i to its logit) makes the attention output a Hájek (ratio) estimator of the
full-cache output, and the survey variance of that estimator is a per-step certificate ĉ that the
runtime can check (see :mod:`certkv.presses.hajek_attention`).

Per layer and KV head, out of ``n_kept = compute_n_kept(K, compression_ratio)`` entries (kvpress's
count):

* a deterministic **head** with π = 1: the first ``n_sink`` entries, the last ``window`` entries,
  and the top-scored entries, ``head_share`` of what is left of the budget;
* a Poisson-sampled **tail**: every other entry i is kept independently with probability
  π_i ∝ score_i, capped at 1 and re-normalised so that Σ π_i is the rest of the budget
  (:func:`~certkv.presses.poisson_selection.probabilistic_selection`). The expected kept count is exactly ``n_kept``; the realised
  count varies per request, layer and head.

Storage (the decision the attention function relies on)
-------------------------------------------------------
Poisson sampling keeps a different number of entries per (batch row, KV head) and per layer, but a
cache layer is one rectangular tensor, and transformers builds one attention mask for all layers
from layer 0's length. So every layer of the cache is padded to one common width: the largest
count over all layers, batch rows and KV heads of the prefill (on average a few standard
deviations, ~3·sqrt(tail budget), above the expected count). Within a layer a head with fewer
entries fills its extra slots with entries of its own tail that were *not* sampled (real keys and
values); slots added afterwards to reach the common width hold zeros. Both kinds are marked
invalid and the attention function gives them a −inf logit, so they carry exactly zero weight.
Layout along the sequence axis: ``[head entries (n_head) | sampled tail, ascending position |
padding]``; tokens appended later (question, answer) follow. The widths are equalised by the
press's forward hook after the last layer (:func:`equalise_widths`); code that gathers caches
itself from :meth:`ProbabilisticPress.select` (the engine's one-prefill path) pads with
:func:`pad_selection`. Realised retention counts valid entries only (:func:`kept_fraction`).

The per-entry information lives on the attention module itself, as kvpress does with
``masked_key_indices``: ``module.certkv_hajek`` holds a :class:`HajekState` (log π per kept slot,
validity, counts, derived logit bias) for the cache's first ``N`` slots, and
``module.certkv_certificates`` is the list the attention function appends each step's
certificates to. The press sets both after pruning a layer; the attention function clears them at
the next full prefill (query length == key length), so a stale state never leaks into another
request; :func:`clear_states` does it explicitly. With ``compression_ratio == 0`` the press leaves
the cache untouched and clears the state, so attention is plain.

Reproducibility: the uniforms of layer ``l`` come from a CPU ``torch.Generator`` seeded with
``seed * 1_000_003 + l``, drawn in float64 and then moved to the cache's device, so the same
request with the same seed keeps the same entries on any device: calibration and runtime agree.
The press with a fixed seed is a deterministic policy, which is what certification needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from kvpress.presses.base_press import BasePress, is_prefilling
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import compute_n_kept

from certkv.model.layers import attention_modules
from certkv.model.window_attention import forget_window_attention
from certkv.presses._checks import check_base_press, check_count, check_ratio
from certkv.presses.hajek_state import HajekState, clear_state, equalise_widths, set_state
from certkv.presses.poisson_selection import Selection, probabilistic_selection
from certkv.presses.value_norm import AttentionTimesValueNormPress

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class ProbabilisticPress(BasePress):
    """Deterministic head + Poisson-sampled tail; needs the Hájek attention (see module docstring).

    Run the model with :func:`certkv.presses.hajek_attention.use_hajek_attention` (or the
    attention implementation ``certkv.presses.hajek_attention.NAME`` after ``register()``): with
    any other attention the padding slots would not be masked and the −log π correction not applied.
    ``compression_ratio`` is kvpress's (1 − nominal kv_retained); the realised retention, which
    varies around it, is :func:`kept_fraction`.
    """

    compression_ratio: float = 0.0
    """Target fraction evicted; the expected kept count per head is kvpress's compute_n_kept."""
    base_press: ScorerPress = field(default_factory=AttentionTimesValueNormPress)
    """Only its score() is used: it ranks the head and sizes the tail's inclusion probabilities."""
    n_sink: int = 4
    """First entries always kept (attention sinks)."""
    window: int = 16
    """Most recent entries always kept."""
    head_share: float = 0.5
    """Share of the budget left after sinks and window kept deterministically by top score
    (1: a deterministic press; 0: only sinks and window are certain)."""
    seed: int = 0
    """Seeds the per-layer generators: a fixed seed makes the press a reproducible policy."""
    score_floor: float = 0.01
    """Added to tail scores as a multiple of their mean so that every tail entry has π > 0."""

    def __post_init__(self) -> None:
        check_ratio(self.compression_ratio)
        check_base_press(self.base_press)
        check_count("n_sink", self.n_sink)
        check_count("window", self.window)
        if isinstance(self.head_share, bool) or not isinstance(self.head_share, (int, float)) or not 0 <= self.head_share <= 1:
            raise ValueError(f"head_share must be a number in [0, 1], got {self.head_share!r}")
        check_count("seed", self.seed)
        if (isinstance(self.score_floor, bool) or not isinstance(self.score_floor, (int, float))
                or not (math.isfinite(self.score_floor) and self.score_floor >= 0)):
            raise ValueError(f"score_floor must be a finite number ≥ 0, got {self.score_floor!r}")

    def post_init_from_model(self, model: PreTrainedModel) -> None:
        self.base_press.post_init_from_model(model)
        # the layers whose widths the last hook equalises (not a dataclass field: not a setting)
        self._attention_modules = attention_modules(model)

    def forward_hook(self, module: torch.nn.Module, input: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        """kvpress's hook (prune this layer), then, after the last layer, equalise the widths."""
        output = super().forward_hook(module, input, kwargs, output)
        modules = getattr(self, "_attention_modules", None)
        if (
            self.compression_ratio > 0 and modules and module is modules[-1]
            and is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1])
        ):
            equalise_widths(kwargs["past_key_values"], modules)
            # the window-attention means the scores shared are not needed while decoding
            forget_window_attention(modules)
        return output

    def generator(self, layer_idx: int) -> torch.Generator:
        """The CPU generator of layer `layer_idx` (fresh and identically seeded on every call)."""
        return torch.Generator().manual_seed((self.seed * 1_000_003 + int(layer_idx)) % (2**63))

    def select(self, module: torch.nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               attentions: torch.Tensor | None, kwargs: dict[str, Any]) -> Selection:
        """The layer's selection, without pruning anything (the engine's one-prefill path can use it)."""
        scores = self.base_press.score(module, hidden_states, keys, values, attentions, kwargs)
        return self._selection(scores, self.generator(module.layer_idx))

    def _selection(self, scores: torch.Tensor, generator: torch.Generator | Sequence[torch.Generator]) -> Selection:
        """:func:`probabilistic_selection` of (B, H_kv, K) base scores with this press's settings."""
        return probabilistic_selection(
            scores, compute_n_kept(scores.shape[2], self.compression_ratio), n_sink=self.n_sink,
            window=self.window, head_share=self.head_share, score_floor=self.score_floor, generator=generator,
        )

    def select_layers(self, layer_indices: Sequence[int], scores: Sequence[torch.Tensor]) -> list[Selection]:
        """The selections of several layers of one prefill from their base scores, computed together.

        `scores` is one (B, H_kv, K) tensor per layer of `layer_indices` (the base press's, same
        shape); each returned Selection equals what :meth:`select` gives that layer (each layer
        draws from its own generator) except that all are padded to the widest (invalid slots).
        The engine scores each layer in its hook and selects once after the last one.
        """
        scores = list(scores)
        if len(scores) != len(layer_indices) or len({tuple(s.shape) for s in scores}) > 1:
            raise ValueError("select_layers needs one score tensor per layer, all of one shape")
        batch = scores[0].shape[0]
        joint = self._selection(torch.cat(scores, dim=0), [self.generator(i) for i in layer_indices])
        rows = [slice(i * batch, (i + 1) * batch) for i in range(len(layer_indices))]
        return [
            Selection(joint.indices[r], joint.log_pi[r], joint.valid[r], joint.counts[r], joint.n_head) for r in rows
        ]

    def compress(self, module: torch.nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 attentions: torch.Tensor | None, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.compression_ratio == 0:
            clear_state(module)
            return keys, values
        k_len = keys.shape[2]
        selection = self.select(module, hidden_states, keys, values, attentions, kwargs)
        index = selection.indices.unsqueeze(-1)
        keys = keys.gather(2, index.expand(-1, -1, -1, keys.shape[-1])).contiguous()
        values = values.gather(2, index.expand(-1, -1, -1, values.shape[-1])).contiguous()
        set_state(module, HajekState.from_selection(selection, context_length=k_len))
        return keys, values
