"""The contract: what is certified, on which requests, against which candidates.

A contract is pre-registered: its tolerance, risk, confidence, candidate sequences and procedure
are fixed before calibration, and its hash is stored with the records so that a store can never be
certified against a contract it was not calibrated for. Validation is strict (unknown keys, wrong
types and out-of-range values are errors) because a silently ignored typo in a contract changes the
guarantee. Validation imports no torch: press names are checked against the static registry.

Gated candidates. An optional ``gate:`` block pre-registers runtime gate settings; each setting is
a candidate of its own, derived from the base candidate's records (no extra calibration):

* ``agreement_drop: [t, ...]``: the request runs on the full cache when its agreement drop D < t;
* ``certificate: [b, ...]``: the request escalates to the full cache when its survey-variance
  certificate ĉ > b; only presses that produce certificates (:func:`press_registry.
  produces_certificates`: certkv's ``probabilistic``) get these candidates.

Each setting names and orders its candidates as :mod:`certkv.core.policy_names` says (this module
only validates; :meth:`Contract.policy_entries` hands the validated entries over): for each policy
entry, the ungated sequence, then one sequence per threshold t, then (certificate presses only) one
per bound b and one per pair (t, b), then one per pilot-gate quantile; fixed-sequence testing splits
δ over all of them — unless one interleaved ``order:`` lists every candidate, gated ones included,
as a single sequence at δ. :mod:`certkv.contract.spec` turns a contract into the core's inputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from certkv.core.gate_features import DEFAULT_FEATURES
from certkv.core.policy_names import (
    ENDPOINT_PRESS,
    NO_PRESS,
    PILOT_GATE_KINDS,
    GateChoice,
    PolicyEntry,
    entry_sequences,
    gate_choices,
    gate_label,
)
from certkv.core.procedures import Procedure, procedure_of
from certkv.core.signals import FEATURE_GROUPS
from certkv.core.spec import (
    AGREEMENT_SPLIT,
    AGREEMENT_TOP_K,
    AGREEMENT_WINDOW,
    DEFAULT_MAX_NEW_TOKENS,
    GATE_THRESHOLDS,
    LOOKAHEAD_TOKENS,
    gate_needs,
)
from certkv.errors import CertkvError
from certkv.kv_formats.spec import CacheBlock, KvFormat, TieredFormat, key_value_formats, needs_pilot_scales
from certkv.presses import registry as press_registry

if TYPE_CHECKING:
    from certkv.requests.request_set import Request

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")

#: Optional top-level features; the canonical JSON omits each while unset (Contract.canonical_json).
_LATER_KEYS = ("order", "strata", "coverage", "kv_cost")
#: Optional keys of ``requests:``, omitted the same way while unset.
_LATER_REQUEST_KEYS = ("group_by", "group_measure", "group_bound")


def _certifies(entry: CandidateSequence) -> bool:
    """Whether the entry's press produces certificates (certkv's probabilistic presses)."""
    return entry.press is not None and press_registry.produces_certificates(entry.press)


def _compresses_while_decoding(entry: CandidateSequence) -> bool:
    return entry.press is not None and press_registry.compresses_while_decoding(entry.press)


def _window_of(fmt: KvFormat) -> int:
    """The most recent tokens `fmt` keeps at full precision (keys' or values', the larger)."""
    return max(part.residual_length for part in key_value_formats(fmt))


def _restartable(entry: CandidateSequence) -> bool:
    """Whether a recompute gate can restart the entry's generations mid-decode: a decoding-time
    press's, or any generation with its KV in a format (decoded one token a forward, on its own)."""
    return entry.cache is not None or _compresses_while_decoding(entry)


def _error(message: str) -> PydanticCustomError:
    """A validation error whose message is shown as written (no "Value error," prefix)."""
    return PydanticCustomError("certkv", message)


