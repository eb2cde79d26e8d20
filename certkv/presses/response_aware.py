"""Presses that choose what to keep after the prefill, from the queries of the response.

kvpress's presses evict inside the prefill, layer by layer, before any answer token exists. The
newest methods read the response side instead: the first decoded queries (DeferKV), sampled short
continuations (LORE-KV) or the next-token distribution (Behavior-Preserving KV). They need the
full cache after the prefill and the whole model, which kvpress's per-layer hooks never have, so
they run on certkv's engine only, in two phases around its single full prefill:

1. :meth:`ResponseAwarePress.observe` is entered during the prefill (default: records nothing), so
   a press can keep prompt-side statistics from the same forward;
2. :meth:`ResponseAwarePress.select` is called once the full cache exists, and returns the kept
   context entries per layer as the fast path's presses give them; the engine then gathers and
   decodes them like any other candidate, and the runtime does the same, so the answers it serves
   are the ones calibration recorded.

The answer is decoded entirely from the compressed cache, the question feed included: whatever
the press ran over the full cache to decide (the question, sampled tokens) is discarded.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from kvpress.utils import compute_n_kept

from certkv.errors import CertkvError
from certkv.presses._checks import check_ratio

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

    from certkv.model.generation import EncodedRequest


@dataclass
class ResponseAwarePress:
    """Base class: subclasses implement :meth:`scores` (and :meth:`observe` when they read the prefill).

    ``compression_ratio`` is kvpress's knob (1 − kv_retained), so the registry builds these presses
    like kvpress's; each layer keeps the top ``compute_n_kept(n_ctx, compression_ratio)`` entries of
    every KV head, in ``topk`` order, exactly as kvpress's ``ScorerPress.compress`` keeps them.
    :meth:`scores` must not read ``compression_ratio``: calibration scores one press of each
    :meth:`score_key` once and keeps every retention's top-k of the same scores.
    """

    compression_ratio: float = 0.0

    def __post_init__(self) -> None:
        check_ratio(self.compression_ratio)

    def __call__(self, model: Any) -> Any:
        """kvpress's pipeline applies a press as a context manager over the prefill; this one decides
        after it, which that pipeline cannot do."""
        raise CertkvError(
            f"{type(self).__name__} chooses its entries after the prefill and runs on certkv's engine only "
            "(certkv calibrate, CertifiedRuntime, certkv serve), not inside kvpress's pipeline"
        )

    def observe(self, model: PreTrainedModel) -> AbstractContextManager[Any]:
        """A context manager entered during the request's single full prefill (default: records nothing)."""
        return nullcontext()

    def scores(self, model: PreTrainedModel, cache: DynamicCache, enc: EncodedRequest,
               stop_ids: Iterable[int]) -> list[torch.Tensor]:
        """Per layer, float scores (1, H_kv, n_ctx) of the context entries (higher: kept first).

        `cache` is the full prefill of ``enc.context_ids`` (n_ctx entries per layer); whatever the
        press feeds over it must be cropped away again (``cache.crop(n_ctx)``) before returning.
        """
        raise NotImplementedError

    def select(self, model: PreTrainedModel, cache: DynamicCache, enc: EncodedRequest,
               stop_ids: Iterable[int]) -> list[torch.Tensor | None]:
        """Per layer, the kept context indices (1, H_kv, n_kept) in ``topk`` order (None: keep all)."""
        if self.compression_ratio == 0:
            return [None] * len(cache.layers)
        return self.top_k(self.checked_scores(model, cache, enc, stop_ids))

    def checked_scores(self, model: PreTrainedModel, cache: DynamicCache, enc: EncodedRequest,
                       stop_ids: Iterable[int]) -> list[torch.Tensor]:
        """:meth:`scores`, checked to have left the cache as it found it (n_ctx entries per layer)."""
        n_ctx = len(enc.context_ids)
        scored = self.scores(model, cache, enc, stop_ids)
        if cache.get_seq_length() != n_ctx:
            raise RuntimeError(f"{type(self).__name__}.scores left {cache.get_seq_length()} entries, not {n_ctx}")
        return scored

    def top_k(self, scored: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Per layer, the top ``compute_n_kept(n_ctx, compression_ratio)`` indices of `scored`."""
        if self.compression_ratio == 0:
            return [None] * len(scored)
        n_kept = compute_n_kept(scored[0].shape[-1], self.compression_ratio)
        return [s.topk(n_kept, dim=-1).indices for s in scored]

    def score_key(self) -> tuple[Any, ...]:
        """Presses with equal keys score alike: every setting but the retention (scores never read it)."""
        settings = {f.name: repr(getattr(self, f.name)) for f in fields(self) if f.init and f.name != "compression_ratio"}
        return (type(self).__module__, type(self).__qualname__, tuple(sorted(settings.items())))


def is_response_aware_press(press: object) -> bool:
    """Whether `press` chooses its entries after the prefill (:class:`ResponseAwarePress`)."""
    return isinstance(press, ResponseAwarePress)


def prefill_observers(presses: Iterable[ResponseAwarePress]) -> list[ResponseAwarePress]:
    """The presses whose :meth:`~ResponseAwarePress.observe` must watch a request's prefill: one
    per ``score_key`` (presses differing only in retention share one scoring), none at retention
    1.0 (nothing is evicted, so nothing is scored)."""
    first: dict[tuple[Any, ...], ResponseAwarePress] = {}
    for press in presses:
        if press.compression_ratio != 0:
            first.setdefault(press.score_key(), press)
    return list(first.values())


def head_mean(weights: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Mean over the query heads of each KV group: (q_heads, ..., n) → (kv_heads, ..., n)."""
    return weights.view(kv_heads, weights.shape[0] // kv_heads, *weights.shape[1:]).mean(dim=1)
