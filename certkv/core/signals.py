"""The gate signals: one declaration each, the one place a signal is named.

A gate signal is a number (or a per-head list of numbers) measured while a request is answered,
that a gate compares with a threshold or a learned gate scores. Calibration records it in the
store, certification reads it from the loss table to derive gated candidates, and the runtime
measures it again for each live request. Everything those three need to know about a signal is
declared here, in :data:`SIGNALS`, and derived from it:

* the loss table's optional columns, how they are parsed, validated, cut, padded and hashed
  (:mod:`certkv.core.loss_table`);
* the calibration store's columns (signals with ``store="column"``; the others travel in the
  row's ``extra`` JSON);
* the signal dict the runtime's gate reads (:mod:`certkv.runtime.certified_runtime`); the
  ``Decision`` record (:mod:`certkv.runtime.decision`) writes one field per signal out by hand, and
  tests/signals/test_signals.py holds them to these declarations;
* the learned gate's feature groups and features (:mod:`certkv.core.gate_features`);
* request-level signals computed from the encoded request alone (``compute``), which calibration
  and the runtime evaluate with :func:`request_signals`.

Adding a signal is one :class:`Signal` here, its ``Decision`` field, and its recorder, the code
that measures it: for a signal of the encoded request, the ``compute`` function; for one that
needs the model, a module of :mod:`certkv.signals` or the engine or runtime step that fills it
(``recorder`` names it).

Torch-free.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

#: A learned-gate feature's transform of its signal: the value itself, its log (a length), or
#: the log-odds of each per-head mass (:func:`certkv.core.gate_features.feature_matrix`).
Transform = Literal["identity", "log", "log_odds"]


@dataclass(frozen=True)
class Signal:
    """One gate signal.

    Parameters
    ----------
    name : str
        The key everywhere: loss-table column, store column or ``extra`` key, Decision field,
        runtime signal dict.
    per : {"request", "candidate"}
        ``request``: one value per request, the same on every row of it (shape (R,) in a loss
        table); ``candidate``: one per (candidate, request), shape (P, R).
    kind : {"scalar", "heads"}
        A float, or a list of F floats, one per (layer, KV head), layer-major (shape (P, R, F)).
    phase : {"pre_decode", "post_decode"}
        When the runtime has it: while the full cache still exists (a gate on it decides before
        the evicted decode), or only after the evicted answer is decoded (a gate escalates).
    recorder : str
        What measures it, in words (the engine step, the gate module).
    doc : str
        What it is, one line (the Decision field's documentation).
    store : {"column", "extra", None}
        Where calibration stores it: a column of its own, the row's ``extra`` JSON, or not at all
        (a runtime-only value, such as the learned score, derived from recorded signals).
    minimum : float, optional
        Values below it are an input error in a loss table, with `minimum_why` saying why.
    feature_group, transform : optional
        The learned-gate feature group that reads it, and the transform of its value.
    hash_group : {"joint", "own"}
        How :func:`certkv.core.loss_table.records_sha256` folds it in (part of the records hash's
        definition, fixed for a file format version): the ``joint`` signals as one block whenever
        any of them has a value; an ``own`` signal on its own, only when it has one, so a table
        that lacks it hashes as if the signal did not exist. The joint ones are also always in a
        loss table, NaN where no row has them; an own one is absent (None) then.
    compute : str, optional
        ``module:function`` of ``f(context_ids, question_ids) -> number``: a request signal of the
        encoded request alone, evaluated by :func:`request_signals` in calibration and the runtime.

    Examples
    --------
    >>> from certkv.core.signals import signal
    >>> drop = signal("agreement_drop")
    >>> drop.per, drop.kind, drop.phase
    ('request', 'scalar', 'pre_decode')
    """

    name: str
    per: Literal["request", "candidate"]
    kind: Literal["scalar", "heads"]
    phase: Literal["pre_decode", "post_decode"]
    recorder: str
    doc: str
    store: Literal["column", "extra"] | None = "extra"
    minimum: float | None = None
    minimum_why: str = ""
    feature_group: str | None = None
    transform: Transform = "identity"
    hash_group: Literal["joint", "own"] = "own"
    compute: str | None = None

    @property
    def always_present(self) -> bool:
        """Whether a loss table holds it even when no row has it (NaN): the joint-hash signals."""
        return self.hash_group == "joint"

    @property
    def recorded(self) -> bool:
        """Whether calibration records it (a loss-table column), as opposed to a runtime-only value."""
        return self.store is not None

    def feature_names(self, n_heads: int | None = None) -> list[str]:
        """The learned-gate features this signal provides, in order (per head for ``heads``)."""
        if self.kind == "heads":
            return [f"{self.feature_group}[{i}]" for i in range(int(n_heads or 0))]
        return [self.feature_name]

    @property
    def feature_name(self) -> str:
        """The feature's name of a scalar signal: the signal's, or ``log_<name>`` when it enters as its log."""
        return f"log_{self.name}" if self.transform == "log" else self.name


# One declaration per signal, kept in this compact layout (tests/signals/test_signals.py inserts one in it).
# fmt: off
SIGNALS: tuple[Signal, ...] = (
    Signal("agreement_drop", per="request", kind="scalar", phase="pre_decode",
           recorder="the agreement recorder on the full prefill (certkv.signals.agreement)",
           doc="PAGE's agreement drop between early and late layers' attention (low: suspect request)",
           store="column", feature_group="agreement_drop", hash_group="joint"),
    Signal("certificate_max", per="candidate", kind="scalar", phase="post_decode",
           recorder="the probabilistic press's decode (certkv.engine.probabilistic_decode)",
           doc="largest survey-variance certificate over the evicted answer's decoding steps",
           store="column", minimum=0.0, minimum_why="a certificate is a standard deviation (≥ 0)",
           hash_group="joint"),
    Signal("confidence_min", per="candidate", kind="scalar", phase="post_decode",
           recorder="the answer's own token log-probabilities (certkv.core.gate_features.answer_confidence)",
           doc="lowest probability of a token of the evicted greedy answer (stop token included)",
           feature_group="confidence"),
    Signal("confidence_min_agreeing", per="candidate", kind="scalar", phase="post_decode",
           recorder="the answer's token log-probabilities against the full-KV answer (certkv.engine.engine)",
           doc="lowest token probability up to the answer's first departure from the full-KV answer"),
    Signal("certificate_max_agreeing", per="candidate", kind="scalar", phase="post_decode",
           recorder="the probabilistic decoding press's per-step certificates against the full-KV answer "
                    "(certkv.engine.engine)",
           doc="largest step certificate up to the answer's first departure from the full-KV answer",
           minimum=0.0, minimum_why="a certificate is a standard deviation (≥ 0)"),
    Signal("logprob_mean", per="candidate", kind="scalar", phase="post_decode",
           recorder="the answer's own token log-probabilities (certkv.core.gate_features.answer_confidence)",
           doc="mean log-probability of the evicted answer's tokens", feature_group="confidence"),
    Signal("lookahead_mass", per="candidate", kind="scalar", phase="pre_decode",
           recorder="the lookahead probe on the full cache (certkv.signals.lookahead)",
           doc="max over (layer, KV head) of lookahead_heads"),
    Signal("lookahead_heads", per="candidate", kind="heads", phase="pre_decode",
           recorder="the lookahead probe on the full cache (certkv.signals.lookahead)",
           doc="per (layer, KV head), layer-major: the probe's full-cache attention mass on evicted entries",
           feature_group="lookahead", transform="log_odds"),
    Signal("context_tokens", per="request", kind="scalar", phase="pre_decode",
           recorder="the encoded request", doc="tokens of the encoded context",
           feature_group="context_length", transform="log", compute="certkv.core.signals:context_length"),
    Signal("learned_score", per="candidate", kind="scalar", phase="pre_decode",
           recorder="the learned gate's model over the other signals (certkv.core.gate_features)",
           doc="the learned gate's score (its phase is that of the features it reads)", store=None),
)
# fmt: on

BY_NAME: dict[str, Signal] = {s.name: s for s in SIGNALS}
#: Signals a loss table and the store carry, in declaration order.
RECORDED: tuple[Signal, ...] = tuple(s for s in SIGNALS if s.recorded)
#: Store columns of their own (the others go into ``extra``).
STORE_COLUMNS: tuple[str, ...] = tuple(s.name for s in SIGNALS if s.store == "column")
#: Learned-gate feature groups a contract may list under ``gate.learned.features``, in expansion
#: order, with their signals. The order is the fitted models' coefficient order: it is fixed.
FEATURE_GROUPS: tuple[str, ...] = ("lookahead", "confidence", "agreement_drop", "context_length")
#: Groups declared by signals but missing from the fixed order go at its end, in declaration order.
FEATURE_GROUPS = FEATURE_GROUPS + tuple(
    dict.fromkeys(s.feature_group for s in SIGNALS if s.feature_group is not None and s.feature_group not in FEATURE_GROUPS)
)


def signal(name: str) -> Signal:
    """The declaration of `name` (KeyError for an undeclared name: a programming error).

    Examples
    --------
    >>> signal("confidence_min").phase  # measured on the candidate's own answer
    'post_decode'
    """
    return BY_NAME[name]


def group_signals(group: str) -> list[Signal]:
    """The signals of learned-gate feature group `group`, in declaration order.

    Examples
    --------
    >>> [s.name for s in group_signals("confidence")]
    ['confidence_min', 'logprob_mean']
    """
    return [s for s in SIGNALS if s.feature_group == group]


def feature_signal(feature: str) -> Signal:
    """The signal an expanded learned-gate feature reads (``lookahead[3]`` → lookahead_heads).

    Examples
    --------
    >>> feature_signal("lookahead[3]").name, feature_signal("log_context_tokens").name
    ('lookahead_heads', 'context_tokens')
    """
    if feature.endswith("]") and "[" in feature:
        group = feature[: feature.index("[")]
        heads = [s for s in group_signals(group) if s.kind == "heads"]
        if heads:
            return heads[0]
    for s in SIGNALS:
        if s.kind == "scalar" and s.feature_group is not None and s.feature_name == feature:
            return s
    raise KeyError(feature)


def empty_signals() -> dict[str, Any]:
    """Every signal the runtime's gate may read, not measured yet (None).

    Examples
    --------
    >>> signals = empty_signals()
    >>> signals["agreement_drop"] is None, "context_tokens" in signals
    (True, True)
    """
    return {s.name: None for s in SIGNALS}


def _compute_function(spec: str) -> Callable[[Sequence[int], Sequence[int]], float]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def request_signals(context_ids: Sequence[int], question_ids: Sequence[int]) -> dict[str, float]:
    """Every request signal computed from the encoded request alone (a ``compute`` function).

    Examples
    --------
    >>> request_signals(context_ids=[11, 12, 13, 14], question_ids=[21, 22])
    {'context_tokens': 4}
    """
    return {s.name: _compute_function(s.compute)(context_ids, question_ids) for s in SIGNALS if s.compute is not None}


def context_length(context_ids: Sequence[int], question_ids: Sequence[int]) -> int:
    """``context_tokens``: the context's length in tokens (what the coverage envelope counts).

    Examples
    --------
    >>> context_length([11, 12, 13], [21])  # the question's tokens do not count
    3
    """
    return len(context_ids)


__all__ = [
    "BY_NAME",
    "FEATURE_GROUPS",
    "RECORDED",
    "SIGNALS",
    "STORE_COLUMNS",
    "Signal",
    "context_length",
    "empty_signals",
    "feature_signal",
    "group_signals",
    "request_signals",
    "signal",
]
