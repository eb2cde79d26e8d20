"""Per-token quantisers: fp8 with a per-tensor scale, symmetric integers with per-group scales.

Each token's keys (or values) are quantised on their own, so a token stored at step t holds the
same numbers whatever is stored after it: a cache of these formats may append tokens one at a time
or a chunk at once and dequantise to the same tensors. Tensors are ``(batch, kv_heads, tokens,
head_dim)``; a :class:`StoredTokens` keeps what the format stores (float8 elements; int8
containers of ``nbits`` integers and float16 scales) and dequantises to the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from certkv.kv_formats.spec import Fp8Format, IntFormat

#: What a stored token knows how to dequantise with.
TokenQuantiser = Union["Fp8Quantiser", "IntQuantiser"]

_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass
class StoredTokens:
    """Quantised tokens: ``data`` (batch, heads, tokens, head_dim) in the stored dtype, ``scale``
    (batch, heads, tokens, groups) float16 for integer formats (None for fp8), ``dtype`` the
    dtype they dequantise to, ``quantiser`` the format that wrote them."""

    data: torch.Tensor
    scale: torch.Tensor | None
    dtype: torch.dtype
    quantiser: TokenQuantiser

    def dequantize(self) -> torch.Tensor:
        """The tokens as the model reads them, (batch, heads, tokens, head_dim) in ``dtype``."""
        return self.quantiser.dequantize(self)

    @property
    def tokens(self) -> int:
        return self.data.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes the stored tensors take (elements and scales)."""
        return self.data.nbytes + (0 if self.scale is None else self.scale.nbytes)

    def cat(self, other: StoredTokens) -> StoredTokens:
        """These tokens followed by `other`'s (same format)."""
        scale = None if self.scale is None or other.scale is None else torch.cat([self.scale, other.scale], dim=-2)
        return StoredTokens(torch.cat([self.data, other.data], dim=-2), scale, self.dtype, self.quantiser)

    def __getitem__(self, index) -> StoredTokens:
        """Indexed like a (batch, heads, tokens, head_dim) tensor on its first three axes (what
        kvpress's pipeline does to a quantised cache when it drops a question's tokens)."""
        scale = None if self.scale is None else self.scale[index]
        return StoredTokens(self.data[index], scale, self.dtype, self.quantiser)


class Fp8Quantiser:
    """Float8 after division by a per-tensor scale, saturating at the format's largest value (as
    the engines' conversion kernels do)."""

    def __init__(self, fmt: Fp8Format, scale: float) -> None:
        self.stored_dtype = _FP8[fmt.dtype]
        self.scale = scale
        self.largest = torch.finfo(self.stored_dtype).max

    def quantize(self, x: torch.Tensor) -> StoredTokens:
        scaled = (x.float() / self.scale).clamp(-self.largest, self.largest)
        return StoredTokens(scaled.to(self.stored_dtype), None, x.dtype, self)

    def dequantize(self, stored: StoredTokens) -> torch.Tensor:
        return (stored.data.float() * self.scale).to(stored.dtype)


class IntQuantiser:
    """Symmetric ``nbits`` integers in ``[-(2^(b-1) - 1), 2^(b-1) - 1]``, one float16 scale (the
    group's largest magnitude over the largest integer) per group of channels of a token and head."""

    def __init__(self, fmt: IntFormat, head_dim: int) -> None:
        self.group = fmt.group(head_dim)
        if head_dim % self.group:
            raise ValueError(f"cache.q_group_size {self.group} does not divide the model's head size {head_dim}")
        self.largest = 2 ** (fmt.nbits - 1) - 1

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(*x.shape[:-1], x.shape[-1] // self.group, self.group)

    def quantize(self, x: torch.Tensor) -> StoredTokens:
        grouped = self._grouped(x.float())
        scale = (grouped.abs().amax(dim=-1) / self.largest).to(torch.float16)
        divisor = torch.where(scale == 0, torch.ones_like(scale), scale).float().unsqueeze(-1)
        q = torch.round(grouped / divisor).clamp(-self.largest, self.largest).to(torch.int8)
        return StoredTokens(q.reshape(x.shape), scale, x.dtype, self)

    def dequantize(self, stored: StoredTokens) -> torch.Tensor:
        assert stored.scale is not None  # an integer format always stores its scales
        grouped = self._grouped(stored.data.float()) * stored.scale.float().unsqueeze(-1)
        return grouped.reshape(stored.data.shape).to(stored.dtype)




def token_quantiser(fmt: Fp8Format | IntFormat, head_dim: int, layer: int = 0, which: str = "keys") -> TokenQuantiser:
    """The quantiser of a per-token format for `which` ("keys" or "values") of layer `layer` (an
    fp8 format's scale may differ per layer and between the two)."""
    if isinstance(fmt, Fp8Format):
        return Fp8Quantiser(fmt, fmt.scales(layer)[which == "values"])
    return IntQuantiser(fmt, head_dim)


__all__ = ["Fp8Quantiser", "IntQuantiser", "StoredTokens", "TokenQuantiser", "token_quantiser"]
