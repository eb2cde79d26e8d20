"""What the certifier needs from a contract, and what deploying a candidate needs.

:class:`CertificationSpec` carries τ, ε, 1 − δ, the family-wise procedure and the candidate
sequences in their pre-registered test order; :class:`CandidateInfo` and :class:`GateSettings`
say how each candidate is deployed (base policy, press kwargs, gate: fixed thresholds, or
thresholds and a fitted :class:`LearnedGate` placed on the pilot split, :class:`PilotConfig`). The
agreement gate's signal settings and the lookahead probe's length default here, once, for the
contract, the certificate and the runtime alike.
Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from certkv.core.policy_names import REFERENCE_POLICY
from certkv.core.procedures import Procedure
from certkv.errors import CertkvError, format_validation_error

#: The decode length a contract certifies unless it sets ``protocol.max_new_tokens``.
DEFAULT_MAX_NEW_TOKENS = 8

#: The agreement gate's signal: the last W context queries' attention ...
AGREEMENT_WINDOW = 32
#: ... each query head's top-k keys of it ...
AGREEMENT_TOP_K = 32
#: ... and the first/last ⌊L / split⌋ layers whose mean agreements are compared.
AGREEMENT_SPLIT = 3

#: Answer tokens the lookahead probe feeds back after the question (A): A + 1 probe queries.
LOOKAHEAD_TOKENS = 2

#: Gate kinds whose thresholds are placed on a pilot split, at pre-registered quantiles.
PilotGateKind = Literal["confidence", "lookahead", "learned"]


def delta_of(confidence: float) -> float:
    """δ = 1 − confidence, the allowed probability that the certificate is wrong.

    Rounded to 12 decimals to strip the subtraction's float noise (1 − 0.95 is
    0.050000000000000044), so that levels read as written in the contract.
    """
    return round(1.0 - confidence, 12)


class LearnedGate(BaseModel):
    """A fitted logistic-regression gate (scikit-learn ``LogisticRegression`` on
    ``StandardScaler``-ed features, fit on the pilot rows of one base candidate, label loss > τ).

    ``features`` are expanded names (:func:`certkv.core.gate_features.expand_features`:
    ``lookahead[0]`` .. ``lookahead[F-1]``, ``confidence_min``, ``logprob_mean``,
    ``agreement_drop``, ``log_context_tokens``); ``mean``/``scale`` the scaler's, ``coef`` and
    ``intercept`` the model's, so that the score is
    ``1 / (1 + exp(-(intercept + Σ coef_i (x_i − mean_i) / scale_i)))``
    (:func:`certkv.core.gate_features.learned_score`), on any machine, without scikit-learn.
    A pilot with one class only gives the constant model (coef 0), which gates nothing.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    features: list[str] = Field(min_length=1)
    mean: list[float]
    scale: list[float]
    coef: list[float]
    intercept: float

    @model_validator(mode="after")
    def _same_lengths(self) -> LearnedGate:
        n = len(self.features)
        if not len(self.mean) == len(self.scale) == len(self.coef) == n:
            raise ValueError(
                f"learned gate: features, mean, scale and coef must have one value per feature ({n}), "
                f"got {len(self.mean)}, {len(self.scale)}, {len(self.coef)}"
            )
        if any(not math.isfinite(x) or x <= 0 for x in self.scale):
            raise ValueError("learned gate: every scale must be a positive finite number")
        return self


