"""KV formats as a contract writes them: the precision a candidate stores its keys and values at.

A policy entry's ``cache:`` block names one format (or, with ``nbits`` as a list, a ladder of
them, most bytes first). Torch-free: the contract validates formats, names them and prices them
without the model stack; :mod:`certkv.kv_formats.caches` builds the cache a format describes.

Backends:

* ``quanto`` / ``hqq``: transformers' ``QuantizedCache`` (KIVI-style: the prefill and every full
  window of decoded tokens are quantised in groups of ``q_group_size`` along ``axis_key`` /
  ``axis_value`` with a scale and a zero point each; the last ``residual_length`` tokens stay at
  full precision). Its backend library must be installed where calibration runs.
* ``fp8``: each element cast to float8 (``e4m3`` or ``e5m2``) after division by a per-tensor
  ``scale`` (1.0, what vLLM and SGLang use without calibrated scales).
* ``int``: symmetric integers of ``nbits`` (2–8), one 16-bit scale per ``q_group_size`` channels
  of a token and head (per token and head when the group is the head's size: SGLang's int8;
  llama.cpp's ``q8_0`` / ``q4_0`` are group 32).
* ``split``: keys and values in two different formats (llama.cpp's ``-ctk q8_0 -ctv q4_0``).
* ``tiered``: three tiers of the context's tokens beside a scorer press (QEvict-style): the
  ``full`` share of the context the press scores highest at 16 bits, the rest of what the press
  keeps in the ``quantised`` format (still read by attention, so recoverable), the others evicted.

Every format's cost is its bits relative to a **16-bit** cache, whatever dtype the model computes
in (``bytes_share``): values, scales, zero points; the full-precision window is counted by
:func:`certkv.kv_formats.caches.held_units`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

#: Bits of the full-precision cache every share is relative to.
REFERENCE_BITS = 16
#: Bits of a scale or zero point (stored at 16 bits by every backend here).
PARAMETER_BITS = 16
#: The largest finite value of each float8 format (torch's float8_e4m3fn and float8_e5m2).
FP8_LARGEST = {"e4m3": 448.0, "e5m2": 57344.0}


def _error(message: str) -> PydanticCustomError:
    """A validation error shown as written (no "Value error," prefix)."""
    return PydanticCustomError("certkv", message)


class _Format(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    residual_length: int = Field(default=0, ge=0, description="most recent decoded tokens kept at full precision")

    @property
    def name(self) -> str:  # pragma: no cover - every backend overrides it
        raise NotImplementedError

    def bytes_share(self, head_dim: int) -> float:  # pragma: no cover - every backend overrides it
        """Bytes a quantised token takes over a 16-bit one (keys and values together)."""
        raise NotImplementedError

    def engine_counterpart(self) -> str | None:
        """What to set in a serving engine for this format, or None when none stores it so."""
        return None


def _grouped_bits(nbits: int, group: int, parameters: int) -> float:
    """Bits per element of `nbits` integers with `parameters` 16-bit numbers per `group` elements."""
    return nbits + parameters * PARAMETER_BITS / group


class TransformersFormat(_Format):
    """transformers' ``QuantizedCache`` (module docstring); ``residual_length`` defaults to 32."""

    backend: Literal["quanto", "hqq"]
    nbits: int
    q_group_size: int = Field(default=64, ge=1)
    residual_length: int = Field(default=32, ge=1, description="transformers needs at least one full-precision token")
    axis_key: int = 0
    axis_value: int = 0

    @model_validator(mode="after")
    def _check_backend(self) -> TransformersFormat:
        bits = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}[self.backend]
        axes = {"quanto": (0, -1), "hqq": (0, 1)}[self.backend]
        if self.nbits not in bits:
            raise _error(f"cache.nbits for backend {self.backend} must be one of {list(bits)}, got {self.nbits}")
        for key in ("axis_key", "axis_value"):
            if getattr(self, key) not in axes:
                raise _error(f"cache.{key} for backend {self.backend} must be one of {list(axes)}, got {getattr(self, key)}")
        return self

    @property
    def name(self) -> str:
        return f"{self.backend}{self.nbits}"

    def bytes_share(self, head_dim: int) -> float:
        # asymmetric groups: a scale and a zero point per q_group_size elements
        return _grouped_bits(self.nbits, self.q_group_size, 2) / REFERENCE_BITS

    def engine_counterpart(self) -> str | None:
        return f"transformers QuantizedCache(backend={self.backend!r}, nbits={self.nbits}, q_group_size={self.q_group_size}, " \
               f"residual_length={self.residual_length})"


