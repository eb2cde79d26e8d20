"""Per-token quantisers: fp8 with a per-tensor scale, symmetric integers with per-group scales.

Each token's keys (or values) are quantised on their own, so a token stored at step t holds the
same numbers whatever is stored after it: a cache of these formats may append tokens one at a time
or a chunk at once and dequantise to the same tensors. Tensors are ``(batch, kv_heads, tokens,
head_dim)``; a :class:`StoredTokens` keeps what the format stores (float8 elements; integers of
b < 8 bits packed into whole bytes where the head size is a multiple of 8, else two to a byte up
to 4 bits and an int8 each above; 8-bit ones an int8 each; float16 scales) and dequantises to the
model's dtype.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import torch

from certkv.kv_formats.spec import NIBBLE_BITS, Fp8Format, IntFormat, stored_bits

#: What a stored token knows how to dequantise with.
TokenQuantiser = Union["Fp8Quantiser", "IntQuantiser"]

_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass
class StoredTokens:
    """Quantised tokens: ``data`` (batch, heads, tokens, head_dim * stored bits / 8) in the stored
    dtype (:attr:`shape` gives the head size the model reads), ``scale``
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
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, heads, tokens, head_dim) of the tokens as the model reads them (packed integers
        hold 8 / bits channels a byte)."""
        b, h, t, d = self.data.shape
        return b, h, t, d * 8 // getattr(self.quantiser, "stored_bits", 8)

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
    group's largest magnitude over the largest integer) per group of channels of a token and head.
    Integers of b < 8 bits are stored packed where they can be (:func:`~certkv.kv_formats.spec.stored_bits`): with
    :func:`pack_bits` into whole bytes where the head size is a multiple of 8 (4 bits with
    :func:`pack_nibbles`, the same layout), else with :func:`pack_nibbles` for b <= 4 and an even
    head size; packed ``data`` is uint8 (batch, heads, tokens, head_dim * stored_bits / 8). The
    rest, 8-bit integers included, are int8 (batch, heads, tokens, head_dim)."""

    def __init__(self, fmt: IntFormat, head_dim: int) -> None:
        self.group = fmt.group(head_dim)
        if head_dim % self.group:
            raise ValueError(f"cache.q_group_size {self.group} does not divide the model's head size {head_dim}")
        self.largest = 2 ** (fmt.nbits - 1) - 1
        #: Bits a stored channel takes (:func:`~certkv.kv_formats.spec.stored_bits`); below 8 the
        #: integers are packed, into whole bytes where the head size is a multiple of 8, else two to
        #: a byte (b <= 4, even size).
        self.stored_bits = stored_bits(fmt.nbits, head_dim)
        self._pack, self._unpack = _codec(fmt.nbits, self.stored_bits)

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(*x.shape[:-1], x.shape[-1] // self.group, self.group)

    def quantize(self, x: torch.Tensor) -> StoredTokens:
        grouped = self._grouped(x.float())
        scale = (grouped.abs().amax(dim=-1) / self.largest).to(torch.float16)
        divisor = torch.where(scale == 0, torch.ones_like(scale), scale).float().unsqueeze(-1)
        q = torch.round(grouped / divisor).clamp(-self.largest, self.largest).to(torch.int8).reshape(x.shape)
        return StoredTokens(self._pack(q), scale, x.dtype, self)

    def integers(self, stored: StoredTokens) -> torch.Tensor:
        """The stored integers, int8 (batch, heads, tokens, head_dim), unpacked."""
        return self._unpack(stored.data)

    def dequantize(self, stored: StoredTokens) -> torch.Tensor:
        assert stored.scale is not None  # an integer format always stores its scales
        q = self.integers(stored)
        grouped = self._grouped(q.float()) * stored.scale.float().unsqueeze(-1)
        return grouped.reshape(q.shape).to(stored.dtype)


def _codec(nbits: int, stored: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """(pack, unpack) of ``nbits`` integers stored in ``stored`` bits a channel: none at 8, nibbles
    at 4 (for 4 bits the same layout as :func:`pack_bits`, and faster to unpack), else whole bytes."""
    if stored == 8:
        return (lambda q: q), (lambda data: data)
    if stored == NIBBLE_BITS:
        return pack_nibbles, unpack_nibbles
    return functools.partial(pack_bits, nbits=nbits), functools.partial(unpack_bits, nbits=nbits)


def _words(nbits: int) -> tuple[int, int, torch.dtype]:
    """(channels a word holds, bytes it takes, its dtype): the fewest channels of ``nbits`` that
    fill whole bytes (8 / gcd(8, nbits): four 6-bit channels in 3 bytes, eight 5-bit ones in 5),
    in an int32 where they fit and an int64 where they do not."""
    per_word = 8 // math.gcd(8, nbits)
    return per_word, per_word * nbits // 8, torch.int32 if per_word * nbits <= 31 else torch.int64


def pack_bits(q: torch.Tensor, nbits: int) -> torch.Tensor:
    """Integers in [-2^(b-1), 2^(b-1) - 1], int8 (..., 8m), as uint8 (..., b m): a little-endian
    bit stream, channel i at bits b i to b i + b - 1 after an offset of 2^(b-1), cut into bytes.
    The channels are packed a word at a time (:func:`_words`); words end on byte boundaries, so the
    bytes do not depend on the word size. For b = 4 that is :func:`pack_nibbles`'s layout.

    Examples
    --------
    >>> q = torch.tensor([[-31, 31, 0, -1, 5, -7, 17, 30]], dtype=torch.int8)
    >>> pack_bits(q, 6).shape, bool((unpack_bits(pack_bits(q, 6), 6) == q).all())
    (torch.Size([1, 6]), True)
    >>> bool((pack_bits(q[:, :8].clamp(-8, 7), 4) == pack_nibbles(q[:, :8].clamp(-8, 7))).all())
    True
    """
    per_word, nbytes, dtype = _words(nbits)
    words = (q.to(dtype) + (1 << (nbits - 1))).reshape(*q.shape[:-1], q.shape[-1] // per_word, per_word)
    word = (words << (torch.arange(per_word, device=q.device, dtype=dtype) * nbits)).sum(dim=-1, keepdim=True, dtype=dtype)
    byte_shifts = torch.arange(nbytes, device=q.device, dtype=dtype) * 8
    return ((word >> byte_shifts) & 0xFF).to(torch.uint8).reshape(*q.shape[:-1], q.shape[-1] * nbits // 8)


def unpack_bits(packed: torch.Tensor, nbits: int) -> torch.Tensor:
    """:func:`pack_bits` undone: uint8 (..., b m) to int8 (..., 8m). Each word is assembled from
    its bytes and split into its channels with one shift and mask apiece (cheaper, every decoding
    step, than reducing over the short axis of bytes)."""
    per_word, nbytes, dtype = _words(nbits)
    grouped = packed.reshape(*packed.shape[:-1], packed.shape[-1] // nbytes, nbytes).to(dtype)
    word = grouped[..., 0]
    for j in range(1, nbytes):
        word = word | (grouped[..., j] << (8 * j))
    mask, bias = (1 << nbits) - 1, 1 << (nbits - 1)
    values = torch.stack([((word >> (nbits * i)) & mask) for i in range(per_word)], dim=-1) - bias
    return values.to(torch.int8).reshape(*packed.shape[:-1], packed.shape[-1] * 8 // nbits)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Integers in [-8, 7], int8 (..., 2m), as uint8 (..., m): channel 2i in the low nibble, 2i + 1
    in the high one, each offset by 8.

    Examples
    --------
    >>> unpack_nibbles(pack_nibbles(torch.tensor([[-7, 7, 0, -1]], dtype=torch.int8))).tolist()
    [[-7, 7, 0, -1]]
    """
    biased = (q.to(torch.int16) + 8).to(torch.uint8)
    return biased[..., 0::2] | (biased[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """:func:`pack_nibbles` undone: uint8 (..., m) to int8 (..., 2m)."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])




def token_quantiser(fmt: Fp8Format | IntFormat, head_dim: int, layer: int = 0, which: str = "keys") -> TokenQuantiser:
    """The quantiser of a per-token format for `which` ("keys" or "values") of layer `layer` (an
    fp8 format's scale may differ per layer and between the two)."""
    if isinstance(fmt, Fp8Format):
        return Fp8Quantiser(fmt, fmt.scales(layer)[which == "values"])
    return IntQuantiser(fmt, head_dim)


__all__ = ["Fp8Quantiser", "IntQuantiser", "StoredTokens", "TokenQuantiser", "pack_bits", "pack_nibbles", "token_quantiser",
           "unpack_bits", "unpack_nibbles"]
