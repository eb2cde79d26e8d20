"""One generation with its KV cache stored in a KV format, alone or beside a press.

The cache is the format's (:func:`certkv.kv_formats.caches.build_cache`, a ``QuantizedCache``),
and the generation is kvpress's pipeline given that cache (the runtime's and calibration's decode
for transformers' formats and for any press but a plain scorer; a scorer beside one of certkv's
per-token formats chooses on the full prefill instead: :mod:`certkv.engine.format_lanes`): the context prefilled (under the press
when it compresses prefills: kvpress dequantises each layer, prunes it and quantises the kept
entries back), the question fed after it, one token a forward (a chunk fed at once would move
transformers' full-precision window at other steps), under the press's hooks when it compresses
while decoding. A format alone stores the prefill exactly as the request's full prefill computed
it, so calibration primes its cache from that prefill (`full`) instead of running the model again.

Per kept token the run records the entries held (``held``, the token share) and, priced in 16-bit
token slots, the bytes (``held_units``): :func:`certkv.core.kv_cost.kv_cost` makes peak and
KV-time shares of both. `stop_below` is the recompute gate's trigger, as in
:func:`certkv.engine.decoding_run.run_decoding`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from certkv.engine.decoding_run import DecodingRun, StopWatch, compresses_prefill, decode_into, is_decoding_press
from certkv.engine.positions import continues_from_compressed_length
from certkv.kv_formats.caches import build_cache, held_tokens, held_units, prime
from certkv.model.window_queries import capturing_window_queries

if TYPE_CHECKING:
    from transformers import Cache, PreTrainedModel

    from certkv.kv_formats.spec import KvFormat
    from certkv.model.generation import EncodedRequest


def head_dim(model: PreTrainedModel) -> int:
    """The size of one attention head's keys (what per-head scales are counted against)."""
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_slot_bytes(model: PreTrainedModel) -> int:
    """Bytes one token's keys and values take in one layer at the model's dtype (a server's KV
    budget counts token slots of every layer: :mod:`certkv.serve.kv_budget`)."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * heads * head_dim(model) * next(model.parameters()).element_size()


def run_in_format(
    model: PreTrainedModel,
    fmt: KvFormat,
    enc: EncodedRequest,
    max_new_tokens: int,
    press: Any = None,
    *,
    full: Cache | None = None,
    stop_below: float | None = None,
    on_token: Callable[[list[int]], None] | None = None,
) -> DecodingRun:
    """Generate `enc`'s answer with the KV cache in `fmt` (module docstring).

    Parameters
    ----------
    press : kvpress press, optional
        Prefill-time or decoding-time; None: every token kept, only the precision changes.
    full : Cache, optional
        The request's full prefill of ``enc.context_ids`` ((1, kv_heads, n_ctx, head_dim) per
        layer), read and left unchanged; with no press the format's cache is primed from it.
    """
    cache = build_cache(fmt, model.config)
    n_ctx = len(enc.context_ids)
    with torch.no_grad():
        if press is None and full is not None:
            prime(cache, full)
        else:
            prefill_press = press if press is not None and compresses_prefill(press) else None
            with prefill_press(model) if prefill_press is not None else nullcontext(), capturing_window_queries(model):
                model.model(input_ids=torch.as_tensor(enc.context_ids, device=model.device).view(1, -1), past_key_values=cache)
        run = DecodingRun(token_ids=[], prefill_kept=held_tokens(cache))
        position = cache.get_seq_length() if press is not None and continues_from_compressed_length(press) else n_ctx
        size = head_dim(model)
        with press(model) if press is not None and is_decoding_press(press) else nullcontext():
            decode_into(model, cache, enc.question_ids, position, max_new_tokens, run, StopWatch(stop_below), held_tokens,
                        on_token, units=lambda c: held_units(c, fmt, size))
    return run


__all__ = ["head_dim", "layer_slot_bytes", "run_in_format"]