class Fp8Format(_Format):
    """Float8 with one scale per tensor: ``scale`` for every layer's keys and values (1.0, the
    engines' uncalibrated default), or ``pilot``: per layer, the keys' and the values' largest
    magnitude on the contract's pilot requests over the format's largest value (what vLLM's
    calibrated ``k_scale`` / ``v_scale`` are), placed before calibration and written into
    ``layer_scales`` ((key, value) per layer) by :mod:`certkv.calibration.kv_scales`."""

    backend: Literal["fp8"]
    dtype: Literal["e4m3", "e5m2"] = "e4m3"
    scale: float | Literal["pilot"] = Field(
        default=1.0, description="stored value = element / scale; 1.0: engines' uncalibrated default; pilot: placed per layer")
    layer_scales: list[list[float]] | None = Field(default=None, description="the pilot's [key, value] scales per layer")

    @field_validator("scale")
    @classmethod
    def _positive(cls, value: float | str) -> float | str:
        if not isinstance(value, str) and not (value > 0 and math.isfinite(value)):
            raise _error(f"cache.scale must be a positive finite number or pilot, got {value}")
        return value

    @model_validator(mode="after")
    def _placed(self) -> Fp8Format:
        if self.layer_scales is not None and self.scale != "pilot":
            raise _error("cache.layer_scales are placed on the pilot: set cache.scale to pilot, not the scales")
        if self.layer_scales is not None and any(len(pair) != 2 or min(pair) <= 0 for pair in self.layer_scales):
            raise _error("cache.layer_scales must hold a positive [key, value] pair per layer")
        return self

    @property
    def name(self) -> str:
        if self.scale == "pilot":
            return f"fp8{self.dtype}p"
        return f"fp8{self.dtype}" + ("" if self.scale == 1.0 else f"s{self.scale:g}")

    def scales(self, layer: int) -> tuple[float, float]:
        """(keys' scale, values' scale) of `layer`; a pilot scale must have been placed."""
        if self.scale != "pilot":
            return float(self.scale), float(self.scale)
        if self.layer_scales is None:
            raise ValueError("the fp8 scales are placed on the pilot before calibration; this format has none yet")
        key, value = self.layer_scales[layer]
        return key, value

    def bytes_share(self, head_dim: int) -> float:
        return 8 / REFERENCE_BITS

    def engine_counterpart(self) -> str | None:
        if self.scale == "pilot":
            scales = "with per-layer k/v scales calibrated on your traffic (those of this point: layer_scales)"
        else:
            scales = "without calibrated scales" if self.scale == 1.0 else f"with k/v scale {self.scale:g}"
        return (f"vLLM --kv-cache-dtype fp8_{self.dtype} {scales}; SGLang --kv-cache-dtype fp8_{self.dtype}; "
                f"TensorRT-LLM FP8 KV cache ({'e4m3' if self.dtype == 'e4m3' else 'e5m2: none, TensorRT-LLM stores e4m3'})")


class IntFormat(_Format):
    """Symmetric ``nbits`` integers, a 16-bit scale per ``q_group_size`` channels of a token and
    head (None: the whole head)."""

    backend: Literal["int"]
    nbits: int = Field(ge=2, le=8)
    q_group_size: int | None = Field(default=None, ge=1)

    @property
    def name(self) -> str:
        return f"int{self.nbits}" + ("" if self.q_group_size is None else f"g{self.q_group_size}")

    def group(self, head_dim: int) -> int:
        return head_dim if self.q_group_size is None else self.q_group_size

    def bytes_share(self, head_dim: int) -> float:
        return _grouped_bits(self.nbits, self.group(head_dim), 1) / REFERENCE_BITS

    def engine_counterpart(self) -> str | None:
        if self.residual_length:  # no engine keeps a full-precision window of an int cache
            return None
        if self.nbits == 8 and self.q_group_size is None:
            return "SGLang --kv-cache-dtype int8 (per token and head)"
        if self.q_group_size == 32 and self.nbits in (8, 4):
            return f"llama.cpp --cache-type-k q{self.nbits}_0 --cache-type-v q{self.nbits}_0"
        return None


#: A format that stores keys or values (what ``split`` combines).
SingleFormat = Annotated[TransformersFormat | Fp8Format | IntFormat, Field(discriminator="backend")]


class SplitFormat(_Format):
    """Keys and values at two formats; each keeps its own full-precision window."""

    backend: Literal["split"]
    keys: SingleFormat
    values: SingleFormat

    @model_validator(mode="after")
    def _check_parts(self) -> SplitFormat:
        if isinstance(self.keys, TransformersFormat) or isinstance(self.values, TransformersFormat):
            raise _error("cache.keys and cache.values of a split format must be fp8 or int formats "
                             "(transformers' QuantizedCache quantises keys and values alike)")
        if self.residual_length:
            raise _error("a split format's full-precision window is set on cache.keys and cache.values")
        return self

    @property
    def name(self) -> str:
        return f"k{self.keys.name}-v{self.values.name}"

    def bytes_share(self, head_dim: int) -> float:
        return (self.keys.bytes_share(head_dim) + self.values.bytes_share(head_dim)) / 2

    def engine_counterpart(self) -> str | None:
        k, v = self.keys, self.values
        if all(isinstance(p, IntFormat) and p.q_group_size == 32 and p.nbits in (8, 4) and not p.residual_length
               for p in (k, v)):
            return f"llama.cpp --cache-type-k q{k.nbits}_0 --cache-type-v q{v.nbits}_0"  # type: ignore[union-attr]
        return None


