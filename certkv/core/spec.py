"""What the certifier needs from a contract, and what deploying a candidate needs.

:class:`CertificationSpec` carries τ, ε, 1 − δ, the family-wise procedure and the candidate
sequences in their pre-registered test order; :class:`CandidateInfo` and :class:`GateSettings`
say how each candidate is deployed (base policy, press kwargs, gate). The agreement gate's signal
settings default here, once, for the contract, the certificate and the runtime alike.
Torch-free.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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


def delta_of(confidence: float) -> float:
    """δ = 1 − confidence, the allowed probability that the certificate is wrong.

    Rounded to 12 decimals to strip the subtraction's float noise (1 − 0.95 is
    0.050000000000000044), so that levels read as written in the contract.
    """
    return round(1.0 - confidence, 12)


class GateSettings(BaseModel):
    """A gated candidate's runtime gate: full cache when the agreement drop < ``agreement_drop``
    or the certificate > ``certificate`` (null: that part is off), with the agreement signal's
    settings (window, top-k, layer split) it was calibrated under."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    agreement_drop: float | None = None
    certificate: float | None = None
    agreement_window: int = AGREEMENT_WINDOW
    agreement_top_k: int = AGREEMENT_TOP_K
    agreement_split: int = AGREEMENT_SPLIT


class CandidateInfo(BaseModel):
    """What deploying a candidate needs beyond its press and retention: the ungated base policy,
    the press's kwargs and the gate (null for an ungated candidate)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    base_policy: str
    press_kwargs: dict[str, Any] = Field(default_factory=dict)
    gate: GateSettings | None = None


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
                    raise ValueError(
                        f"sequence {s} position {j}: 'full' is the reference, not a candidate"
                    )
                if name in seen:
                    raise ValueError(
                        f"policy {name!r} appears twice (sequence {seen[name][0]} and {s}); "
                        "test each candidate once"
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
    def parse(cls, data, source: str = "certification spec") -> CertificationSpec:
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
    "CandidateInfo",
    "CertificationSpec",
    "GateSettings",
    "delta_of",
]
