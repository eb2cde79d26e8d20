"""The cache a KV format describes, and what it holds.

Every format is a transformers ``QuantizedCache`` (kvpress's presses and pipeline recognise one:
they dequantise a layer, compress it and quantise the kept entries back):

* ``quanto`` / ``hqq``: transformers' own, as ``QuantizedCache(backend, ...)`` builds it;
* ``fp8`` / ``int`` / ``split``: :class:`TokenFormatCache`, whose layers quantise each token once,
  when it leaves the full-precision window (:mod:`certkv.kv_formats.token_quantisers`).

Both store the whole prefill quantised, after the prefill's attention read its own keys and values
at full precision. A decoding step of transformers' layers reads the dequantised cache, the
full-precision window and its own new entries at full precision; one of certkv's reads every entry
as stored, its own included (:class:`TokenFormatLayer`).

:func:`held_units` prices what a cache holds in 16-bit token slots (keys and values of one token in
every KV head at 16 bits = 1), so that :func:`certkv.core.kv_cost.kv_cost` turns the units held
after each decoding step into byte shares of a 16-bit full cache, as it turns entries into token
shares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, DynamicLayer, QuantizedCache, QuantizedLayer

from certkv.kv_formats.spec import KvFormat, SplitFormat, TieredFormat, TransformersFormat, key_value_formats
from certkv.kv_formats.token_quantisers import StoredTokens, token_quantiser

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from certkv.kv_formats.spec import Fp8Format, IntFormat


class TokenFormatLayer(QuantizedLayer):
    """One layer of a per-token format: keys and values each in their format, each with its own
    full-precision window of the most recent decoded tokens.

    A decoding step reads every entry as it is stored once the step's own entries are stored: its
    own key and value quantised too when the window is empty (as vLLM's fp8 cache does: the step's
    keys and values are written to the cache before its attention reads it), so a token reads the
    same numbers whether the tokens before it were fed one a forward or in one chunk. The prefill
    reads its own entries at full precision (as the engines' prefill kernels do) and stores them.

    ``axis_key`` / ``axis_value`` name which of the two a tensor is (``"keys"`` / ``"values"``):
    kvpress quantises a compressed layer back with ``layer._quantize(keys, axis=layer.axis_key)``.
    ``_quantized_keys`` / ``_quantized_values`` are :class:`StoredTokens`; ``keys`` / ``values``
    the windows, (batch, heads, window, head_dim) at the model's dtype (empty 1-D before the first
    decoded token, as transformers leaves them).
    """

    def __init__(self, key_format: Fp8Format | IntFormat, value_format: Fp8Format | IntFormat, index: int = 0) -> None:
        DynamicLayer.__init__(self)
        self.formats = {"keys": key_format, "values": value_format}
        self.index = index  # the model layer's (an fp8 scale may be the layer's own)
        self.axis_key, self.axis_value = "keys", "values"
        self.residual_length = max(key_format.residual_length, value_format.residual_length)
        self.cumulative_length = 0

    def _quantize(self, tensor: torch.Tensor, axis) -> StoredTokens:
        return token_quantiser(self.formats[axis], tensor.shape[-1], self.index, axis).quantize(tensor)

    def _dequantize(self, q_tensor: StoredTokens) -> torch.Tensor:
        return q_tensor.dequantize()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None):
        """Store new entries (module docstring); returns every key and value the step attends to."""
        self.cumulative_length += key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._quantized_keys = self._quantize(key_states.contiguous(), "keys")
            self._quantized_values = self._quantize(value_states.contiguous(), "values")
            return key_states, value_states
        return self._step("keys", key_states), self._step("values", value_states)

    def _step(self, which: str, states: torch.Tensor) -> torch.Tensor:
        """Append `states` to `which`'s window, quantise what leaves it; every entry as now stored."""
        stored: StoredTokens = getattr(self, f"_quantized_{which}")
        window: torch.Tensor = getattr(self, which)
        window = states if window.dim() != 4 else torch.cat([window, states], dim=-2)
        leaving = window.shape[-2] - self.formats[which].residual_length
        if leaving > 0:
            stored = stored.cat(self._quantize(window[:, :, :leaving].contiguous(), which))
            window = window[:, :, leaving:]
        setattr(self, f"_quantized_{which}", stored)
        setattr(self, which, window)
        return torch.cat([stored.dequantize(), window], dim=-2)


class TokenFormatCache(QuantizedCache):
    """A cache of :class:`TokenFormatLayer`, one per model layer (a ``QuantizedCache`` for kvpress)."""

    def __init__(self, fmt: Fp8Format | IntFormat | SplitFormat, config: PretrainedConfig) -> None:
        keys, values = key_value_formats(fmt)
        layers = config.get_text_config(decoder=True).num_hidden_layers
        Cache.__init__(self, layers=[TokenFormatLayer(keys, values, i) for i in range(layers)])  # type: ignore[arg-type]


def build_cache(fmt: KvFormat, config: PretrainedConfig) -> QuantizedCache:
    """An empty cache storing keys and values in `fmt`, for a model of `config`."""
    if isinstance(fmt, TieredFormat):
        raise ValueError(f"{fmt.name} keeps its tiers beside a scorer press's choice: it decodes as a format lane "
                         "(certkv.engine.format_lanes), not in a cache of its own")
    if isinstance(fmt, TransformersFormat):
        return QuantizedCache(fmt.backend, config, nbits=fmt.nbits, axis_key=fmt.axis_key, axis_value=fmt.axis_value,
                              q_group_size=fmt.q_group_size, residual_length=fmt.residual_length)
    return TokenFormatCache(fmt, config)


def prime(cache: QuantizedCache, full: Cache) -> QuantizedCache:
    """Store `full`'s entries (a prefill's cache, (1, heads, n, head_dim) per layer) in `cache`,
    exactly as that prefill would have stored them in it: a format's prefill stores what it
    computed, and the prefill's own attention read it at full precision either way."""
    for index, layer in enumerate(full.layers):
        cache.update(layer.keys, layer.values, index)
    return cache


def _window(tensor: torch.Tensor) -> int:
    return tensor.shape[-2] if tensor.dim() == 4 else 0


def held_units(cache: QuantizedCache, fmt: KvFormat, head_dim: int) -> float:
    """What `cache` holds, in 16-bit token slots (module docstring), the mean over its layers:
    each quantised token at its format's share, each token of a full-precision window at 1."""
    parts = key_value_formats(fmt)
    total = 0.0
    for layer in cache.layers:
        for which, part in zip(("keys", "values"), parts):
            window = _window(getattr(layer, which))
            stored = getattr(layer, f"_quantized_{which}", None)
            quantised = stored.tokens if isinstance(stored, StoredTokens) else layer.cumulative_length - window
            total += (quantised * part.bytes_share(head_dim) + window) / 2
    return total / len(cache.layers)


def held_tokens(cache: QuantizedCache) -> float:
    """Tokens `cache` holds (quantised or not), the mean over its layers."""
    return sum(layer.cumulative_length for layer in cache.layers) / len(cache.layers)


__all__ = ["TokenFormatCache", "TokenFormatLayer", "build_cache", "held_tokens", "held_units", "prime"]