#: A format certkv quantises token by token (what ``tiered`` stores its middle tier in).
TokenFormat = Annotated[Fp8Format | IntFormat | SplitFormat, Field(discriminator="backend")]


class TieredFormat(_Format):
    """Three tiers beside a scorer press: per layer and KV head, the ``full`` share of the context's
    tokens with the press's highest scores kept at 16 bits, the rest of the tokens the press keeps
    (its ``kv_retained``) stored in ``quantised``, the others evicted. The question and the answer
    are stored in ``quantised`` too (its window, if it has one, at full precision)."""

    backend: Literal["tiered"]
    full: float = Field(gt=0, lt=1, description="share of the context kept at 16 bits: the press's highest-scored")
    quantised: TokenFormat

    @model_validator(mode="after")
    def _check_window(self) -> TieredFormat:
        if self.residual_length:
            raise _error("a tiered format's full-precision window is set on cache.quantised")
        return self

    @property
    def name(self) -> str:
        return f"tier{self.full:g}-{self.quantised.name}"

    def bytes_share(self, head_dim: int) -> float:
        """The quantised tier's share (the full tier's tokens are priced at 1 where they are held)."""
        return self.quantised.bytes_share(head_dim)


#: Any KV format a policy entry may carry.
KvFormat = Annotated[TransformersFormat | Fp8Format | IntFormat | SplitFormat | TieredFormat, Field(discriminator="backend")]
_ADAPTER: TypeAdapter = TypeAdapter(KvFormat)
#: The backends a ``cache:`` block may name.
BACKENDS = ("quanto", "hqq", "fp8", "int", "split", "tiered")


def key_value_formats(fmt: KvFormat) -> tuple[KvFormat, KvFormat]:
    """(the keys' format, the values' format): a split's two parts, a tiered format's quantised
    tier's, any other format twice."""
    if isinstance(fmt, TieredFormat):
        return key_value_formats(fmt.quantised)
    return (fmt.keys, fmt.values) if isinstance(fmt, SplitFormat) else (fmt, fmt)


def full_share(fmt: KvFormat | None) -> float:
    """The share of the context a format keeps at 16 bits beside its press (0 but for ``tiered``)."""
    return fmt.full if isinstance(fmt, TieredFormat) else 0.0


#: The widest integers stored two to a byte where the head size does not allow packing them into whole bytes.
NIBBLE_BITS = 4


def stored_bits(nbits: int, head_dim: int) -> int:
    """Bits a stored channel of an ``nbits`` integer format takes for heads of `head_dim` channels
    (:mod:`certkv.kv_formats.token_quantisers` stores them so): ``nbits`` where the channels pack
    into whole bytes (``head_dim`` a multiple of 8), else 4 for ``nbits`` <= 4 and an even head size
    (two to a byte), else 8 (an int8 each).

    Examples
    --------
    >>> stored_bits(6, 64), stored_bits(3, 6), stored_bits(6, 60), stored_bits(8, 64)
    (6, 4, 8, 8)
    """
    if nbits < 8 and head_dim % 8 == 0:
        return nbits
    return NIBBLE_BITS if nbits <= NIBBLE_BITS and head_dim % 2 == 0 else 8


def stored_share(fmt: KvFormat, head_dim: int) -> float:
    """Bytes a stored token takes over a 16-bit one, as this implementation holds it: transformers'
    backends pack their integers, and so do certkv's integer formats, eight channels of b bits in
    b bytes where the head size is a multiple of 8 (what :meth:`bytes_share` prices). For other
    head sizes, integers of at most 4 bits take 4 (two to a byte, head size even) and wider ones 8
    (an int8 each): more than the format's price (:func:`stored_bits`).

    Examples
    --------
    >>> int4, int6 = parse_format({"backend": "int", "nbits": 4}), parse_format({"backend": "int", "nbits": 6})
    >>> stored_share(int6, 64), int6.bytes_share(64), stored_share(int4, 64), stored_share(int6, 60)
    (0.390625, 0.390625, 0.265625, 0.5166666666666667)
    """
    if isinstance(fmt, TieredFormat):
        return stored_share(fmt.quantised, head_dim)
    if isinstance(fmt, SplitFormat):
        return (stored_share(fmt.keys, head_dim) + stored_share(fmt.values, head_dim)) / 2
    if isinstance(fmt, IntFormat):
        return fmt.model_copy(update={"nbits": stored_bits(fmt.nbits, head_dim)}).bytes_share(head_dim)
    return fmt.bytes_share(head_dim)


