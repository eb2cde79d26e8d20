"""Window attention × ‖v‖: the default size measure of certkv's probabilistic press."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from kvpress.presses.scorer_press import ScorerPress

from certkv.core.spec import AGREEMENT_WINDOW
from certkv.model.window_attention import kv_group_window_attention
from certkv.presses._checks import check_count, check_ratio


@dataclass
class AttentionTimesValueNormPress(ScorerPress):
    """Score = window attention × ‖v‖, the default size measure of :class:`ProbabilisticPress`.

    An entry's contribution to an attention output is its weight times its value; ‖v‖ turns
    SnapKV-style attention into a proxy of that contribution, which is what π should be
    proportional to for the Hájek estimator to have low variance. The attention of the last
    ``window_size`` context queries (causal: the last keys are seen by fewer queries; the press
    that uses this one protects the recent window anyway) is averaged over those queries and over
    the query heads of each KV group.
    """

    compression_ratio: float = 0.0
    window_size: int = AGREEMENT_WINDOW
    """The agreement gate's window by default, so the two read one window attention per layer."""

    def __post_init__(self) -> None:
        check_ratio(self.compression_ratio)
        check_count("window_size", self.window_size, 1)

    def score(self, module: torch.nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              attentions: torch.Tensor | None, kwargs: dict[str, Any]) -> torch.Tensor:
        """(B, H_kv, K): the window attention's mean over the KV group's query heads, times ‖v‖."""
        # Always from the window queries, even when the layer returned eager attention weights:
        # calibration may run eager attention and the runtime sdpa, and the sampled entries must
        # not depend on which (rounding differs, and π drives the Poisson draw).
        attention = kv_group_window_attention(module, hidden_states, keys, kwargs["position_embeddings"], self.window_size)
        return attention * torch.linalg.vector_norm(values, dim=-1, dtype=torch.float32)
