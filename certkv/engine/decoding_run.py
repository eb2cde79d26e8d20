"""One generation under a decoding-time press, exactly as kvpress's pipeline runs it.

kvpress's decoding presses (``DecodingPress``, ``CompressionRatioDecodingPress`` and the
``PrefillDecodingPress`` wrapper) hook every attention layer and compress the cache while the
answer is decoded: every ``compression_interval`` forwards a layer's cache is cut down to its
target by the wrapped scorer, scored with the hidden states buffered since the last event. What
they keep depends on every token decoded before, so no single prefill can stand in for them: each
candidate decodes on its own, under the press's context manager, the way kvpress's pipeline does —
the prefill under the press only when the press compresses prefills too (the wrapper), then the
question and the greedy answer under the press. Tests compare the answers with the pipeline's
token for token.

Besides the answer, the run keeps what a long generation's gates and budgets read, step by step:
each generated token's log p, the KV entries the cache holds after each forward
(:mod:`certkv.core.kv_cost`) and, under certkv's probabilistic decoding press, the survey-variance
certificate of the forward that chose each token (0 before the press first samples). Each is
read as soon as its token is chosen, so a recompute trigger on either (token probability below r,
certificate above b) stops the run before the token is kept: calibration and the runtime read the
same numbers the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from kvpress import DecodingPress, PrefillDecodingPress
from transformers import DynamicCache

from certkv.core.gate_features import fires
from certkv.model.generation import greedy_decode
from certkv.model.window_queries import capturing_window_queries
from certkv.presses.hajek_state import clear_states
from certkv.presses.probabilistic_decoding import ProbabilisticDecodingPress

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from certkv.model.generation import EncodedRequest


@dataclass
class DecodingRun:
    """One generation under a decoding-time press.

    ``token_ids``: the greedy answer (stop token included); ``logprobs``: each token's log p;
    ``held``: the entries the cache holds after each forward (mean over layers), one per token;
    ``prefill_kept``: the entries the prefill left (the context, unless the press compresses
    prefills too); ``stopped_at``: where a recompute trigger stopped the run (None: it finished);
    ``certificate_max``: the largest survey-variance certificate of the run's steps under certkv's
    probabilistic decoding press (None under any other press); ``certificates``: under that press,
    per kept token the certificate of the forward that chose it (empty under any other press);
    ``held_units``: in a KV format's cache, what it holds after each forward in 16-bit token slots
    (:func:`certkv.kv_formats.caches.held_units`; empty for a 16-bit cache, where it equals ``held``).
    """

    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    held: list[float] = field(default_factory=list)
    prefill_kept: float = 0.0
    stopped_at: int | None = None
    certificate_max: float | None = None
    certificates: list[float] = field(default_factory=list)
    held_units: list[float] = field(default_factory=list)


def is_decoding_press(press: Any) -> bool:
    """Whether `press` compresses while decoding (kvpress's decoding presses and their wrapper,
    certkv's probabilistic decoding press)."""
    return isinstance(press, (DecodingPress, PrefillDecodingPress, ProbabilisticDecodingPress))


def compresses_prefill(press: Any) -> bool:
    """Whether kvpress's pipeline runs the prefill under `press` too: every press but the plain
    decoding ones (the wrapper applies its prefilling press there)."""
    return not isinstance(press, DecodingPress)


def run_decoding(
    model: PreTrainedModel,
    press: Any,
    enc: EncodedRequest,
    max_new_tokens: int,
    stop_below: float | None = None,
    on_token: Callable[[list[int]], None] | None = None,
    stop_above: float | None = None,
) -> DecodingRun:
    """Prefill `enc`'s context and decode its answer under `press`, as kvpress's pipeline does.

    Positions continue from the context's length (the pipeline's convention); the press's state
    (its buffers and step counts) is reset when each context manager exits, so runs are independent.
    `stop_below`: stop as soon as a generated token's probability falls below it (the recompute
    gate's trigger); `stop_above`: stop as soon as the certificate of the forward that chose a
    token exceeds it (the certificate recompute's trigger; certkv's probabilistic decoding press
    only). The token that fires is not kept, and ``DecodingRun.stopped_at`` says where it stood.
    `on_token` is called with the answer so far after each token is kept (what a server streams).
    """
    probabilistic = isinstance(press, ProbabilisticDecodingPress)
    if stop_above is not None and not probabilistic:
        raise ValueError(f"stop_above watches the probabilistic decoding press's certificate; {type(press).__name__} has none")
    context = torch.as_tensor(enc.context_ids, device=model.device).view(1, -1)
    cache = DynamicCache()
    held = press.entries_held if probabilistic else _entries_held
    try:
        with torch.no_grad():
            with press(model) if compresses_prefill(press) else nullcontext(), capturing_window_queries(model):
                model.model(input_ids=context, past_key_values=cache)
            run = DecodingRun(token_ids=[], prefill_kept=held(cache))
            watch = StopWatch(stop_below, stop_above, _StepCertificates(press, model) if probabilistic else None)
            with press(model):
                decode_into(model, cache, enc.question_ids, context.shape[1], max_new_tokens, run, watch, held, on_token)
                if probabilistic:
                    run.certificate_max = press.certificate_max(model)
    finally:
        if probabilistic:  # its Hájek states outlive its blocks
            clear_states(model)
    return run


def finish_on_full_cache(model: PreTrainedModel, enc: EncodedRequest, prefix: list[int], max_new_tokens: int,
                         on_token: Callable[[list[int]], None] | None = None) -> DecodingRun:
    """The recompute fallback: prefill the context with the full cache, feed the question and the
    `prefix` generated so far in one forward, and decode greedily to the end of the answer.

    Under greedy decoding, a `prefix` that the full cache's own answer starts with continues into
    exactly that answer (up to the float noise of feeding the prefix in one forward instead of
    token by token). The returned run's ``token_ids`` hold the whole answer, `prefix` included;
    ``logprobs`` and ``held`` cover the tokens decoded here only; `on_token` is called with the
    whole answer so far after each token decoded here.
    """
    context = torch.as_tensor(enc.context_ids, device=model.device).view(1, -1)
    cache = DynamicCache()
    run = DecodingRun(token_ids=list(prefix), prefill_kept=float(context.shape[1]))
    with torch.no_grad():
        model.model(input_ids=context, past_key_values=cache)
        decode_into(model, cache, [*enc.question_ids, *prefix], context.shape[1], max_new_tokens, run, StopWatch(),
                _entries_held, on_token)
    return run


def _entries_held(cache: DynamicCache) -> float:
    """The entries `cache` holds: its layers' lengths, (1, H_kv, n, d) keys each, averaged over layers."""
    return sum(layer.keys.shape[-2] for layer in cache.layers) / len(cache.layers)


@dataclass
class _StepCertificates:
    """Reads, after each forward under `press`, the certificate of the step it recorded: the
    largest over the steps recorded since the last read (one per forward once the press has
    sampled), 0 when none was (nothing sampled yet: the attention is exact)."""

    press: ProbabilisticDecodingPress
    model: PreTrainedModel
    read: int = 0

    def __call__(self) -> float:
        new = self.press.certificates_since(self.model, self.read)
        self.read += len(new)
        return max(new, default=0.0)


@dataclass
class StopWatch:
    """What a decode checks per chosen token: its probability against `stop_below`, and the
    certificate `certificate` reads against `stop_above` (None: that part off; `certificate`
    also records the certificates when no bound is set)."""

    stop_below: float | None = None
    stop_above: float | None = None
    certificate: Callable[[], float] | None = None

    def stops(self, logprob: float, certificate: float | None) -> bool:
        """Whether the token stops the run: certification's comparisons (:func:`fires`)."""
        if self.stop_below is not None and self.stop_below > 0 and logprob < math.log(self.stop_below):
            return True
        return certificate is not None and self.stop_above is not None and bool(
            fires("certificate_recompute", certificate, self.stop_above))


def decode_into(model, cache, question_ids, position: int, max_new_tokens: int, run: DecodingRun, watch: StopWatch, held,
            on_token: Callable[[list[int]], None] | None = None, units: Callable[[Any], float] | None = None) -> None:
    """Greedy decoding into `run` by :func:`greedy_decode` (forward for forward as kvpress's
    pipeline decodes), keeping per token its log p, the entries `held` counts in the cache after
    the forward that chose it and (`watch` reading them) its step's certificate; a token on which
    `watch` fires ends the run without it (``run.stopped_at``); `units`, when given, prices the cache
    after each kept token into ``run.held_units``. `max_new_tokens` counts the tokens
    `run` already holds. Not speculative (:mod:`certkv.engine.speculation`): under the press's hooks a
    chunk of tokens would be one compression step, not the pipeline's one per token."""

    def keep(token: int, logprob: float) -> bool:
        certificate = watch.certificate() if watch.certificate is not None else None
        if watch.stops(logprob, certificate):
            run.stopped_at = len(run.token_ids)
            return False
        run.token_ids.append(token)
        run.logprobs.append(logprob)
        run.held.append(held(cache))
        if units is not None:
            run.held_units.append(units(cache))
        if certificate is not None:
            run.certificates.append(certificate)
        if on_token is not None:
            on_token(run.token_ids)
        return True

    greedy_decode(model, cache, question_ids, position, max_new_tokens - len(run.token_ids), keep=keep)


__all__ = ["DecodingRun", "StopWatch", "compresses_prefill", "decode_into", "finish_on_full_cache", "is_decoding_press",
           "run_decoding"]