def needs_pilot_scales(fmt: KvFormat) -> bool:
    """Whether `fmt` (or a part of it) has fp8 scales still to be placed on the pilot."""
    parts = key_value_formats(fmt)
    return any(isinstance(p, Fp8Format) and p.scale == "pilot" and p.layer_scales is None for p in parts)


def with_pilot_scales(fmt: KvFormat, amax: list[list[float]]) -> KvFormat:
    """`fmt` with every pilot-scaled fp8 part's ``layer_scales`` placed: per layer, the pilot's
    largest key and value magnitudes `amax` ([key, value] per layer) over the part's largest value.

    Examples
    --------
    >>> placed = with_pilot_scales(parse_format({"backend": "fp8", "scale": "pilot"}), [[224.0, 4.48]])
    >>> placed.scales(0)
    (0.5, 0.01)
    """
    def placed(part):
        if isinstance(part, Fp8Format) and part.scale == "pilot":
            largest = FP8_LARGEST[part.dtype]
            pairs = [[(k / largest) or 1.0, (v / largest) or 1.0] for k, v in amax]
            return part.model_copy(update={"layer_scales": pairs})
        return part
    if isinstance(fmt, TieredFormat):
        return fmt.model_copy(update={"quantised": with_pilot_scales(fmt.quantised, amax)})
    if isinstance(fmt, SplitFormat):
        return fmt.model_copy(update={"keys": placed(fmt.keys), "values": placed(fmt.values)})
    return placed(fmt)


def parse_format(data: dict[str, Any]) -> KvFormat:
    """A format from its JSON/YAML mapping (as an operating point or a policy entry stores it)."""
    return _ADAPTER.validate_python(data)


def format_ladder(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The formats a ``cache:`` block lists, most bits first: one per ``nbits`` when it is a list.

    Examples
    --------
    >>> [f["nbits"] for f in format_ladder({"backend": "hqq", "nbits": [8, 4]})]
    [8, 4]
    >>> format_ladder({"backend": "fp8"})
    [{'backend': 'fp8'}]
    """
    bits = data.get("nbits")
    if not isinstance(bits, list):
        return [dict(data)]
    if not bits or any(not isinstance(b, int) or isinstance(b, bool) for b in bits):
        raise _error(f"cache.nbits must be an integer or a non-empty list of integers, got {bits}")
    if any(a <= b for a, b in zip(bits, bits[1:])):
        raise _error(f"cache.nbits must be strictly decreasing (a ladder is tested most bytes first), got {bits}")
    return [{**data, "nbits": b} for b in bits]


class CacheBlock(BaseModel):
    """A policy entry's ``cache:`` block: one format or a ladder over ``nbits`` (validated here,
    expanded by :func:`format_ladder`)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    backend: str

    @field_validator("backend")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in BACKENDS:
            raise _error(f"cache.backend must be one of {', '.join(BACKENDS)}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _formats(self) -> CacheBlock:
        for data in format_ladder(self.model_dump()):
            _check_cheaper(data)
            try:
                parse_format(data)
            except ValidationError as exc:
                first = exc.errors()[0]
                tags = set(BACKENDS)  # a union's branch names, not keys
                where = ".".join(str(p) for p in first["loc"] if p not in tags)
                own = first["type"] == "certkv" or not where
                raise _error(first["msg"] if own else f"cache.{where}: {first['msg']}") from None
        return self

    def formats(self) -> list[KvFormat]:
        return [parse_format(data) for data in format_ladder(self.model_dump())]


def _check_cheaper(data: dict[str, Any]) -> None:
    """A format must store fewer bytes than a 16-bit cache (its scales included), whatever the head
    size (checked at 128, the largest common one: a per-head scale costs less there than anywhere)."""
    try:
        fmt = parse_format(data)
    except ValidationError:
        return  # reported, in one line, by the caller
    if fmt.bytes_share(128) >= 1:
        raise _error(f"cache {fmt.name} stores {fmt.bytes_share(128):.3g} of a 16-bit cache's bytes, not less; "
                     "use fewer bits or a larger q_group_size")


__all__ = ["BACKENDS", "NIBBLE_BITS", "CacheBlock", "Fp8Format", "IntFormat", "KvFormat", "SplitFormat", "TieredFormat",
           "TokenFormat", "TransformersFormat", "format_ladder", "full_share", "key_value_formats", "needs_pilot_scales",
           "parse_format", "stored_bits", "stored_share", "with_pilot_scales"]