class GateSettings(BaseModel):
    """A gated candidate's runtime gate; a request goes to the full cache when any set part fires:

    * ``agreement_drop``: its agreement drop < t (before the evicted decode);
    * ``certificate``: its survey-variance certificate > b (after the decode: escalation);
    * ``confidence``: the lowest token probability of the evicted answer < b (after the decode);
    * ``lookahead``: the full-cache attention mass the probe queries put on evicted entries > t
      (before the decode);
    * ``learned`` with ``learned_threshold``: its logistic score > t (before the decode, or after
      it when the model reads a confidence feature: :func:`certkv.core.gate_features.is_post_decode`).

    null: that part is off. ``quantile`` is the pre-registered pilot quantile a confidence,
    lookahead or learned threshold was placed at (null for fixed thresholds; while it is set and
    the threshold is null, the gate is not resolved yet: :mod:`certkv.core.pilot`). The agreement
    signal's settings and the probe's ``lookahead_tokens`` are those it was calibrated under.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    agreement_drop: float | None = None
    certificate: float | None = None
    agreement_window: int = AGREEMENT_WINDOW
    agreement_top_k: int = AGREEMENT_TOP_K
    agreement_split: int = AGREEMENT_SPLIT
    confidence: float | None = None
    lookahead: float | None = None
    learned: LearnedGate | None = None
    learned_threshold: float | None = None
    quantile: float | None = None
    lookahead_tokens: int = Field(default=LOOKAHEAD_TOKENS, ge=1)

    @model_validator(mode="after")
    def _ranges(self) -> GateSettings:
        checks = (
            ("confidence", self.confidence, 0.0, 1.0, "a token probability"),
            ("lookahead", self.lookahead, 0.0, 1.0, "an attention mass"),
            ("learned_threshold", self.learned_threshold, 0.0, 1.0, "a logistic score"),
        )
        for name, value, low, high, what in checks:
            if value is not None and not (low <= value <= high):
                raise ValueError(f"{name} {value!r} is outside [{low:g}, {high:g}]; it is {what}")
        if self.quantile is not None and not 0.0 < self.quantile < 1.0:
            raise ValueError(f"quantile {self.quantile!r} is outside (0, 1)")
        if (self.learned is None) != (self.learned_threshold is None):
            raise ValueError("a learned gate needs both its model (learned) and its threshold (learned_threshold)")
        return self

    @property
    def kind(self) -> str:
        """``agreement_drop``, ``certificate``, ``agreement_drop+certificate``, ``confidence``,
        ``lookahead`` or ``learned``: the parts that are set ("" while a pilot gate is unresolved)."""
        parts = [k for k in ("agreement_drop", "certificate", "confidence", "lookahead") if getattr(self, k) is not None]
        if self.learned is not None:
            parts.append("learned")
        return "+".join(parts)


class PilotGate(BaseModel):
    """A gate whose threshold the pilot places: ``kind`` at the pre-registered ``quantile``
    (the share of pilot requests with the most suspicious signal it sends to the full cache);
    ``features`` are the learned gate's feature groups (contract names: lookahead, confidence,
    agreement_drop, context_length)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: PilotGateKind
    quantile: float = Field(gt=0.0, lt=1.0)
    features: tuple[str, ...] = ()


class PilotConfig(BaseModel):
    """The pilot split: ``share`` of the calibration requests, drawn by ``seed``
    (:func:`certkv.core.pilot.draw_pilot`), fits the gates and never certifies."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    share: float = Field(gt=0.0, lt=1.0)
    seed: int = 0
    min_certification: int = Field(default=100, ge=1)
    """Fewest certification requests the pilot may leave; a preview of an unfinished store, which
    carries no guarantee, lowers it to 1 (:func:`certkv.calibration.certification.preview_spec`)."""


class StrataConfig(BaseModel):
    """Certify each stratum of the calibration requests on its own (:mod:`certkv.core.strata`).

    ``by`` names the request field whose values are the strata: ``task``, or ``metadata.<key>``
    for a key of the requests' ``metadata`` (a loss table's ``stratum`` column holds the values).
    ``simultaneous``: every stratum is certified at δ/S, so that all S guarantees hold together
    with probability ≥ 1 − δ; otherwise each stratum is certified at δ (a guarantee per stratum).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    by: str = Field(default="task", min_length=1)
    simultaneous: bool = False

    @field_validator("by")
    @classmethod
    def _check_by(cls, value: str) -> str:
        if value != "task" and not (value.startswith("metadata.") and value[len("metadata.") :].strip()):
            raise ValueError(f"strata.by {value!r} must be 'task' or 'metadata.<key>' (a key of the requests' metadata)")
        return value


