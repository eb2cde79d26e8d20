"""The runtime's decision record: how one request was answered, and the signals it was decided on.

:class:`Decision` has a module of its own so that the answering paths
(:mod:`certkv.runtime.pipeline`, :mod:`certkv.runtime.single_prefill`) can name it: its public home,
:mod:`certkv.runtime.certified_runtime`, imports them and re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class Decision:
    """How one request was answered, and the signals it was decided on (None: not computed).

    It is written out field by field so that a type checker sees every field. The gate signals
    have one field each, named, typed and ordered as their declarations in
    :data:`certkv.core.signals.SIGNALS` (a float, or a list of floats for a per-head signal); a
    test holds the two together, so a new signal needs its field here. The field order is the
    order of :meth:`to_dict`, hence of the JSON that ``certkv serve`` answers and stores.

    Attributes
    ----------
    mode : str
        ``"evicted"`` (the press's cache answered) or ``"full"``.
    reason : str or None
        Why the full cache answered: ``fallback``, ``uncovered`` (outside the coverage envelope),
        ``precondition``, ``gate`` (agreement drop), ``lookahead``, ``learned``, ``confidence``,
        ``certificate``, or ``monitor`` (certkv serve); None when the press answered.
    policy : str
        The operating point's policy.
    stratum : str or None
        The stratum the request named.
    gate_kind : str or None
        The operating point's gate (:attr:`certkv.core.spec.GateSettings.kind`).
    gate_threshold, certificate_bound : float or None
        The gate's threshold and the certificate bound the runtime applied.
    agreement_drop ... learned_score : float, list of float, or None
        The gate signals, one field each in declaration order (``lookahead_heads`` per head);
        each field's comment is its declaration's ``doc``.
    escalated : bool
        The evicted answer was decoded, then replaced by the full cache's.
    kv_retained, kv_retained_actual : float
        Nominal and realised retention of the cache that answered (1.0 for the full cache).
    detail : str or None
        A one-line explanation (a precondition's failure, for example).
    """

    mode: str
    reason: str | None
    policy: str
    stratum: str | None = None
    gate_kind: str | None = None
    gate_threshold: float | None = None
    certificate_bound: float | None = None
    # The gate signals (certkv.core.signals.SIGNALS), in declaration order.
    #: PAGE's agreement drop between early and late layers' attention (low: suspect request).
    agreement_drop: float | None = None
    #: Largest survey-variance certificate over the evicted answer's decoding steps.
    certificate_max: float | None = None
    #: Lowest probability of a token of the evicted greedy answer (stop token included).
    confidence_min: float | None = None
    #: Lowest token probability up to the answer's first departure from the full-KV answer.
    confidence_min_agreeing: float | None = None
    #: Largest step certificate up to the answer's first departure from the full-KV answer.
    certificate_max_agreeing: float | None = None
    #: Mean log-probability of the evicted answer's tokens.
    logprob_mean: float | None = None
    #: Max over (layer, KV head) of lookahead_heads.
    lookahead_mass: float | None = None
    #: Per (layer, KV head), layer-major: the probe's full-cache attention mass on evicted entries.
    lookahead_heads: list[float] | None = None
    #: Tokens of the encoded context.
    context_tokens: float | None = None
    #: The learned gate's score (its phase is that of the features it reads).
    learned_score: float | None = None
    # The answer's outcome.
    escalated: bool = False
    #: The decoding step a recompute gate restarted the answer on the full cache at (None: it did not).
    recomputed_at: int | None = None
    kv_retained: float = 1.0
    kv_retained_actual: float = 1.0
    detail: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record as a dict in field order (lists copied): ``dataclasses.asdict`` without its
        deep copy, which costs a live server more than the rest of its response."""
        return {name: _copied(getattr(self, name)) for name in _FIELD_NAMES}


#: The fields in order, computed once (to_dict runs for every answer a server sends).
_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Decision))


def _copied(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value
