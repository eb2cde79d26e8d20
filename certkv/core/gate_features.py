"""The gate's comparisons, features and learned score: the one definition certification and the runtime share.

Certification derives a gated candidate's rows with :func:`fires` (a signal against its
threshold) and the runtime decides with the same function; certification computes the learned
score of every (pilot or certification) request of a base candidate from the loss table's signal
arrays, and the runtime for one request from the signals it measured. Both go through
:func:`feature_matrix`, so the two cannot drift apart.

Feature groups (the contract's ``gate.learned.features``) are declared with their signals in
:mod:`certkv.core.signals` and expand into named features:

* ``lookahead`` → ``lookahead[0]`` .. ``lookahead[F-1]``: the per-(layer, KV head) evicted
  attention mass m of the lookahead probe, layer-major (index = layer · H_kv + head), entered as
  its log-odds log(m / (1 − m)) with m clipped to [1e-6, 1 − 1e-6]. A mass is a share that
  piles up near 0 and 1; on the log-odds scale a linear score separates the heads' regimes (on
  the demo store the held-out AUC for SnapKV@0.5 rises from 0.82 to 0.85);
* ``confidence`` → ``confidence_min`` and ``logprob_mean`` of the candidate's own greedy answer;
* ``agreement_drop`` → ``agreement_drop``;
* ``context_length`` → ``log_context_tokens``: log of the request's context length in tokens.

A gate that reads ``confidence_min`` or ``logprob_mean`` can only decide after the evicted
decode (:attr:`certkv.core.spec.GateSettings.post_decode`); the others decide while the full cache still exists.

Torch-free: numpy and pydantic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, model_validator

from certkv.core.signals import FEATURE_GROUPS, SIGNALS, Signal, feature_signal, group_signals
from certkv.errors import CertkvError

#: The groups a learned gate reads unless the contract lists its own.
DEFAULT_FEATURES = ("lookahead", "confidence", "context_length")
#: Expanded features that exist only after the evicted decode (their signal's phase).
POST_DECODE_FEATURES = frozenset(
    s.feature_name for s in SIGNALS if s.feature_group is not None and s.kind == "scalar" and s.phase == "post_decode"
)


#: Each gate part: the signal it reads and the side of its threshold that sends a request to the
#: full cache. Certification (:func:`certkv.core.gated.gated_mask`) and the runtime
#: (:func:`certkv.runtime.gating.pre_decode_reason`) both decide through :func:`fires`, so they cannot
#: compare differently.
GATE_PARTS = {
    "agreement_drop": ("agreement_drop", np.less),
    "certificate": ("certificate_max", np.greater),
    "confidence": ("confidence_min", np.less),
    "recompute": ("confidence_min", np.less),
    "certificate_recompute": ("certificate_max", np.greater),
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
    own answer; ``logprob_mean`` the mean log p. The lowest token probability predicts that an
    evicted cache broke the request far better than cache-side signals do, and needs nothing but
    the log p every decode path returns (``logit_tok − logsumexp(logits)`` in float64, the stop
    token included). Plain python and in the core, so calibration (the engine records it),
    certification and the runtime's gate read the one definition.

    Examples
    --------
    >>> import math
    >>> low, mean = answer_confidence([math.log(0.9), math.log(0.5)])
    >>> round(low, 3), round(mean, 3)
    (0.5, -0.399)
    """
    values = [float(x) for x in logprobs]
    if not values:
        raise ValueError("an answer's confidence needs at least one token's log-probability")
    return math.exp(min(values)), math.fsum(values) / len(values)


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

    References
    ----------
    .. [1] F. Pedregosa et al., "Scikit-learn: Machine Learning in Python", JMLR 12, 2011
           (``LogisticRegression`` and ``StandardScaler``, which fit the model this stores).

    Examples
    --------
    >>> gate = LearnedGate(features=["confidence_min"], mean=[0.5], scale=[0.25], coef=[-2.0], intercept=0.0)
    >>> round(learned_score(gate, {"confidence_min": 0.5}), 3)  # at the mean, the intercept alone
    0.5
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


def expand_features(groups: Sequence[str], n_heads: int | None = None) -> list[str]:
    """Expanded feature names of `groups`, in :data:`FEATURE_GROUPS` order.

    `n_heads` (F = layers × KV heads) is needed when ``lookahead`` is among the groups.

    Examples
    --------
    >>> expand_features(["confidence", "lookahead"], n_heads=2)  # FEATURE_GROUPS order, not the given one
    ['lookahead[0]', 'lookahead[1]', 'confidence_min', 'logprob_mean']
    >>> expand_features(["context_length"])
    ['log_context_tokens']
    """
    unknown = [g for g in groups if g not in FEATURE_GROUPS]
    if unknown:
        raise CertkvError(f"unknown learned-gate feature {unknown[0]!r}; use {', '.join(FEATURE_GROUPS)}")
    names: list[str] = []
    for group in FEATURE_GROUPS:
        if group not in groups:
            continue
        for s in group_signals(group):
            if s.kind == "heads" and not n_heads:
                raise CertkvError(f"the {group} feature needs the per-head {group} masses ({s.name})")
            names += s.feature_names(n_heads)
    return names


def needed_signals(features: Sequence[str]) -> list[str]:
    """The signal keys (lookahead_heads, confidence_min, ...) that expanded `features` read.

    Examples
    --------
    >>> needed_signals(["lookahead[0]", "confidence_min", "log_context_tokens"])
    ['lookahead_heads', 'confidence_min', 'context_tokens']
    """
    keys = []
    for name in features:
        key = _signal_of(name).name
        if key not in keys:
            keys.append(key)
    return keys


