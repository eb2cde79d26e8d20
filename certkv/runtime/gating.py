"""What the runtime does with an operating point's gate (:class:`certkv.core.spec.GateSettings`).

Certification derives a gated candidate's rows from its settings (:mod:`certkv.core.gated`); the
runtime applies the same settings to one request at a time, here: the pre-decode parts decide
while the full cache still exists (:func:`pre_decode_reason`), the post-decode parts once the
evicted answer is decoded (:func:`post_decode_reason`). Both compare through
:func:`certkv.core.gate_features.fires` and score a learned model with
:func:`certkv.core.gate_features.learned_score`, the functions certification derives the rows
with, so the two cannot compare differently. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from certkv.core.gate_features import GATE_PARTS, answer_confidence, fires, learned_score
from certkv.core.spec import GATE_THRESHOLDS, GateSettings
from certkv.errors import CertkvError

#: Each gate part's decision reason, when it sends a request to the full cache, in the order the
#: parts are asked: before the evicted decode, then after it (the restarting parts decide mid-decode).
_PRE_DECODE = (("agreement_drop", "gate"), ("lookahead", "lookahead"), ("learned", "learned"))
_POST_DECODE = (("certificate", "certificate"), ("confidence", "confidence"), ("learned", "learned"))


def deployable(gate: GateSettings) -> GateSettings:
    """`gate`, after checking that the runtime can apply it: a pilot gate whose threshold is not
    placed yet is a one-line error (a learned model always has its threshold: the settings'
    validator refuses one without).

    Examples
    --------
    >>> deployable(GateSettings(quantile=0.1))
    Traceback (most recent call last):
    ...
    certkv.errors.CertkvError: the operating point's gate (pilot quantile 0.1) has no threshold yet; ...
    """
    if not gate.is_placed:
        raise CertkvError(
            f"the operating point's gate (pilot quantile {gate.quantile}) has no threshold yet; "
            "deploy the operating point `certkv certify` writes, which places it on the pilot"
        )
    return gate


def agreement_settings(gate: GateSettings) -> dict[str, Any]:
    """The agreement recorder's settings (window, top_k, split_divisor) `gate`'s drop was calibrated under."""
    return {"window": gate.agreement_window, "top_k": gate.agreement_top_k, "split_divisor": gate.agreement_split}


def _score(gate: GateSettings, signals: Mapping) -> float | None:
    """The learned model's score of one request (:func:`certkv.core.gate_features.learned_score`,
    the definition certification uses), or None when `gate` has no learned model."""
    if gate.learned is None:
        return None
    return float(learned_score(gate.learned, signals))


def before_decode(gate: GateSettings, signals: Mapping) -> str | None:
    """The reason to answer from the full cache before any evicted decode, or None.

    `signals` holds ``agreement_drop``, ``lookahead_mass``, ``learned_score`` (those computed).

    Examples
    --------
    >>> before_decode(GateSettings(agreement_drop=0.1), {"agreement_drop": 0.02})
    'gate'
    """
    return _first_firing(gate, signals, _PRE_DECODE, learned=gate.learned_pre_decode)


def after_decode(gate: GateSettings, signals: Mapping) -> str | None:
    """The reason to escalate an evicted answer to the full cache, or None.

    `signals` holds ``certificate_max``, ``confidence_min`` and ``learned_score`` (those computed).
    """
    return _first_firing(gate, signals, _POST_DECODE, learned=gate.learned_post_decode)


def pre_decode_reason(gate: GateSettings, signals: MutableMapping[str, Any]) -> str | None:
    """Score the learned model when it reads only pre-decode signals (into
    ``signals["learned_score"]``), then return why a pre-decode part sends the request to the
    full cache, or None.

    `signals` maps every signal name of :data:`certkv.core.signals.SIGNALS` to its value so far
    (None: not measured); the path that answers the request fills it, and its Decision is built
    from it once the answer is known."""
    if gate.learned_pre_decode:
        signals["learned_score"] = _score(gate, signals)
    return before_decode(gate, signals)


def post_decode_reason(
    gate: GateSettings, signals: MutableMapping[str, Any], logprobs: Sequence[float] | None, certificate: float | None = None
) -> str | None:
    """Record the evicted answer's signals in `signals` (its confidence from the per-token log
    p, `logprobs`, None when not known; the certificate maximum; the learned score when the
    model reads them) and return why a post-decode part escalates, or None. The one step every
    runtime path shares.

    Examples
    --------
    >>> signals = {}
    >>> post_decode_reason(GateSettings(confidence=0.2), signals, [-0.1, -2.0]), round(signals["confidence_min"], 3)
    ('confidence', 0.135)
    """
    signals["confidence_min"], signals["logprob_mean"] = (None, None) if logprobs is None else answer_confidence(logprobs)
    signals["certificate_max"] = certificate
    if gate.learned_post_decode:
        signals["learned_score"] = _score(gate, signals)
    return after_decode(gate, signals)


def _first_firing(gate: GateSettings, signals: Mapping, parts: Iterable[tuple[str, str]], *, learned: bool) -> str | None:
    """The decision reason of the first (part, reason) of `parts` whose part is set in `gate` and
    fires, through :func:`fires` (certification's own comparison); None when none does. The learned
    part counts only when `learned` (its model scores at this point of the answer).

    A signal the gate needs but could not read (None or NaN) fires: certification refuses records
    without it, so nothing certified such a request, and the full cache answers it."""
    for part, reason in parts:
        threshold = getattr(gate, GATE_THRESHOLDS[part])
        if threshold is None or (part == "learned" and not learned):
            continue
        value = signals.get(GATE_PARTS[part][0])
        if value is None or value != value or fires(part, value, threshold):
            return reason
    return None


__all__ = [
    "after_decode",
    "agreement_settings",
    "before_decode",
    "deployable",
    "post_decode_reason",
    "pre_decode_reason",
]
