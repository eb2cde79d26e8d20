"""The runtime's reading of an operating point's gate: which signals to compute, when to decide.

A gate (:class:`~certkv.core.spec.GateSettings`) sends a request to the full cache on a signal
calibration recorded for its base candidate. The runtime has to know three things about it:

- which signals it needs: the agreement drop (a recorder on the prefill), the lookahead masses
  (the probe over the full cache), the evicted answer's confidence (log-probabilities of its decode);
- whether it decides *before* the evicted decode (agreement drop, lookahead, a learned score without
  confidence features: the request is answered from the full cache it has just prefilled) or
  *after* it (certificate, confidence, a learned score with confidence features: the request
  escalates, its full answer is decoded again);
- its comparison, the one :mod:`certkv.core.gated` derives the gated candidate's records with, so
  that the runtime sends exactly the requests to the full cache that the certified records did:
  full cache when drop < t, lookahead mass > t or learned score > t; escalation when
  certificate > b, confidence < b or (post-decode) learned score > t.

New gate kinds (confidence, lookahead, learned) are never combined with each other or with the
agreement drop and the certificate (the contract refuses that), so a gate has one kind, or the
pair ``agreement_drop+certificate``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from certkv.core.gate_features import is_post_decode, needed_signals
from certkv.core.gate_features import learned_score as score
from certkv.core.gated import GATE_PARTS, fires
from certkv.core.spec import LOOKAHEAD_TOKENS, LearnedGate
from certkv.errors import CertkvError
from certkv.signals.confidence import answer_confidence

if TYPE_CHECKING:
    from certkv.core.spec import GateSettings


@dataclass(frozen=True)
class RuntimeGate:
    """What the runtime needs of a gate; built by :func:`runtime_gate`.

    Thresholds are None when that part of the gate is off. ``learned`` is the fitted
    :class:`~certkv.core.spec.LearnedGate` (features, standardisation, coefficients).
    """

    kind: str | None
    agreement_drop: float | None = None
    certificate: float | None = None
    confidence: float | None = None
    lookahead: float | None = None
    learned: LearnedGate | None = None
    learned_threshold: float | None = None
    learned_post_decode: bool = False
    needs_agreement: bool = False
    needs_lookahead: bool = False
    lookahead_tokens: int = LOOKAHEAD_TOKENS
    agreement: Mapping | None = None
    """The recorder's settings (window, top_k, split_divisor) the drop was calibrated under."""

    @property
    def needs_confidence(self) -> bool:
        return self.confidence is not None or self.learned_post_decode

    def before_decode(self, signals: Mapping) -> str | None:
        """The reason to answer from the full cache before any evicted decode, or None.

        `signals` holds ``agreement_drop``, ``lookahead_mass``, ``learned_score`` (those computed).
        """
        learned = self.learned_threshold if self.learned is not None and not self.learned_post_decode else None
        return self._first_firing(
            signals,
            (
                ("agreement_drop", self.agreement_drop, "gate"),
                ("lookahead", self.lookahead, "lookahead"),
                ("learned", learned, "learned"),
            ),
        )

    def after_decode(self, signals: Mapping) -> str | None:
        """The reason to escalate an evicted answer to the full cache, or None.

        `signals` holds ``certificate_max``, ``confidence_min`` and ``learned_score`` (those computed).
        """
        learned = self.learned_threshold if self.learned is not None and self.learned_post_decode else None
        return self._first_firing(
            signals,
            (
                ("certificate", self.certificate, "certificate"),
                ("confidence", self.confidence, "confidence"),
                ("learned", learned, "learned"),
            ),
        )

    @staticmethod
    def _first_firing(signals: Mapping, parts: Iterable[tuple[str, float | None, str]]) -> str | None:
        """The decision reason of the first (part, threshold, reason) whose part fires, through
        :func:`certkv.core.gated.fires` (certification's own comparison); None when none does.

        A signal the gate needs but could not read (None or NaN) fires: certification refuses
        records without it, so nothing certified such a request, and the full cache answers it."""
        for part, threshold, reason in parts:
            if threshold is None:
                continue
            value = signals.get(GATE_PARTS[part][0])
            if value is None or value != value or fires(part, value, threshold):
                return reason
        return None


def gate_kind(settings: GateSettings | None) -> str | None:
    """The gate's kind (:attr:`~certkv.core.spec.GateSettings.kind`: ``agreement_drop``,
    ``certificate``, ``agreement_drop+certificate``, ``confidence``, ``lookahead``, ``learned``);
    None without a gate or while a pilot gate has no threshold yet."""
    return (settings.kind or None) if settings is not None else None


def runtime_gate(settings: GateSettings | None) -> RuntimeGate:
    """The :class:`RuntimeGate` of an operating point's GateSettings (None: an ungated point)."""
    if settings is None:
        return RuntimeGate(kind=None)
    learned = settings.learned
    if settings.quantile is not None and not settings.kind:
        raise CertkvError(
            f"the operating point's gate (pilot quantile {settings.quantile}) has no threshold yet; "
            "deploy the operating point `certkv certify` writes, which places it on the pilot"
        )
    if learned is not None and settings.learned_threshold is None:
        raise CertkvError("the operating point's learned gate has no learned_threshold; certify the contract again")
    read = needed_signals(learned.features) if learned is not None else []  # the learned model's signals
    return RuntimeGate(
        kind=gate_kind(settings),
        agreement_drop=settings.agreement_drop,
        certificate=settings.certificate,
        confidence=settings.confidence,
        lookahead=settings.lookahead,
        learned=learned,
        learned_threshold=settings.learned_threshold,
        learned_post_decode=learned is not None and is_post_decode(settings),
        needs_agreement=settings.agreement_drop is not None or "agreement_drop" in read,
        needs_lookahead=settings.lookahead is not None or "lookahead_heads" in read,
        lookahead_tokens=settings.lookahead_tokens,
        agreement={
            "window": settings.agreement_window,
            "top_k": settings.agreement_top_k,
            "split_divisor": settings.agreement_split,
        },
    )


def learned_score(gate: RuntimeGate, signals: Mapping) -> float | None:
    """The learned gate's score of one request (:func:`certkv.core.gate_features.learned_score`,
    the definition certification uses), or None when the gate has no learned model."""
    if gate.learned is None:
        return None
    return float(score(gate.learned, signals))


def pre_decode_reason(gate: RuntimeGate, signals: MutableMapping[str, Any]) -> str | None:
    """Score the learned gate when it reads only pre-decode signals (into ``signals["learned_score"]``),
    then return why a pre-decode gate sends the request to the full cache, or None.

    `signals` maps every signal name of :data:`certkv.core.signals.SIGNALS` to its value so far
    (None: not measured); the path that answers the request fills it, and its Decision is built
    from it once the answer is known."""
    if gate.learned is not None and not gate.learned_post_decode:
        signals["learned_score"] = learned_score(gate, signals)
    return gate.before_decode(signals)


def post_decode_reason(
    gate: RuntimeGate, signals: MutableMapping[str, Any], logprobs: Sequence[float] | None, certificate: float | None = None
) -> str | None:
    """Record the evicted answer's signals in `signals` (its confidence from the per-token log p,
    `logprobs`, None when not known; the certificate maximum; the learned score when the model
    reads them) and return why a post-decode gate escalates, or None. The one step every runtime
    path shares."""
    signals["confidence_min"], signals["logprob_mean"] = (None, None) if logprobs is None else answer_confidence(logprobs)
    signals["certificate_max"] = certificate
    if gate.learned is not None and gate.learned_post_decode:
        signals["learned_score"] = learned_score(gate, signals)
    return gate.after_decode(signals)