def feature_matrix(signals: Mapping, features: Sequence[str]) -> np.ndarray:
    """Features of N requests as an (N, len(features)) float64 matrix.

    `signals` maps ``lookahead_heads`` to an (N, F) array, and ``confidence_min``,
    ``logprob_mean``, ``agreement_drop``, ``context_tokens`` to (N,) arrays (only the keys the
    features read are needed). A missing key, a NaN value or a context length below 1 is an
    error: a gate must never score a signal it did not observe.

    Examples
    --------
    >>> signals = {"confidence_min": np.array([0.9, 0.2]), "context_tokens": np.array([100, 1000])}
    >>> feature_matrix(signals, ["confidence_min", "log_context_tokens"]).round(3)
    array([[0.9  , 4.605],
           [0.2  , 6.908]])
    """
    columns = []
    n = None
    for name in features:
        s = _signal_of(name)
        if s.kind == "heads":
            heads = _signal(signals, s.name, 2)
            index = int(name[name.index("[") + 1 : -1])
            if index >= heads.shape[1]:
                raise CertkvError(
                    f"the learned gate reads {name} but the signals hold {heads.shape[1]} {s.feature_group} heads; "
                    "the model was fit on another architecture"
                )
            column = _log_odds(heads[:, index])
        elif s.transform == "log":
            values = _signal(signals, s.name, 1)
            if (values < 1).any():
                raise CertkvError(f"{s.name} must be ≥ 1, got {float(values.min())!r}")
            column = np.log(values)
        else:
            column = _signal(signals, s.name, 1)
        if n is not None and column.shape[0] != n:
            raise CertkvError(f"signal {name} has {column.shape[0]} values, the others {n}")
        n = column.shape[0]
        columns.append(column)
    if not columns:
        raise CertkvError("a learned gate needs at least one feature")
    return np.stack(columns, axis=1)


def _signal_of(feature: str) -> Signal:
    """The signal an expanded feature reads; an unknown feature is a one-line error."""
    try:
        return feature_signal(feature)
    except KeyError:
        raise CertkvError(f"unknown learned-gate feature {feature!r}") from None


#: Masses are clipped to [MASS_CLIP, 1 − MASS_CLIP] before their log-odds are taken.
MASS_CLIP = 1e-6


def _log_odds(mass: np.ndarray) -> np.ndarray:
    clipped = np.clip(mass, MASS_CLIP, 1.0 - MASS_CLIP)
    return np.log(clipped) - np.log1p(-clipped)


def _signal(signals: Mapping, key: str, ndim: int) -> np.ndarray:
    value = signals.get(key)
    if value is None:
        raise CertkvError(f"the learned gate needs the signal {key!r}, which was not recorded")
    array = np.asarray(value, dtype=float)
    if array.ndim != ndim:
        raise CertkvError(f"signal {key!r} must have {ndim} dimension(s) here, got shape {array.shape}")
    if np.isnan(array).any():
        raise CertkvError(f"signal {key!r} has missing (NaN) values; the learned gate cannot score them")
    return array


def feature_vector(signals: Mapping, features: Sequence[str]) -> np.ndarray:
    """Features of one request, (len(features),): `signals` holds one request's values
    (``lookahead_heads`` a list of F floats, the others scalars); see :func:`feature_matrix`.

    Examples
    --------
    >>> feature_vector({"confidence_min": 0.5, "logprob_mean": -0.3}, ["confidence_min", "logprob_mean"])
    array([ 0.5, -0.3])
    """
    one = {}
    for key, value in signals.items():
        if value is None:
            continue
        one[key] = np.asarray(value, dtype=float)[None, ...]
    return feature_matrix(one, features)[0]


def learned_scores(model: LearnedGate, x: np.ndarray) -> np.ndarray:
    """Logistic scores (N,) of the feature matrix `x` (N, len(model.features)) under `model`:
    ``1 / (1 + exp(-(intercept + Σ coef_i (x_i − mean_i) / scale_i)))``, as scikit-learn's
    ``predict_proba(...)[:, 1]`` of the fitted pipeline.

    Examples
    --------
    >>> gate = LearnedGate(features=["confidence_min"], mean=[0.5], scale=[0.25], coef=[-2.0], intercept=0.0)
    >>> learned_scores(gate, np.array([[0.5], [0.0], [1.0]])).round(3)  # low confidence scores high
    array([0.5  , 0.982, 0.018])
    """
    z = ((np.asarray(x, dtype=float) - np.asarray(model.mean)) / np.asarray(model.scale)) @ np.asarray(model.coef)
    z = z + model.intercept
    # exp of a large |z| overflows to inf, which divides to the right limit 0 or 1.
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-z))


def learned_score(model: LearnedGate, signals: Mapping) -> float:
    """The learned gate's score of one request from its signals dict (the runtime's call).

    Examples
    --------
    >>> gate = LearnedGate(features=["confidence_min"], mean=[0.5], scale=[0.25], coef=[-2.0], intercept=0.0)
    >>> round(learned_score(gate, {"confidence_min": 0.25}), 3)
    0.881
    """
    return float(learned_scores(model, feature_vector(signals, model.features)[None, :])[0])


__all__ = [
    "DEFAULT_FEATURES",
    "GATE_PARTS",
    "FEATURE_GROUPS",
    "LearnedGate",
    "answer_confidence",
    "POST_DECODE_FEATURES",
    "expand_features",
    "feature_matrix",
    "feature_vector",
    "fires",
    "learned_score",
    "learned_scores",
    "needed_signals",
]
