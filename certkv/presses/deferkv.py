"""DeferKV: the eviction decision moves from the end of the prefill to the first decode step."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from kvpress import SnapKVPress
from kvpress.presses.base_press import is_prefilling
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import extract_keys_and_values

from certkv.model.layers import attention_modules, decoder
from certkv.presses._checks import check_count
from certkv.presses.response_aware import ResponseAwarePress, head_mean
from certkv.signals.lookahead import lookahead_probe

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

    from certkv.model.generation import EncodedRequest


def _default_prompt_press() -> ScorerPress:
    return SnapKVPress(window_size=64, kernel_size=5)


@dataclass
class DeferKVPress(ResponseAwarePress):
    """Keep the entries that both the prompt and the first decoded queries point at.

    A prefill-time press must guess what the answer will need from the prompt alone. DeferKV waits
    for the first real decode step: the question (or, query-aware, the prompt's last token) is fed
    over the full cache and the queries of the first ``decode_queries`` answer positions (the feed's
    last query, then the greedy tokens after it) are read; each KV head's score is

        (1 − weight) · s_prompt / Σ s_prompt + weight · s_decode / Σ s_decode,

    with ``s_prompt`` the ``prompt_press`` score from the prefill (SnapKV by default) and
    ``s_decode`` those queries' attention on the context, averaged over the positions and the query
    heads of the group. Each score is normalised to sum 1 per head, so ``weight`` is the share of
    the decision the decode step gets, whatever the two scores' scales.

    Choices the method leaves open, made here: the decode queries are the full-cache model's own
    greedy ones (the same calls as the lookahead probe); the normalisation is by the sum; and the
    answer is then decoded from the compressed cache from its first token on, so it depends on the
    compressed cache alone like every other press's (a deployment that keeps the tokens it decoded
    over the full cache before deciding differs only in those ``decode_queries`` − 1 tokens). The
    defaults, one decode query with half of the decision (``decode_queries: 1``, ``weight: 0.5``),
    are measured against ``decode_queries: 4`` and against the decode queries alone
    (``weight: 1.0``) in docs/benchmarks.md, "Press alternatives".
    """

    prompt_press: ScorerPress = field(default_factory=_default_prompt_press)
    decode_queries: int = 1
    weight: float = 0.5
    _prompt_scores: list[torch.Tensor] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count("decode_queries", self.decode_queries, 1)
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not 0 <= self.weight <= 1:
            raise ValueError(f"weight must be a number in [0, 1], got {self.weight!r}")
        if not isinstance(self.prompt_press, ScorerPress):
            raise ValueError(f"prompt_press must be a kvpress ScorerPress, got {type(self.prompt_press).__name__}")

    @contextmanager
    def observe(self, model: PreTrainedModel) -> Iterator[None]:
        """Record ``prompt_press``'s scores (1, H_kv, n_ctx) per layer during the full prefill."""
        self._prompt_scores = []
        self.prompt_press.post_init_from_model(model)
        scores = self._prompt_scores
        language_model = decoder(model)

        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            hidden_states = kwargs["hidden_states"]
            if is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
                keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
                scores.append(self.prompt_press.score(module, hidden_states, keys, values, output[1], kwargs).float())
            return output

        added, handles = [], []
        try:
            for module in attention_modules(model):
                if not hasattr(module, "rotary_emb"):
                    module.rotary_emb = language_model.rotary_emb  # some kvpress scores read it
                    added.append(module)
                handles.append(module.register_forward_hook(hook, with_kwargs=True))
            yield
        finally:
            for h in handles:
                h.remove()
            for module in added:
                del module.rotary_emb

    def scores(self, model: PreTrainedModel, cache: DynamicCache, enc: EncodedRequest,
               stop_ids: Iterable[int]) -> list[torch.Tensor]:
        """Per layer (1, H_kv, n_ctx): the normalised prompt and decode scores, mixed by ``weight``."""
        n_ctx = len(enc.context_ids)
        if len(self._prompt_scores) != len(cache.layers):
            raise RuntimeError("DeferKVPress.scores needs the prompt scores that observe() records during the prefill")
        probe = lookahead_probe(model, cache, enc.question_ids, n_ctx, self.decode_queries - 1, stop_ids)
        kv_heads = cache.layers[0].keys.shape[1]
        out = []
        for layer, prompt in enumerate(self._prompt_scores):
            decode = head_mean(probe.weights[layer].mean(dim=1), kv_heads).unsqueeze(0)  # (1, H_kv, n_ctx)
            prompt = prompt.to(decode.device)
            out.append((1 - self.weight) * _normalised(prompt) + self.weight * _normalised(decode))
        self._prompt_scores = []
        return out


def _normalised(scores: torch.Tensor) -> torch.Tensor:
    """`scores` (1, H_kv, n) shifted to be ≥ 0 and divided by their sum per head."""
    shifted = scores - scores.amin(dim=-1, keepdim=True).clamp(max=0)
    return shifted / shifted.sum(dim=-1, keepdim=True).clamp(min=1e-30)
