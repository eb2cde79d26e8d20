"""The gate certification places and the runtime applies: :class:`GateSettings`.

A gated candidate sends a request to the full cache when a signal calibration recorded for its
base candidate is suspicious. What the contract says about a gate (the YAML grid of thresholds and
quantiles) is :class:`certkv.contract.schema.Gate`, and one setting of that grid is a
:class:`~certkv.core.candidates.GateChoice`; what certification decides, with every threshold
placed (fixed in the contract, or placed on the pilot split), is a :class:`GateSettings`; and the
runtime applies those very settings through their methods (:meth:`GateSettings.pre_decode_reason`,
:meth:`GateSettings.post_decode_reason`), so the records a gated candidate was certified on and
the requests the runtime sends to the full cache come from one comparison, :func:`fires`.

The runtime has to know three things about a gate:

- which signals it needs: the agreement drop (a recorder on the prefill), the lookahead masses
  (the probe over the full cache), the evicted answer's confidence (log-probabilities of its decode);
- whether it decides *before* the evicted decode (agreement drop, lookahead, a learned score without
  confidence features: the request is answered from the full cache it has just prefilled) or
  *after* it (certificate, confidence, a learned score with confidence features: the request
  escalates, its full answer is decoded again);
- its comparison: full cache when drop < t, lookahead mass > t or learned score > t; escalation
  when certificate > b, confidence < b or (post-decode) learned score > t.

New gate kinds (confidence, lookahead, learned) are never combined with each other or with the
agreement drop and the certificate (the contract refuses that), so a gate has one kind, or the
pair ``agreement_drop+certificate``. Torch-free: numpy and pydantic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, model_validator

from certkv.core.gate_features import POST_DECODE_FEATURES, LearnedGate, learned_score, needed_signals
from certkv.errors import CertkvError

#: The agreement gate's signal: the last W context queries' attention ...
AGREEMENT_WINDOW = 32
#: ... each query head's top-k keys of it ...
AGREEMENT_TOP_K = 32
#: ... and the first/last ⌊L / split⌋ layers whose mean agreements are compared.
AGREEMENT_SPLIT = 3

#: Answer tokens the lookahead probe feeds back after the question (A): A + 1 probe queries.
LOOKAHEAD_TOKENS = 2

#: Each gate part: the signal it reads and the side of its threshold that sends a request to the
#: full cache. Certification (:func:`certkv.core.gated.gated_mask`) and the runtime
#: (:meth:`GateSettings.pre_decode_reason`) both decide through :func:`fires`, so they cannot
#: compare differently.
GATE_PARTS = {
    "agreement_drop": ("agreement_drop", np.less),
    "certificate": ("certificate_max", np.greater),
    "confidence": ("confidence_min", np.less),
    "lookahead": ("lookahead_mass", np.greater),
    "learned": ("learned_score", np.greater),
}


def fires(part: str, value: npt.ArrayLike, threshold: float) -> np.bool_ | np.ndarray:
    """Whether gate `part` (a key of :data:`GATE_PARTS`) sends `value` (a signal, or an (R,)
    array of them) to the full cache at `threshold`: a bool, or an (R,) boolean array.

    Examples
    --------
    >>> bool(fires("agreement_drop", 0.05, 0.1)), bool(fires("certificate", 0.05, 0.1))
    (True, False)
    >>> fires("confidence", [0.9, 0.1], 0.2).tolist()
    [False, True]
    """
    return GATE_PARTS[part][1](value, float(threshold))


def answer_confidence(logprobs: Sequence[float]) -> tuple[float, float]:
    """(confidence_min, logprob_mean) of one answer from its per-token log-probabilities.

    ``confidence_min`` is ``exp(min log p)``, the lowest probability the model gave a token of its
    own answer; ``logprob_mean`` the mean log p. The definition calibration records (the engine's
    own copy lives with the signal recorders, outside the core).
    """
    values = [float(x) for x in logprobs]
    if not values:
        raise ValueError("an answer's confidence needs at least one token's log-probability")
    return math.exp(min(values)), math.fsum(values) / len(values)


class GateSettings(BaseModel):
    """A gated candidate's gate, thresholds placed; a request goes to the full cache when any set
    part fires:

    * ``agreement_drop``: its agreement drop < t (before the evicted decode);
    * ``certificate``: its survey-variance certificate > b (after the decode: escalation);
    * ``confidence``: the lowest token probability of the evicted answer < b (after the decode);
    * ``lookahead``: the full-cache attention mass the probe queries put on evicted entries > t
      (before the decode);
    * ``learned`` with ``learned_threshold``: its logistic score > t (before the decode, or after
      it when the model reads a confidence feature: :attr:`post_decode`).

    null: that part is off. ``quantile`` is the pre-registered pilot quantile a confidence,
    lookahead or learned threshold was placed at (null for fixed thresholds; while it is set and
    the threshold is null, the gate is not resolved yet: :mod:`certkv.core.pilot`). The agreement
    signal's settings and the probe's ``lookahead_tokens`` are those it was calibrated under.

    The same object is what the runtime applies: :meth:`pre_decode_reason` and
    :meth:`post_decode_reason`. ``GateSettings()`` (every part off) is the gate of an ungated
    point: it never fires.

    Examples
    --------
    >>> gate = GateSettings(agreement_drop=0.1)
    >>> gate.kind, gate.needs_agreement, gate.post_decode
    ('agreement_drop', True, False)
    >>> signals = {"agreement_drop": 0.02}
    >>> gate.pre_decode_reason(signals)
    'gate'
    >>> escalate = GateSettings(confidence=0.2)
    >>> escalate.post_decode_reason(signals, logprobs=[-0.1, -2.0]), round(signals["confidence_min"], 3)
    ('confidence', 0.135)
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

    # -- what it is ------------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        """``agreement_drop``, ``certificate``, ``agreement_drop+certificate``, ``confidence``,
        ``lookahead`` or ``learned``: the parts that are set ("" while a pilot gate is unresolved,
        and for the ungated ``GateSettings()``)."""
        parts = [k for k in ("agreement_drop", "certificate", "confidence", "lookahead") if getattr(self, k) is not None]
        if self.learned is not None:
            parts.append("learned")
        return "+".join(parts)

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
        return self.learned is not None and not self.post_decode

    @property
    def learned_post_decode(self) -> bool:
        """Whether the learned model (if any) scores after the evicted decode."""
        return self.learned is not None and self.post_decode

    # -- what the runtime measures -----------------------------------------------------------------

    @property
    def needs_agreement(self) -> bool:
        """The prefill must record the agreement drop (a drop threshold, or a learned feature)."""
        return self.agreement_drop is not None or (
            self.learned is not None and "agreement_drop" in needed_signals(self.learned.features)
        )

    @property
    def needs_lookahead(self) -> bool:
        """The lookahead probe must run (a lookahead threshold, or a learned feature)."""
        return self.lookahead is not None or (
            self.learned is not None and "lookahead_heads" in needed_signals(self.learned.features)
        )

    @property
    def needs_confidence(self) -> bool:
        """The evicted answer's confidence is read (a confidence bound, or a post-decode learned model)."""
        return self.confidence is not None or self.learned_post_decode

    @property
    def agreement(self) -> dict[str, Any]:
        """The agreement recorder's settings (window, top_k, split_divisor) the drop was calibrated under."""
        return {"window": self.agreement_window, "top_k": self.agreement_top_k, "split_divisor": self.agreement_split}

    def deployable(self) -> GateSettings:
        """These settings, after checking that the runtime can apply them: a pilot gate whose
        threshold is not placed yet is a one-line error (a learned model always has its threshold:
        the validator refuses one without)."""
        if not self.is_placed:
            raise CertkvError(
                f"the operating point's gate (pilot quantile {self.quantile}) has no threshold yet; "
                "deploy the operating point `certkv certify` writes, which places it on the pilot"
            )
        return self

    # -- what the runtime applies ------------------------------------------------------------------

    def learned_score(self, signals: Mapping) -> float | None:
        """The learned model's score of one request (:func:`certkv.core.gate_features.learned_score`,
        the definition certification uses), or None when the gate has no learned model."""
        if self.learned is None:
            return None
        return float(learned_score(self.learned, signals))

    def before_decode(self, signals: Mapping) -> str | None:
        """The reason to answer from the full cache before any evicted decode, or None.

        `signals` holds ``agreement_drop``, ``lookahead_mass``, ``learned_score`` (those computed).
        """
        learned = self.learned_threshold if self.learned is not None and not self.learned_post_decode else None
        return _first_firing(
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
        return _first_firing(
            signals,
            (
                ("certificate", self.certificate, "certificate"),
                ("confidence", self.confidence, "confidence"),
                ("learned", learned, "learned"),
            ),
        )

    def pre_decode_reason(self, signals: MutableMapping[str, Any]) -> str | None:
        """Score the learned model when it reads only pre-decode signals (into
        ``signals["learned_score"]``), then return why a pre-decode part sends the request to the
        full cache, or None.

        `signals` maps every signal name of :data:`certkv.core.signals.SIGNALS` to its value so far
        (None: not measured); the path that answers the request fills it, and its Decision is built
        from it once the answer is known."""
        if self.learned is not None and not self.learned_post_decode:
            signals["learned_score"] = self.learned_score(signals)
        return self.before_decode(signals)

    def post_decode_reason(
        self, signals: MutableMapping[str, Any], logprobs: Sequence[float] | None, certificate: float | None = None
    ) -> str | None:
        """Record the evicted answer's signals in `signals` (its confidence from the per-token log
        p, `logprobs`, None when not known; the certificate maximum; the learned score when the
        model reads them) and return why a post-decode part escalates, or None. The one step every
        runtime path shares."""
        signals["confidence_min"], signals["logprob_mean"] = (None, None) if logprobs is None else answer_confidence(logprobs)
        signals["certificate_max"] = certificate
        if self.learned is not None and self.learned_post_decode:
            signals["learned_score"] = self.learned_score(signals)
        return self.after_decode(signals)


def _first_firing(signals: Mapping, parts: Iterable[tuple[str, float | None, str]]) -> str | None:
    """The decision reason of the first (part, threshold, reason) whose part fires, through
    :func:`fires` (certification's own comparison); None when none does.

    A signal the gate needs but could not read (None or NaN) fires: certification refuses records
    without it, so nothing certified such a request, and the full cache answers it."""
    for part, threshold, reason in parts:
        if threshold is None:
            continue
        value = signals.get(GATE_PARTS[part][0])
        if value is None or value != value or fires(part, value, threshold):
            return reason
    return None


__all__ = [
    "AGREEMENT_SPLIT",
    "AGREEMENT_TOP_K",
    "AGREEMENT_WINDOW",
    "GATE_PARTS",
    "LOOKAHEAD_TOKENS",
    "GateSettings",
    "LearnedGate",
    "answer_confidence",
    "fires",
]
