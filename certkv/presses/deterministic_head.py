"""The deterministic counterpart of the probabilistic press: top-k with sinks and window protected."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from kvpress.presses.scorer_press import ScorerPress

from certkv.presses._checks import check_base_press, check_count, check_ratio
from certkv.presses.poisson_selection import head_priority
from certkv.presses.value_norm import AttentionTimesValueNormPress

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class DeterministicHeadPress(ScorerPress):
    """The deterministic counterpart: kvpress top-k of the base scores with sinks and window protected.

    Equals :class:`ProbabilisticPress` with ``head_share=1`` entry for entry (same top-k call on the
    same priorities), so it is the reference for "with every π = 1 the answers equal the
    deterministic press's", and a plain ScorerPress the engine's fast path can score.
    """

    compression_ratio: float = 0.0
    base_press: ScorerPress = field(default_factory=AttentionTimesValueNormPress)
    n_sink: int = 4
    window: int = 16

    def __post_init__(self) -> None:
        check_ratio(self.compression_ratio)
        check_base_press(self.base_press)
        check_count("n_sink", self.n_sink)
        check_count("window", self.window)

    def post_init_from_model(self, model: PreTrainedModel) -> None:
        self.base_press.post_init_from_model(model)

    def score(self, module: torch.nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              attentions: torch.Tensor | None, kwargs: dict[str, Any]) -> torch.Tensor:
        """The base press's scores (B, H_kv, K) with the sinks and the recent window ranked first."""
        scores = self.base_press.score(module, hidden_states, keys, values, attentions, kwargs)
        return head_priority(scores, self.n_sink, self.window)