class CandidateInfo(BaseModel):
    """What deploying a candidate needs beyond its press and retention: the ungated base policy,
    the press's kwargs and the gate (null for an ungated candidate). ``pilot_gate`` marks a gate
    whose threshold the pilot places (:mod:`certkv.core.pilot` fills ``gate`` from it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    base_policy: str
    press_kwargs: dict[str, Any] = Field(default_factory=dict)
    gate: GateSettings | None = None
    pilot_gate: PilotGate | None = None


class CertificationSpec(BaseModel):
    """What the certifier needs from a contract: τ, ε, 1 − δ, the procedure and the sequences.

    ``sequences`` lists policy names in test order, conservative first; the order is part of the
    pre-registration and must not be chosen after looking at calibration data. ``candidate_info``
    (optional, filled from a contract) says how to deploy each candidate; a gated candidate listed
    there is derived from its base's records when the table lacks it (:mod:`certkv.core.gated`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tolerance: float = Field(ge=0.0, allow_inf_nan=False, description="τ: allowed utility loss")
    risk: float = Field(gt=0.0, lt=1.0, description="ε: allowed share of violating requests")
    confidence: float = Field(gt=0.0, lt=1.0, description="1 − δ")
    procedure: Procedure = "fixed_sequence"
    sequences: list[list[str]] = Field(min_length=1)
    candidate_info: dict[str, CandidateInfo] = Field(default_factory=dict)
    max_new_tokens: int | None = Field(default=None, ge=1, description="the contract's decode length")
    query_aware: bool = Field(default=False, description="the question was prefilled with the context (protocol.query_aware)")
    pilot: PilotConfig | None = Field(default=None, description="the pilot split (gate.pilot of a contract)")
    strata: StrataConfig | None = Field(default=None, description="certify each stratum on its own (strata:)")
    utility: str | None = Field(
        default=None, description="the contract's utility, recorded so that live answers are scored as calibration scored them"
    )
    context_margin: float = Field(
        default=0.0,
        ge=0.0,
        allow_inf_nan=False,
        description="relative widening of the calibrated context-length range the runtime serves (coverage.context_margin)",
    )

    @field_validator("sequences")
    @classmethod
    def _check_sequences(cls, sequences: list[list[str]]) -> list[list[str]]:
        seen: dict[str, tuple[int, int]] = {}
        for s, sequence in enumerate(sequences):
            if not sequence:
                raise ValueError(f"sequence {s} is empty; list its candidates or remove it")
            for j, name in enumerate(sequence):
                if not name.strip():
                    raise ValueError(f"sequence {s} position {j}: empty policy name")
                if name == REFERENCE_POLICY:
                    raise ValueError(f"sequence {s} position {j}: 'full' is the reference, not a candidate")
                if name in seen:
                    raise ValueError(
                        f"policy {name!r} appears twice (sequence {seen[name][0]} and {s}); test each candidate once"
                    )
                seen[name] = (s, j)
        return sequences

    @property
    def delta(self) -> float:
        """δ = 1 − confidence (:func:`delta_of`)."""
        return delta_of(self.confidence)

    @property
    def candidates(self) -> list[str]:
        """All candidates, sequences concatenated in contract order."""
        return [name for sequence in self.sequences for name in sequence]

    @property
    def lengths(self) -> list[int]:
        return [len(sequence) for sequence in self.sequences]

    @classmethod
    def parse(cls, data: CertificationSpec | Mapping[str, Any], source: str = "certification spec") -> CertificationSpec:
        """Validate a dict, turning pydantic's error into a one-line CertkvError."""
        if isinstance(data, cls):
            return data
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise CertkvError(format_validation_error(exc, source)) from None


__all__ = [
    "AGREEMENT_SPLIT",
    "AGREEMENT_TOP_K",
    "AGREEMENT_WINDOW",
    "DEFAULT_MAX_NEW_TOKENS",
    "LOOKAHEAD_TOKENS",
    "CandidateInfo",
    "CertificationSpec",
    "GateSettings",
    "LearnedGate",
    "PilotConfig",
    "PilotGate",
    "PilotGateKind",
    "StrataConfig",
    "delta_of",
]
