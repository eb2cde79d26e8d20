"""What the certifier needs from a contract, and what deploying a candidate needs.

:class:`CertificationSpec` carries τ, ε, 1 − δ, the family-wise procedure and the candidate
sequences in their pre-registered test order; :class:`CandidateInfo` says how each candidate is
deployed (base policy, press kwargs, gate: a :class:`GateSettings` with fixed thresholds, or with
thresholds and a fitted :class:`~certkv.core.gate_features.LearnedGate` placed on the pilot split,
:class:`PilotConfig`).

A gate is three things: what the contract says (its validated ``gate:`` block, and per candidate
a :class:`~certkv.core.policy_names.GateChoice`); what certification decides, every threshold placed
(:class:`GateSettings`, a validated configuration and nothing more); and what the runtime does with
those settings (:mod:`certkv.runtime.gating`), which compares with
:func:`~certkv.core.gate_features.fires`, the function certification derives the gated rows with
(:mod:`certkv.core.gated`). The gate's thresholds are named once, :data:`GATE_THRESHOLDS`, and so is
the rule of which recorded signals a gate needs (:func:`gate_needs`), for a contract's gate block and
a candidate's settings alike. The agreement gate's signal settings and the lookahead probe's length
default here, once, for the contract, the certificate and the runtime alike. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from certkv.core.gate_features import POST_DECODE_FEATURES, LearnedGate, needed_signals
from certkv.core.policy_names import REFERENCE_POLICY, GateChoice
from certkv.core.procedures import Procedure
from certkv.core.signals import signal
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

def delta_of(confidence: float) -> float:
    """δ = 1 − confidence, the allowed probability that the certificate is wrong.

    Rounded to 12 decimals to strip the subtraction's float noise (1 − 0.95 is
    0.050000000000000044), so that levels read as written in the contract.

    Examples
    --------
    >>> delta_of(0.95), 1 - 0.95  # levels read as the contract wrote them
    (0.05, 0.050000000000000044)
    """
    return round(1.0 - confidence, 12)


#: The gate's thresholds, written once: each gate part (a key of
#: :data:`certkv.core.gate_features.GATE_PARTS`, the comparison certification and the runtime share)
#: and the :class:`GateSettings` field that holds its threshold. The order is :attr:`GateSettings.kind`'s.
GATE_THRESHOLDS: dict[str, str] = {
    "agreement_drop": "agreement_drop",
    "certificate": "certificate",
    "confidence": "confidence",
    "lookahead": "lookahead",
    "recompute": "recompute",
    "certificate_recompute": "certificate_recompute",
    "learned": "learned_threshold",
}

#: The gate parts whose signals need a recorder of their own (the agreement recorder in the
#: prefill, the lookahead probe after it); each is also the learned-gate feature group that reads
#: that recorder's signal (:data:`certkv.core.signals.FEATURE_GROUPS`).
RecordedPart = Literal["agreement_drop", "lookahead"]


def gate_needs(part: RecordedPart, thresholds: Collection[str], learned_groups: Collection[str]) -> bool:
    """Whether a gate needs `part`'s recorder: the rule calibration (what a contract's gate block
    records) and the runtime (what a candidate's gate measures) share. It does when `thresholds`
    (the gate parts with a threshold, or threshold values, set) holds `part`, or its learned model
    reads `part`'s feature group (`learned_groups`, the feature groups of its model; empty without one).

    Examples
    --------
    >>> gate_needs("lookahead", ["lookahead"], []), gate_needs("agreement_drop", ["lookahead"], ["agreement_drop"])
    (True, True)
    >>> gate_needs("agreement_drop", ["confidence"], ["lookahead", "confidence"])
    False
    """
    return part in thresholds or part in learned_groups


class GateSettings(BaseModel):
    """A gated candidate's gate, thresholds placed (:data:`GATE_THRESHOLDS`); a request goes to
    the full cache when any set part fires:

    * ``agreement_drop``: its agreement drop < t (before the evicted decode);
    * ``certificate``: its survey-variance certificate > b (after the decode: escalation);
    * ``confidence``: the lowest token probability of the evicted answer < b (after the decode);
    * ``lookahead``: the full-cache attention mass the probe queries put on evicted entries > t
      (before the decode);
    * ``learned`` with ``learned_threshold``: its logistic score > t (before the decode, or after
      it when the model reads a confidence feature: :attr:`post_decode`);
    * ``recompute``: while the evicted answer decodes, its first token whose probability is < r
      makes the runtime restart on the full cache from the tokens before it;
    * ``certificate_recompute``: the same restart at the first token whose decoding step's
      survey-variance certificate is > b (certkv's probabilistic decoding press).

    null: that part is off. ``quantile`` is the pre-registered pilot quantile a confidence,
    lookahead or learned threshold was placed at (null for fixed thresholds; while it is set and
    the threshold is null, the gate is not resolved yet: :mod:`certkv.core.pilot`). The agreement
    signal's settings and the probe's ``lookahead_tokens`` are those it was calibrated under.

    A validated configuration: certification derives its gated rows from it
    (:mod:`certkv.core.gated`) and the runtime applies it (:mod:`certkv.runtime.gating`).
    ``GateSettings()`` (every part off) is the gate of an ungated point: it never fires.

    Examples
    --------
    >>> gate = GateSettings(agreement_drop=0.1)
    >>> gate.kind, gate.needs_agreement, gate.post_decode, gate.thresholds()
    ('agreement_drop', True, False, {'agreement_drop': 0.1})
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
    recompute: float | None = None
    certificate_recompute: float | None = None
    quantile: float | None = None
    lookahead_tokens: int = Field(default=LOOKAHEAD_TOKENS, ge=1)

    @model_validator(mode="after")
    def _ranges(self) -> GateSettings:
        checks = (
            ("confidence", self.confidence, 0.0, 1.0, "a token probability"),
            ("recompute", self.recompute, 0.0, 1.0, "a token probability"),
            ("lookahead", self.lookahead, 0.0, 1.0, "an attention mass"),
            ("learned_threshold", self.learned_threshold, 0.0, 1.0, "a logistic score"),
        )
        for name, value, low, high, what in checks:
            if value is not None and not (low <= value <= high):
                raise ValueError(f"{name} {value!r} is outside [{low:g}, {high:g}]; it is {what}")
        if self.certificate_recompute is not None and not 0.0 <= self.certificate_recompute < math.inf:
            raise ValueError(f"certificate_recompute {self.certificate_recompute!r} is not a finite bound ≥ 0; "
                             "it is a certificate (a standard deviation)")
        if self.quantile is not None and not 0.0 < self.quantile < 1.0:
            raise ValueError(f"quantile {self.quantile!r} is outside (0, 1)")
        if (self.learned is None) != (self.learned_threshold is None):
            raise ValueError("a learned gate needs both its model (learned) and its threshold (learned_threshold)")
        return self

    # -- what it is ------------------------------------------------------------------------------

    def thresholds(self) -> dict[str, float]:
        """Each set part (a key of :data:`GATE_THRESHOLDS`) and its threshold, in
        :data:`GATE_THRESHOLDS` order.

        Examples
        --------
        >>> GateSettings(certificate=0.5, agreement_drop=-0.1).thresholds()
        {'agreement_drop': -0.1, 'certificate': 0.5}
        """
        return {part: float(value) for part, field in GATE_THRESHOLDS.items() if (value := getattr(self, field)) is not None}

    @property
    def kind(self) -> str:
        """``agreement_drop``, ``certificate``, ``agreement_drop+certificate``, ``confidence``,
        ``lookahead``, ``recompute``, ``certificate_recompute`` or ``learned``: the parts that are
        set ("" while a pilot gate is unresolved, and for the ungated ``GateSettings()``)."""
        return "+".join(self.thresholds())

    @property
    def is_placed(self) -> bool:
        """Whether a pilot gate's threshold is placed (always true for a fixed-threshold gate)."""
        return self.quantile is None or bool(self.kind)

    @property
    def post_decode(self) -> bool:
        """Whether the gate can only decide after the evicted decode: a confidence or certificate
        bound, or a learned model that reads a confidence feature. Such a gate escalates: the full
        answer is computed again from the full cache."""
        if self.confidence is not None or self.certificate is not None:
            return True
        return self.learned is not None and any(f in POST_DECODE_FEATURES for f in self.learned.features)

    @property
    def pre_decode(self) -> bool:
        """Whether some part of the gate decides before the evicted decode (agreement drop,
        lookahead, a learned model without confidence features)."""
        if self.agreement_drop is not None or self.lookahead is not None:
            return True
        return self.learned_pre_decode

    @property
    def restarts(self) -> bool:
        """Whether a part restarts a generation mid-decode (``recompute``, ``certificate_recompute``),
        which only a decoding-time press's path can do.

        Examples
        --------
        >>> GateSettings(certificate_recompute=0.02).restarts, GateSettings(confidence=0.2).restarts
        (True, False)
        """
        return self.recompute is not None or self.certificate_recompute is not None

    @property
    def learned_post_decode(self) -> bool:
        """Whether the gate has a learned model that scores after the evicted decode."""
        return self.learned is not None and self.post_decode

    @property
    def learned_pre_decode(self) -> bool:
        """Whether the gate has a learned model that scores before the evicted decode."""
        return self.learned is not None and not self.post_decode

    # -- what it needs recorded (:func:`gate_needs`) -----------------------------------------------

    @property
    def learned_groups(self) -> list[str]:
        """The feature groups its learned model reads (empty without one)."""
        if self.learned is None:
            return []
        return list(dict.fromkeys(str(signal(key).feature_group) for key in needed_signals(self.learned.features)))

    @property
    def needs_agreement(self) -> bool:
        """The prefill must record the agreement drop (a drop threshold, or a learned feature)."""
        return gate_needs("agreement_drop", self.thresholds(), self.learned_groups)

    @property
    def needs_lookahead(self) -> bool:
        """The lookahead probe must run (a lookahead threshold, or a learned feature)."""
        return gate_needs("lookahead", self.thresholds(), self.learned_groups)


class PilotConfig(BaseModel):
    """The pilot split: ``share`` of the calibration requests, drawn by ``seed``
    (:func:`certkv.core.pilot.draw_pilot`), fits the gates and never certifies.

    Examples
    --------
    >>> PilotConfig(share=0.25).seed  # the pilot split's default seed
    0
    """

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

    Examples
    --------
    >>> StrataConfig(by="metadata.language").simultaneous
    False
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


class GroupingConfig(BaseModel):
    """Certify over context groups: the calibration requests that share a context (the loss
    table's ``group`` column) are one sampling unit, the context (:mod:`certkv.core.grouped`).

    ``measure`` is the risk the guarantee bounds:

    * ``per_context``: the mean over contexts of the share of that context's questions violated
      (each context counts once, however many questions it has);
    * ``per_question``: the share of all questions violated when contexts are drawn as in
      calibration (each question counts once: E[k_g] / E[n_g]);
    * ``any_question``: the share of contexts with at least one violated question.

    ``bound`` is how the two mean measures are tested: ``betting`` (the default; a
    variance-adaptive betting test, about as tight as the per-request binomial when a context's
    questions are nearly independent) or ``hoeffding_bentkus`` (which assumes the worst variance:
    never tighter than the binomial over contexts, conservative otherwise). ``any_question`` is
    always the exact binomial over contexts: its ``bound`` is not read.

    Examples
    --------
    >>> GroupingConfig().measure, GroupingConfig().bound
    ('per_context', 'betting')
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    measure: Literal["per_context", "per_question", "any_question"] = "per_context"
    bound: Literal["hoeffding_bentkus", "betting"] = "betting"


class CandidateInfo(BaseModel):
    """What deploying a candidate needs beyond its press and retention: the ungated base policy,
    the press's kwargs and the gate (null for an ungated candidate). ``pilot_gate`` is the
    contract's setting of a gate whose threshold the pilot places (a :class:`GateChoice` with its
    ``pilot_kind``, ``quantile`` and learned ``features``; :mod:`certkv.core.pilot` fills ``gate``
    from it).

    Examples
    --------
    >>> info = CandidateInfo(base_policy="snapkv@0.50", gate=GateSettings(agreement_drop=0.1))
    >>> info.base_policy, info.gate.agreement_drop, info.pilot_gate is None
    ('snapkv@0.50', 0.1, True)
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    base_policy: str
    press_kwargs: dict[str, Any] = Field(default_factory=dict)
    gate: GateSettings | None = None
    pilot_gate: GateChoice | None = None
    kv_format: dict[str, Any] | None = None
    engine_setting: str | None = None

    @field_validator("pilot_gate")
    @classmethod
    def _pilot_gate_has_a_kind(cls, value: GateChoice | None) -> GateChoice | None:
        if value is not None and value.pilot_kind is None:
            raise ValueError("pilot_gate needs pilot_kind (confidence, lookahead, learned, recompute or "
                             "certificate_recompute) and its quantile")
        return value


class CertificationSpec(BaseModel):
    """What the certifier needs from a contract: τ, ε, 1 − δ, the procedure and the sequences.

    ``sequences`` lists policy names in test order, conservative first; the order is part of the
    pre-registration and must not be chosen after looking at calibration data. ``candidate_info``
    (optional, filled from a contract) says how to deploy each candidate; a gated candidate listed
    there is derived from its base's records when the table lacks it (:mod:`certkv.core.gated`).

    Examples
    --------
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.05, confidence=0.95, sequences=[["snapkv@0.70", "snapkv@0.30"]])
    >>> spec.procedure, spec.delta
    ('fixed_sequence', 0.05)
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
    grouping: GroupingConfig | None = Field(
        default=None, description="certify over context groups (requests.group_by: context); null: requests are the unit"
    )
    independent_requests: bool = Field(
        default=False,
        description="requests that share a context are certified as independent (requests.group_by: request)",
    )
    utility: str | None = Field(
        default=None, description="the contract's utility, recorded so that live answers are scored as calibration scored them"
    )
    kv_cost: Literal["kv_retained", "peak", "time", "bytes"] = Field(
        default="kv_retained",
        description="what the table's memory column measures (the contract's kv_cost): the nominal share, a "
        "generation's peak or KV-time relative to the full cache's (certkv.core.kv_cost), or its peak bytes "
        "relative to a 16-bit full cache's",
    )
    context_margin: float = Field(
        default=0.0,
        ge=0.0,
        allow_inf_nan=False,
        description="relative widening of the calibrated context-length range the runtime serves (coverage.context_margin)",
    )

    @model_validator(mode="after")
    def _one_sampling_unit(self) -> CertificationSpec:
        if self.grouping is not None and self.independent_requests:
            raise ValueError(
                "grouping and independent_requests exclude each other; requests.group_by is either context or request"
            )
        return self

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
    "GATE_THRESHOLDS",
    "LOOKAHEAD_TOKENS",
    "CandidateInfo",
    "CertificationSpec",
    "GateChoice",
    "GateSettings",
    "GroupingConfig",
    "LearnedGate",
    "PilotConfig",
    "StrataConfig",
    "delta_of",
    "gate_needs",
]