class _Strict(BaseModel):
    """Base: unknown keys are errors and strings are never coerced into numbers."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class RequestsSpec(_Strict):
    """Where calibration requests come from."""

    source: str = Field(min_length=1, description="JSONL path relative to the contract, or builtin:<mix>")
    limit: int | None = Field(default=None, ge=1, description="use at most this many requests")
    seed: int = 0
    context_length: str | int | None = Field(
        default=None, description="builtin sources only; default 256-512 (ruler tasks: 512-1024)"
    )
    group_by: Literal["context", "request"] | None = Field(
        default=None,
        description="requests that share a context: certify per context, or treat them as independent "
        "(required when contexts repeat; certkv.requests.context_groups)",
    )
    group_measure: Literal["per_context", "per_question", "any_question"] | None = Field(
        default=None,
        description="with group_by: context, what ε bounds: the share of a context's questions violated (each "
        "context weighted equally; default), the share of all questions, or the share of contexts with any violation",
    )
    group_bound: Literal["betting", "hoeffding_bentkus"] | None = Field(
        default=None,
        description="with group_by: context, how a per_context or per_question measure is tested: a betting test "
        "(default; tight when a context's questions are nearly independent) or Hoeffding–Bentkus (worst-case variance)",
    )

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        if value.startswith("builtin:"):
            from certkv.requests.request_set import parse_mix

            try:
                parse_mix(value.removeprefix("builtin:"))
            except CertkvError as exc:
                raise _error(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _check_context_length(self) -> RequestsSpec:
        """A builtin mix's lengths, given or its default, must be ones every task of the mix allows
        (the embedded tasks 64-2048, the ruler tasks 512-8192): refused at load, not at generation."""
        if self.context_length is not None and not self.is_builtin:
            raise _error("context_length applies only to builtin:<mix> sources; remove it for a JSONL file")
        if not self.is_builtin:
            return self
        from certkv.requests.request_set import default_context_length, parse_context_length, parse_mix

        weights = parse_mix(self.source.removeprefix("builtin:"))
        length = default_context_length(weights) if self.context_length is None else self.context_length
        try:
            parse_context_length(length, weights)
        except CertkvError as exc:
            default = "" if self.context_length is not None else f" (the default {length}; set requests.context_length)"
            raise _error(f"{exc}{default}") from None
        return self

    @model_validator(mode="after")
    def _check_grouping(self) -> RequestsSpec:
        for key in ("group_measure", "group_bound"):
            if getattr(self, key) is not None and self.group_by != "context":
                raise _error(f"requests.{key} applies only with requests.group_by: context; remove it or group by context")
        if self.group_bound is not None and self.group_measure == "any_question":
            raise _error("requests.group_bound applies to per_context and per_question; any_question is tested exactly")
        return self

    @property
    def is_builtin(self) -> bool:
        return self.source.startswith("builtin:")

    @property
    def measure(self) -> str | None:
        """What a grouped certificate bounds (``per_context`` by default), None without grouping."""
        return None if self.group_by != "context" else (self.group_measure or "per_context")


class Protocol(_Strict):
    """How each request is run; part of the hash because it changes every answer.

    ``query_aware: false``: the context is prefilled and compressed, then the question is fed
    over the compressed cache (kvpress's pipeline). ``true``: the question is prefilled with the
    context, so the press scores and evicts after seeing it (SnapKV's own setting); only the
    prompt's last token is fed after compression (:func:`certkv.model.generation.for_protocol`).
    """

    query_aware: bool = False
    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, ge=1)
    device: str = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    #: An endpoint contract's route: chat completions (default) or completions (docs/engines.md).
    route: Literal["chat", "completions"] | None = None
    #: Whether an endpoint contract asks its servers for the answer's log-probabilities (unset: yes);
    #: false for a server that refuses them or pays for them, which leaves no confidence gate.
    logprobs: bool | None = None

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE_RE.match(value):
            raise _error(f"device must be auto, cpu, cuda or cuda:N, got {value!r}")
        return value


KvRetained = Annotated[float, Field(gt=0.0, le=1.0)]


_URL_RE = re.compile(r"^https?://[^\s/]+(/\S*)?$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Endpoint(_Strict):
    """What an OpenAI-compatible server is reached by: its base URL (up to ``/v1``), the model
    name it serves, and the environment variable that holds its API key (the key itself never
    sits in the contract, which is hashed and copied into every store)."""

    name: str = Field(min_length=1, description="the model name the server serves (its /v1/models id)")
    api_key_env: str | None = Field(default=None, description="environment variable holding the API key")

    @field_validator("api_key_env")
    @classmethod
    def _check_env(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_RE.match(value):
            raise _error(f"api_key_env {value!r} must name an environment variable (letters, digits, _), not hold a key")
        return value

    @staticmethod
    def _checked_url(value: str) -> str:
        if not _URL_RE.match(value):
            raise _error(f"endpoint URL {value!r} must be http(s)://host[:port]/path, e.g. http://127.0.0.1:8001/v1")
        return value.rstrip("/")


class ModelEndpoint(_Endpoint):
    """``model: {endpoint: URL, name: NAME}``: the full cache is a deployment behind an
    OpenAI-compatible server (certkv.calibration.endpoints); calibration sends it every request."""

    endpoint: str = Field(min_length=1, description="base URL, e.g. http://127.0.0.1:8001/v1")

    @field_validator("endpoint")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return cls._checked_url(value)

    @property
    def url(self) -> str:
        return self.endpoint


class PolicyEndpoint(_Endpoint):
    """A candidate's ``endpoint: {url: URL, name: NAME}``: a compressed deployment behind an
    OpenAI-compatible server."""

    url: str = Field(min_length=1, description="base URL, e.g. http://127.0.0.1:8002/v1")

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return cls._checked_url(value)


class StrataSpec(_Strict):
    """``strata:``: certify each value of a request field on its own (:mod:`certkv.core.strata`)."""

    by: str = Field(default="task", min_length=1, description="task, or metadata.<key>")
    simultaneous: bool = Field(default=False, description="all strata at δ together (each at δ/S)")

    @field_validator("by")
    @classmethod
    def _check_by(cls, value: str) -> str:
        if value != "task" and not (value.startswith("metadata.") and value.removeprefix("metadata.").strip()):
            raise _error(f"strata.by {value!r} must be 'task' or 'metadata.<key>' (a key of the requests' metadata)")
        return value


class CoverageSpec(_Strict):
    """``coverage:``: how far beyond the calibrated context lengths the runtime still serves."""

    context_margin: float = Field(
        default=0.0, ge=0.0, le=10.0,
        description="widen the calibrated [min, max] context tokens to [min·(1 − m), max·(1 + m)]",
    )


class CandidateSequence(_Strict):
    """One candidate sequence, most KV first: a press tried at decreasing retentions, a KV format
    (``cache:``; a ladder when its ``nbits`` is a list, most bits first), or a press at each
    retention with its KV stored in a format (tokens × precision)."""

    press: str | None = None
    kv_retained: list[KvRetained] | None = Field(default=None, min_length=1)
    press_kwargs: dict[str, Any] = Field(default_factory=dict)
    cache: CacheBlock | None = Field(default=None, description="the KV format (certkv.kv_formats.spec); none: 16 bits")
    label: str | None = Field(default=None, description="used instead of the press in policy names")
    endpoint: PolicyEndpoint | None = Field(default=None, description="an OpenAI-compatible server (docs/engines.md)")
    memory: float | None = Field(default=None, description="an endpoint's declared KV share, in (0, 1]")

    @field_validator("press")
    @classmethod
    def _check_press(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not press_registry.is_known_press(value):
            raise _error(press_registry.unknown_press_message(value))
        if press_registry.press_info(value).knob is None:
            raise _error(
                f"press {value!r} has no setting that kv_retained maps to (kvpress configures it by its "
                "own parameters), so it cannot be certified by kv_retained"
            )
        return value

    @field_validator("kv_retained")
    @classmethod
    def _check_order(cls, values: list[float] | None) -> list[float] | None:
        for prev, cur in zip(values or [], (values or [])[1:]):
            if cur == prev:
                raise _error(
                    f"kv_retained lists {cur} twice; a sequence is tested in the order written, "
                    "conservative (most KV) first, so values must be strictly decreasing"
                )
            if cur > prev:
                raise _error(
                    f"kv_retained must be strictly decreasing, got {values}: a sequence is tested in the "
                    "order written, conservative (most KV) first"
                )
        return values

    @field_validator("press_kwargs")
    @classmethod
    def _check_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        for reserved in ("compression_ratio", "target_compression_ratio"):
            if reserved in kwargs:
                raise _error(f"press_kwargs must not set {reserved}; kv_retained sets it")
        try:
            nested = press_registry.nested_press_specs(kwargs)
        except CertkvError as exc:
            raise _error(str(exc)) from None
        for path, spec, _ in nested:
            if not press_registry.is_known_press(spec):
                raise _error(f"press_kwargs.{path}: {press_registry.unknown_press_message(spec)}")
        try:
            json.dumps(kwargs, sort_keys=True)
        except TypeError as exc:
            raise _error(f"press_kwargs must hold plain YAML values: {exc}") from None
        return kwargs

    @field_validator("label")
    @classmethod
    def _check_label(cls, value: str | None) -> str | None:
        if value is not None and not _LABEL_RE.match(value):
            raise _error(f"label {value!r} may use letters, digits and _ . : - only (no @ or spaces)")
        return value

    @model_validator(mode="after")
    def _check_endpoint(self) -> CandidateSequence:
        """An endpoint entry names its deployment (label) and the KV share it declares (memory);
        what runs inside it is the server's, so press, cache and kv_retained are refused."""
        if self.endpoint is None:
            if self.memory is not None:
                raise _error("memory is an endpoint entry's declared KV share; an in-process entry's is its kv_retained "
                             "(remove memory, or add endpoint:)")
            return self
        given = [k for k in ("press", "kv_retained", "cache") if getattr(self, k) is not None] + (
            ["press_kwargs"] if self.press_kwargs else [])
        if given:
            raise _error(f"an endpoint entry runs on its server, which certkv cannot configure: remove {given[0]} "
                         "(declare the deployment's KV share as memory)")
        if self.label is None:
            raise _error("an endpoint entry needs a label (it names the candidate: <label>@<memory>)")
        if self.memory is None or not (0.0 < self.memory <= 1.0):
            raise _error(f"an endpoint entry needs memory in (0, 1], the KV share its deployment uses (declared: "
                         f"certkv cannot see inside the server), got {self.memory!r}")
        return self

    @model_validator(mode="after")
    def _check_axes(self) -> CandidateSequence:
        if self.endpoint is not None:
            return self
        if self.press is None and self.cache is None:
            raise _error("a policy entry needs a press, a cache (a KV format) or both")
        if self.press is None:
            if self.kv_retained is not None or self.press_kwargs:
                raise _error("an entry without a press keeps every token: kv_retained and press_kwargs need a press")
            if any(isinstance(f, TieredFormat) for f in self.formats):
                raise _error("a tiered cache ranks the context's tokens by a press's scores: put it beside a scorer press "
                             "(snapkv, knorm, ...) with kv_retained")
            return self
        if self.kv_retained is None:
            raise _error(f"press {self.press!r} needs kv_retained (the retentions it is tested at, most KV first)")
        self._check_tiers()
        if self.cache is not None and len(self.formats) > 1 and len(self.kv_retained) > 1:
            raise _error("a sequence runs over kv_retained or over cache.nbits, not both; write one entry per retention")
        if self.cache is not None and (reason := press_registry.format_refusal(self.press)):
            raise _error(f"press {self.press!r} {reason}; it cannot store its KV in a format (remove cache:)")
        if self.cache is not None and press_registry.compresses_while_decoding(self.press):
            windowed = [f.name for f in self.formats if _window_of(f) > 0]
            if windowed:
                raise _error(
                    f"press {self.press!r} compresses while decoding, and kvpress's decoding presses drop a quantised "
                    f"cache's full-precision window at every compression (they read only its quantised part); "
                    f"{windowed[0]} keeps one: use an fp8 or int format with residual_length 0"
                )
        return self

    def _check_tiers(self) -> None:
        """A tiered cache's full-precision tier is part of what a prefill-time press keeps."""
        tiered = [f for f in self.formats if isinstance(f, TieredFormat)]
        if not tiered:
            return
        assert self.press is not None and self.kv_retained is not None  # checked before
        if press_registry.compresses_while_decoding(self.press):
            raise _error(f"press {self.press!r} compresses while decoding; a tiered cache ranks the context once, "
                         "at prefill: put it beside a prefill-time scorer press")
        if tiered[0].full >= min(self.kv_retained):
            raise _error(f"cache.full {tiered[0].full:g} must be below every kv_retained ({min(self.kv_retained):g}): "
                         "the full-precision tier is part of the tokens the press keeps")

    @property
    def formats(self) -> list[KvFormat]:
        """The entry's KV formats in test order (empty: 16 bits)."""
        return [] if self.cache is None else self.cache.formats()

    @property
    def display_name(self) -> str:
        """The prefix of this entry's policy names (of its first rung's, for a ladder over bits)."""
        return self.rung_displays()[0]

    def rung_displays(self) -> list[str]:
        """Each rung's display name: the label, else the press; a KV format adds its name after a
        ``+`` (alone: its name), and a ladder over bits names each rung's format."""
        formats = self.formats
        if self.endpoint is not None:
            return [str(self.label)]
        if not formats:
            return [self.label or str(self.press)] * len(self.kv_retained or [])
        if self.label is not None and len(formats) == 1:
            return [self.label] * len(self.kv_retained or [1.0])
        base = self.label or self.press
        names = [fmt.name if base is None else f"{base}+{fmt.name}" for fmt in formats]
        return names * len(self.kv_retained or [1.0]) if len(formats) == 1 else names

    def policy_entry(self, choices: tuple[GateChoice, ...]) -> PolicyEntry:
        """This entry as the core names and orders its candidates, tested under `choices`."""
        formats = self.formats
        if self.endpoint is not None:
            return PolicyEntry(display=str(self.label), press=ENDPOINT_PRESS, kv_retained=(float(self.memory or 1.0),),
                               label=self.label, choices=choices)
        retained = self.kv_retained or [1.0]
        if len(formats) > 1:  # a ladder over bits: its one retention at every rung
            retained = retained * len(formats)
        dumps = [fmt.model_dump() for fmt in formats]
        return PolicyEntry(
            display=self.display_name,
            press=self.press or NO_PRESS,
            kv_retained=tuple(retained),
            press_kwargs=dict(self.press_kwargs),
            label=self.label,
            choices=choices,
            kv_formats=tuple(dumps * len(retained) if len(dumps) == 1 else dumps),
            displays=tuple(self.rung_displays()) if formats else (),
        )


Quantile = Annotated[float, Field(allow_inf_nan=False)]


def _check_quantiles(values: list[float]) -> list[float]:
    """Quantiles in (0, 1), strictly increasing, with distinct names."""
    for q in values:
        if not 0.0 < q < 1.0:
            raise _error(
                f"quantile {q!r} is outside (0, 1); a quantile q sends the share q of the pilot requests with "
                "the most suspicious signal to the full cache, so use values like 0.05, 0.1, 0.2"
            )
    for prev, cur in zip(values, values[1:]):
        if cur == prev:
            raise _error(f"lists {cur} twice; list each quantile once, in increasing order")
        if cur < prev:
            raise _error(f"quantiles must be sorted in increasing order, got {values}; sort them")
    labels = [gate_label(v) for v in values]
    if len(set(labels)) != len(labels):
        raise _error(f"quantiles {values} give the same name twice (6 significant digits); use distinct values")
    return [v + 0.0 for v in values]


class QuantileGate(_Strict):
    """A gate whose thresholds the pilot places: one candidate per pre-registered quantile q."""

    quantiles: list[Quantile] = Field(min_length=1)

    @field_validator("quantiles")
    @classmethod
    def _check(cls, values: list[float]) -> list[float]:
        return _check_quantiles(values)


#: A learned-gate feature group: one of those the signals declare (certkv.core.signals).
FeatureGroup = Literal[FEATURE_GROUPS]  # type: ignore[valid-type]  # the declared names, as pydantic's choices


class LearnedGateSpec(QuantileGate):
    """The learned gate: a logistic regression over `features`, fit per base candidate on the
    pilot, thresholded at the pre-registered quantiles of the pilot's scores."""

    features: list[FeatureGroup] = Field(default_factory=lambda: list(DEFAULT_FEATURES), min_length=1)

    @field_validator("features")
    @classmethod
    def _distinct(cls, values: list[str]) -> list[str]:
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise _error(f"lists {twice[0]!r} twice; list each feature once")
        return values


#: Optional `gate:` features and their unset values; the canonical JSON omits each at it (Gate.hashed_dump).
_LATER_GATE_KEYS = {"pilot": None, "confidence": None, "lookahead": None, "learned": None, "recompute": None,
                    "certificate_recompute": None,
                    "lookahead_tokens": LOOKAHEAD_TOKENS}


class Gate(_Strict):
    """Pre-registered gate settings; each value is a candidate setting, not a tuned one.

    ``agreement_drop`` thresholds may be any finite numbers (the drop can be negative);
    ``certificate`` bounds are positive. The agreement signal's settings (window W, top-k, layer
    split) are part of the contract because they change the signal the thresholds apply to.
    ``confidence``, ``lookahead``, ``learned`` and ``recompute`` list quantiles whose thresholds
    the ``pilot`` share of the requests places (so they need a pilot); ``lookahead_tokens`` is the
    probe's A. ``recompute`` restarts a generation on the full cache as soon as one of its tokens'
    probability falls below the threshold, ``certificate_recompute`` as soon as a decoding step's
    survey-variance certificate exceeds the bound (certkv's probabilistic_decoding press;
    docs/long-generations.md).
    """

    pilot: float | None = None
    agreement_drop: list[Annotated[float, Field(allow_inf_nan=False)]] = Field(default_factory=list)
    certificate: list[Annotated[float, Field(gt=0.0, allow_inf_nan=False)]] = Field(default_factory=list)
    agreement_window: int = Field(default=AGREEMENT_WINDOW, ge=1)
    agreement_top_k: int = Field(default=AGREEMENT_TOP_K, ge=1)
    agreement_split: int = Field(default=AGREEMENT_SPLIT, ge=1)
    confidence: QuantileGate | None = None
    lookahead: QuantileGate | None = None
    learned: LearnedGateSpec | None = None
    recompute: QuantileGate | None = None
    certificate_recompute: QuantileGate | None = None
    lookahead_tokens: int = Field(default=LOOKAHEAD_TOKENS, ge=1, le=64)

    @model_validator(mode="before")
    @classmethod
    def _known_kinds(cls, data):
        if isinstance(data, dict):
            unknown = [k for k in data if k not in cls.model_fields]
            if unknown:
                raise _error(
                    f"unknown key {unknown[0]!r} (not a gate kind or setting); gate: takes "
                    f"{', '.join(cls.model_fields)}; check the spelling or remove it"
                )
        return data

    @field_validator("pilot")
    @classmethod
    def _check_pilot(cls, value: float | None) -> float | None:
        if value is not None and not (0.0 < value < 1.0 and value == value):
            raise _error(f"the pilot share must be strictly between 0 and 1 (e.g. 0.25), got {value!r}")
        return value

    @field_validator("agreement_drop", "certificate")
    @classmethod
    def _check_values(cls, values: list[float]) -> list[float]:
        if len(set(values)) != len(values):
            raise _error(f"gate values must be distinct, got {values}")
        labels = [gate_label(v) for v in values]
        if len(set(labels)) != len(labels):
            twice = next(x for x in labels if labels.count(x) > 1)
            raise _error(
                f"gate values {values} give the name {twice!r} twice (names use format(x, 'g'), 6 significant "
                "digits); use values that differ within 6 significant digits"
            )
        return [v + 0.0 for v in values]  # -0.0 -> 0.0, so names never read "-0"

    @model_validator(mode="after")
    def _not_empty(self) -> Gate:
        for kind in PILOT_GATE_KINDS:
            if getattr(self, kind) is not None and self.pilot is None:
                raise _error(
                    f"gate.{kind} places its thresholds on a pilot split; add gate.pilot (e.g. pilot: 0.25) "
                    f"or remove gate.{kind}"
                )
        return self

    @property
    def has_pilot_gates(self) -> bool:
        """Whether some gate's thresholds are placed on the pilot (confidence, lookahead, learned)."""
        return any(getattr(self, kind) is not None for kind in PILOT_GATE_KINDS)

    @property
    def is_empty(self) -> bool:
        """No gate setting at all (a `gate:` holding only a pilot, for procedure pilot_ordered)."""
        return not self.agreement_drop and not self.certificate and not self.has_pilot_gates

    @property
    def needs_agreement(self) -> bool:
        """Calibration must record the agreement drop (a drop threshold, or a learned feature;
        :func:`certkv.core.spec.gate_needs`, the rule the runtime follows too)."""
        return gate_needs("agreement_drop", self._set_parts(), self._learned_groups())

    @property
    def needs_lookahead(self) -> bool:
        """Calibration must run the lookahead probe (a lookahead gate, or a learned feature;
        :func:`certkv.core.spec.gate_needs`)."""
        return gate_needs("lookahead", self._set_parts(), self._learned_groups())

    def _set_parts(self) -> list[str]:
        """The gate parts some candidate of this block thresholds."""
        return [part for part in GATE_THRESHOLDS if getattr(self, part, None)]

    def _learned_groups(self) -> list[str]:
        return [] if self.learned is None else list(self.learned.features)

    def pilot_choices(self) -> list[GateChoice]:
        """Every pilot gate setting, in sequence order: confidence quantiles, then lookahead, then
        learned (with its feature groups)."""
        return [
            GateChoice(pilot_kind=kind, quantile=q, features=tuple(getattr(block, "features", ())))
            for kind in PILOT_GATE_KINDS
            if (block := getattr(self, kind)) is not None
            for q in block.quantiles
        ]

    def hashed_dump(self, data: dict) -> dict:
        """`data` (this gate's JSON dump) as the canonical JSON holds it: without the optional
        features (:data:`_LATER_GATE_KEYS`) left at their unset values (:meth:`Contract.canonical_json`)."""
        return {k: v for k, v in data.items() if not (k in _LATER_GATE_KEYS and v == _LATER_GATE_KEYS[k])}


class Contract(_Strict):
    """A validated contract. Build it with :func:`load_contract` so relative paths resolve."""

    name: str
    model: Annotated[str, Field(min_length=1)] | ModelEndpoint = "embedded"
    requests: RequestsSpec
    protocol: Protocol = Field(default_factory=Protocol)
    utility: Literal[
        "exact_match", "contains", "f1", "rouge_l", "agreement",
        "prefix_agreement", "token_agreement", "rouge_l_full", "final_answer", "final_agreement",
    ]
    tolerance: float = Field(ge=0.0)
    risk: float = Field(gt=0.0, lt=1.0)
    confidence: float = Field(gt=0.0, lt=1.0)
    procedure: Procedure = "fixed_sequence"
    policies: list[CandidateSequence] = Field(min_length=1)
    # One pre-registered interleaved test order of every candidate (policy names). Without it each
    # policy entry is its own sequence and the sequences share δ (Bonferroni split δ/m).
    order: list[str] | None = None
    gate: Gate | None = None
    strata: StrataSpec | None = None
    coverage: CoverageSpec | None = None
    # What "least KV" means when candidates are compared (certkv.core.kv_cost): the nominal
    # kv_retained, the generation's peak, its KV-time, or the bytes at its peak over a 16-bit full
    # cache's. Unset: bytes when an entry has a KV format, else peak when a policy compresses while
    # decoding (its nominal share is not comparable with a prefill press's), else kv_retained.
    kv_cost: Literal["kv_retained", "peak", "time", "bytes"] | None = None
    store: str | None = Field(default=None, min_length=1, description="relative to the contract's folder")

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME_RE.match(value):
            raise _error(f"name {value!r} may use letters, digits and _ . - only (it names the store folder)")
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _one_kind_of_model(cls, value: Any) -> Any:
        """A model name, or a mapping read as an endpoint: one message for whichever was meant."""
        if isinstance(value, dict):
            try:
                return ModelEndpoint.model_validate(value)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(part) for part in first["loc"])
                raise _error(f"{where + ': ' if where else ''}{first['msg']}") from None
        if not isinstance(value, str | ModelEndpoint) or value == "":
            raise _error("model must be a model name (embedded, a folder, a Hugging Face id) or an endpoint "
                         "{endpoint: URL, name: NAME}")
        return value

    @field_validator("tolerance", "risk", "confidence")
    @classmethod
    def _finite(cls, value: float) -> float:
        if value != value or value in (float("inf"), float("-inf")):
            raise _error("must be a finite number")
        return value

    @field_validator("policies")
    @classmethod
    def _check_policies(cls, policies: list[CandidateSequence]) -> list[CandidateSequence]:
        seen: dict[str, int] = {}
        kwargs_of: dict[str, tuple[int, dict[str, Any]]] = {}
        for i, p in enumerate(policies):
            display = p.display_name
            if display in kwargs_of and kwargs_of[display][1] != p.press_kwargs:
                j = kwargs_of[display][0]
                raise _error(
                    f"entries {j} and {i} both name their policies {display!r} but differ in press_kwargs; "
                    "give them distinct `label`s"
                )
            kwargs_of.setdefault(display, (i, p.press_kwargs))
            for _, _, name, _ in p.policy_entry((GateChoice(),)).rungs():
                if name in seen:
                    raise _error(
                        f"policy {name!r} appears twice (entries {seen[name]} and {i}); every candidate must "
                        "have a distinct name (kv_retained is shown with 2 decimals)"
                    )
                seen[name] = i
        return policies

    @field_validator("policies")
    @classmethod
    def _check_refusals(cls, policies: list[CandidateSequence], info) -> list[CandidateSequence]:
        """Presses that cannot run for this contract (its model, its protocol), each its own line
        (:func:`press_registry.refusal_reason`); `model` and `protocol` are validated before."""
        model = info.data.get("model")
        protocol = info.data.get("protocol")
        if not isinstance(model, str) or protocol is None:  # reported as their own errors; an endpoint runs no press
            return policies
        specs: list[tuple[int, str, str, bool, Mapping[str, Any]]] = [
            (i, p.press, "", False, p.press_kwargs) for i, p in enumerate(policies) if p.press is not None
        ]
        for i, p in enumerate(policies):
            inner = press_registry.nested_press_specs(p.press_kwargs)
            specs += [(i, spec, f"press_kwargs.{path}: ", True, kwargs) for path, spec, kwargs in inner]
        eager = any(press_registry.needs_eager_attention(spec) for _, spec, _, _, _ in specs)
        for i, spec, where, nested, kwargs in specs:
            reason = press_registry.refusal_reason(
                spec, model=model, query_aware=protocol.query_aware, eager=eager, nested=nested, press_kwargs=kwargs
            )
            if reason is not None:
                raise _error(f"entry {i}: {where}{reason}")
        return policies

    @model_validator(mode="after")
    def _check_endpoints(self) -> Contract:
        """An endpoint contract measures servers end to end: every entry is an endpoint, and only
        what the answers show can be used (docs/engines.md); an in-process contract has none."""
        endpoint = self.endpoint
        for i, p in enumerate(self.policies):
            if endpoint is None and p.endpoint is not None:
                raise _error(f"entry {i} is an endpoint, but model runs in-process: candidates are compared with the "
                             "full cache of the same kind; give model: {endpoint: URL, name: NAME} or drop the endpoint")
            if endpoint is not None and p.endpoint is None:
                raise _error(f"entry {i} runs in-process, but model is an endpoint: candidates are compared with the "
                             "full cache of the same kind; give this entry endpoint:, label: and memory:")
        if endpoint is None:
            for key in ("route", "logprobs"):
                if getattr(self.protocol, key) is not None:
                    raise _error(f"protocol.{key} applies to endpoint contracts only; remove it")
            return self
        default = Protocol()
        changed = [k for k in ("query_aware", "device", "dtype") if getattr(self.protocol, k) != getattr(default, k)]
        if changed:
            raise _error(f"protocol.{changed[0]} configures certkv's own engine, and an endpoint runs its own; remove it")
        if self.kv_cost not in (None, "kv_retained"):
            raise _error(f"kv_cost {self.kv_cost} is measured inside certkv's engine; an endpoint's cost is its declared "
                         "memory (remove kv_cost)")
        refused = self._gates_refused_for_endpoints()
        if refused is not None:
            raise _error(f"gate.{refused} reads the model's attention or cache, which an endpoint does not expose; "
                         "endpoints take the confidence gate (gate.pilot with confidence quantiles) only")
        if not self.asks_logprobs and self.gate is not None and self.gate.has_pilot_gates:
            raise _error("the confidence gate reads the answer's log-probabilities, which protocol.logprobs: false "
                         "does not ask for; remove the gate or protocol.logprobs")
        return self

    def _gates_refused_for_endpoints(self) -> str | None:
        """The first gate setting an endpoint cannot feed: one that needs attention, the cache, a
        restart mid-answer or the model's tokenizer (only the answer's log-probabilities come back)."""
        gate = self.gate
        if gate is None:
            return None
        for key in ("agreement_drop", "certificate", "lookahead", "recompute", "certificate_recompute"):
            if getattr(gate, key):
                return key
        if gate.learned is not None and any(f != "confidence" for f in gate.learned.features):
            return f"learned feature {next(f for f in gate.learned.features if f != 'confidence')}"
        return None

    @model_validator(mode="after")
    def _check_pilot(self) -> Contract:
        gate = self.gate
        by_pilot = procedure_of(self.procedure).orders_by_pilot
        if by_pilot and (gate is None or gate.pilot is None):
            raise _error(
                "procedure pilot_ordered orders the candidates by their risk on a pilot split; add gate.pilot "
                "(e.g. gate: {pilot: 0.25}) or use procedure fixed_sequence"
            )
        if by_pilot and self.order is not None:
            raise _error("order and procedure pilot_ordered both set the test order; remove one of them")
        if gate is not None and gate.is_empty:
            if gate.pilot is None:
                raise _error(
                    "gate lists no agreement_drop threshold and no certificate bound; remove `gate:` to certify "
                    "ungated candidates only"
                )
            if not by_pilot and not any(needs_pilot_scales(f) for p in self.policies for f in p.formats):
                raise _error(
                    "gate.pilot is used by nothing: list confidence, lookahead or learned quantiles, set "
                    "procedure: pilot_ordered or an fp8 cache.scale: pilot, or remove gate.pilot"
                )
        return self

    @field_validator("gate")
    @classmethod
    def _check_gate(cls, gate: Gate | None, info) -> Gate | None:
        policies = info.data.get("policies")  # absent when the policies themselves were invalid
        if gate is not None and gate.recompute is not None and policies is not None:
            if not any(_restartable(p) for p in policies):
                raise _error(
                    "gate.recompute restarts a generation that a decoding-time press is compressing or that a KV "
                    "format stores, and no policy entry does either; add one (e.g. compression_ratio_decoding, or "
                    "a cache:) or remove gate.recompute"
                )
        if gate is not None and gate.certificate_recompute is not None and policies is not None:
            if not any(_certifies(p) and _compresses_while_decoding(p) for p in policies):
                raise _error(
                    "gate.certificate_recompute restarts a generation on its decoding steps' certificates, which "
                    "only certkv's probabilistic_decoding press records, and no policy entry uses it; add one or "
                    "remove gate.certificate_recompute"
                )
        if gate is None or not gate.certificate or policies is None:
            return gate
        if not any(_certifies(p) for p in policies):
            raise _error(
                "certificate bounds need a policy entry whose press produces certificates (certkv's "
                "`probabilistic`); remove gate.certificate or add a probabilistic entry"
            )
        return gate

    @model_validator(mode="after")
    def _check_pilot_scales(self) -> Contract:
        """fp8 scales placed on the pilot need a pilot, drawn request by request."""
        placed = [f.name for p in self.policies for f in p.formats if needs_pilot_scales(f)]
        if placed and (self.gate is None or self.gate.pilot is None):
            raise _error(f"{placed[0]} places its fp8 scales on the pilot split; set gate.pilot (e.g. 0.25)")
        if placed and self.strata is not None:
            raise _error(f"{placed[0]} places its fp8 scales on one pilot of the whole mix, and strata draw a pilot per "
                         "stratum: give a numeric cache.scale, or remove strata")
        if placed and self.requests.group_by == "context":
            raise _error(f"{placed[0]} places its fp8 scales on requests of the pilot; contexts are drawn whole "
                         "under requests.group_by: context, which these scales do not support: give a numeric cache.scale")
        return self

    @model_validator(mode="after")
    def _check_order(self) -> Contract:
        if self.order is None:
            return self
        names = [name for sequence in entry_sequences(self.policy_entries()) for name in sequence]
        unknown = [n for n in self.order if n not in names]
        if unknown:
            raise _error(f"order names {unknown[0]!r}, which no policy entry defines; use names like {names[0]!r}")
        twice = sorted({n for n in self.order if self.order.count(n) > 1})
        if twice:
            raise _error(f"order lists {twice[0]!r} more than once; test each candidate once")
        missing = [n for n in names if n not in self.order]
        if missing:
            raise _error(f"order leaves out {missing[0]!r}; an interleaved order must list every candidate")
        return self

    # -- derived views -------------------------------------------------------------------------

    @property
    def cost_measure(self) -> str:
        """``kv_cost``, or its default: ``bytes`` when an entry stores its KV in a format, else
        ``peak`` when a policy compresses while decoding, else ``kv_retained`` (what every contract
        was ordered by before decoding-time presses)."""
        if self.kv_cost is not None:
            return self.kv_cost
        if any(p.cache is not None for p in self.policies):
            return "bytes"
        decoding = any(_compresses_while_decoding(p) for p in self.policies)
        return "peak" if decoding else "kv_retained"

    @property
    def endpoint(self) -> ModelEndpoint | None:
        """The full cache's endpoint (None: certkv loads `model` in-process)."""
        return self.model if isinstance(self.model, ModelEndpoint) else None

    @property
    def local_model(self) -> str:
        """The in-process model's name (embedded, a folder, a Hugging Face id); an endpoint contract has none."""
        if not isinstance(self.model, str):
            raise CertkvError(f"contract {self.name} calibrates endpoints; it loads no model in-process")
        return self.model

    @property
    def asks_logprobs(self) -> bool:
        """Whether endpoints are asked for log-probabilities (``protocol.logprobs`` unless false)."""
        return self.protocol.logprobs is not False

    @property
    def route(self) -> str:
        """An endpoint contract's route: ``chat`` unless ``protocol.route`` says ``completions``."""
        return self.protocol.route or "chat"

    @property
    def base_dir(self) -> Path:
        """The folder relative paths resolve against (the contract file's folder)."""
        return self._base_dir

    def with_base_dir(self, base_dir: str | Path) -> Contract:
        """Set the folder that relative paths resolve against; returns self."""
        self._base_dir = Path(base_dir)
        return self

    def canonical_json(self) -> str:
        """The validated contract as canonical JSON: sorted keys, compact separators, defaults filled in.

        One rule on top: an optional feature the contract does not use leaves no trace. The
        top-level blocks :data:`_LATER_KEYS` (``order``, ``strata``, ``coverage``, ``kv_cost``) are left out
        while unset, a policy entry's ``cache`` too, and so are the gate's features :data:`_LATER_GATE_KEYS` (the pilot and its
        gates while unset, ``lookahead_tokens`` at its default; :meth:`Gate.hashed_dump`). Every
        other key is always written, ``gate`` too (null when unset). So using a feature changes
        the hash, and a contract that uses none hashes the same whether or not certkv offers it;
        that is what keeps the demo contract's hash (and so its store's binding) stable.
        """
        data = self.model_dump(mode="json")
        for key in _LATER_KEYS:
            if data.get(key) is None:
                data.pop(key, None)
        for key in _LATER_REQUEST_KEYS:
            if data["requests"].get(key) is None:
                data["requests"].pop(key)
        for policy in data["policies"]:  # an entry without a KV format (or an endpoint) hashes as before them
            for key in ("cache", "endpoint", "memory"):
                if policy.get(key) is None:
                    policy.pop(key, None)
        for key, unset in (("route", (None,)), ("logprobs", (None, True))):  # logprobs: true is the default
            if data["protocol"].get(key) in unset:
                data["protocol"].pop(key, None)
        if self.gate is not None:
            data["gate"] = self.gate.hashed_dump(data["gate"])
        return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def sha256(self) -> str:
        """SHA-256 (hex) of :meth:`canonical_json`: comments, key order and formatting do not
        change it. Calibration stores, operating points and validation files are bound to it."""
        return hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()

    def policy_entries(self) -> list[PolicyEntry]:
        """The policy entries as the core names and orders them (:mod:`certkv.core.policy_names`):
        each with the gate settings it is tested under (ungated; each agreement_drop threshold;
        for a press that produces certificates each bound and each pair; then the pilot gates)."""
        gate = self.gate
        drops = gate.agreement_drop if gate is not None else []
        bounds = gate.certificate if gate is not None else []
        pilot = gate.pilot_choices() if gate is not None else []
        return [
            p.policy_entry(gate_choices(drops, bounds, pilot, certificates=_certifies(p), decoding=_restartable(p),
                                        formatted=p.cache is not None))
            for p in self.policies
        ]

    def resolved_store_path(self) -> Path:
        """The store folder: `store` relative to the contract's folder, default ``runs/<name>``."""
        return self._resolve(self.store or f"runs/{self.name}")

    def resolved_requests_path(self) -> Path | None:
        """The JSONL request file, or None for a builtin source."""
        return None if self.requests.is_builtin else self._resolve(self.requests.source)

    def check_requests_source(self) -> None:
        """Fail with one line when the request file is missing; called at calibration time, not at
        validation, so a contract for data the user has yet to download still validates."""
        path = self.resolved_requests_path()
        if path is not None and not path.is_file():
            raise CertkvError(
                f"requests.source: request file {path} does not exist (paths are relative to the "
                f"contract's folder {self._base_dir}); create it or fix the path"
            )

    def load_requests(self) -> list[Request]:
        """Load the contract's requests (JSONL or builtin) after checking the source exists; requests
        that share contexts are refused unless ``requests.group_by`` says how to certify them."""
        from certkv.requests.context_groups import check_grouping
        from certkv.requests.request_set import load_requests

        self.check_requests_source()
        path = self.resolved_requests_path()
        source = self.requests.source if path is None else str(path)
        length = self.requests.context_length
        requests = load_requests(source, self.requests.limit, self.requests.seed, None if length is None else str(length))
        check_grouping(requests, self.requests.group_by)
        return requests

    def _resolve(self, path: str) -> Path:
        p = Path(path).expanduser()
        return Path(os.path.normpath(p if p.is_absolute() else self._base_dir / p))
