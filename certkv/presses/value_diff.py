"""ValueDiff: window attention weighted by how far each value lies from the others."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from kvpress.presses.scorer_press import ScorerPress

from certkv.model.window_attention import kv_group_window_attention
from certkv.presses._checks import check_count, check_ratio


@dataclass
class ValueDiffPress(ScorerPress):
    """Score = window attention × ‖v_j − mean of the other values‖, per KV head.

    Evicting entry j changes an attention output by about its weight times how far its value is
    from what the remaining entries average to; an entry whose value repeats its neighbours' costs
    little even when it is attended, which attention-only scores (SnapKV) cannot see.
    :class:`~certkv.presses.value_norm.AttentionTimesValueNormPress` weighs by ‖v_j‖ instead, which
    is large for every entry of a high-norm head, so the two differ.

    Choices the method leaves open, made here: the attention is that of the last ``window_size``
    queries of the prefill (SnapKV's window; in the query-aware protocol, the question), averaged
    over the window and over the query heads of each KV group; "the others" is the unweighted mean
    of the other values of the head; and the window's own entries are always kept (their scores
    are raised above every other entry's), as SnapKV keeps them, because they are the queries the
    score was read from. The window of 64 is measured against one of 16 in docs/benchmarks.md,
    "Press alternatives".

    Scores are (B, H_kv, K) float32; kvpress's ``ScorerPress.compress`` keeps the top
    ``(1 − compression_ratio) · K`` per head, so certkv's fast path evaluates it from one prefill.
    """

    compression_ratio: float = 0.0
    window_size: int = 64

    def __post_init__(self) -> None:
        check_ratio(self.compression_ratio)
        check_count("window_size", self.window_size, 1)

    def score(self, module: torch.nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              attentions: torch.Tensor | None, kwargs: dict[str, Any]) -> torch.Tensor:
        """(B, H_kv, K) scores from `keys`/`values` (B, H_kv, K, d) and `hidden_states` (B, Q, hidden)."""
        k_len = keys.shape[2]
        attention = kv_group_window_attention(module, hidden_states, keys, kwargs["position_embeddings"], self.window_size)
        values32 = values.float()
        others = (values32.sum(dim=2, keepdim=True) - values32) / max(1, k_len - 1)
        scores = attention * torch.linalg.vector_norm(values32 - others, dim=-1)
        window = min(self.window_size, hidden_states.shape[1], k_len)
        scores[..., k_len - window :] = scores.max() + 1.0
        return scores
