"""What the certifier needs from a contract, and what deploying a candidate needs.

:class:`CertificationSpec` carries τ, ε, 1 − δ, the family-wise procedure and the candidate
sequences in their pre-registered test order; :class:`CandidateInfo` says how each candidate is
deployed (base policy, press kwargs, gate: a :class:`~certkv.core.gate.GateSettings` with fixed
thresholds, or with thresholds and a fitted :class:`~certkv.core.gate_features.LearnedGate`
placed on the pilot split, :class:`PilotConfig`). Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from certkv.core.candidates import GateChoice
from certkv.core.gate import AGREEMENT_SPLIT, AGREEMENT_TOP_K, AGREEMENT_WINDOW, LOOKAHEAD_TOKENS, GateSettings
from certkv.core.gate_features import LearnedGate
from certkv.core.policy_names import REFERENCE_POLICY
from certkv.core.procedures import Procedure
from certkv.errors import CertkvError, format_validation_error

#: The decode length a contract certifies unless it sets ``protocol.max_new_tokens``.
DEFAULT_MAX_NEW_TOKENS = 8

def delta_of(confidence: float) -> float:
    """δ = 1 − confidence, the allowed probability that the certificate is wrong.

    Rounded to 12 decimals to strip the subtraction's float noise (1 − 0.95 is
    0.050000000000000044), so that levels read as written in the contract.
    """
    return round(1.0 - confidence, 12)


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
    the press's kwargs and the gate (null for an ungated candidate). ``pilot_gate`` is the
    contract's setting of a gate whose threshold the pilot places (a :class:`GateChoice` with its
    ``pilot_kind``, ``quantile`` and learned ``features``; :mod:`certkv.core.pilot` fills ``gate``
    from it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    base_policy: str
    press_kwargs: dict[str, Any] = Field(default_factory=dict)
    gate: GateSettings | None = None
    pilot_gate: GateChoice | None = None


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
    "GateChoice",
    "GateSettings",
    "LearnedGate",
    "PilotConfig",
    "StrataConfig",
    "delta_of",
]
