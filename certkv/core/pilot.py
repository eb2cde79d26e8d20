"""The pilot split: a share of the calibration requests that places gate thresholds and never certifies.

A gate threshold chosen by looking at the very requests that then certify it would be tuned on the
evidence, and the binomial guarantee would no longer hold. A contract with ``gate.pilot: p``
therefore splits its requests in two before any loss is read:

* the **pilot** (the share p): it fits each base candidate's learned gate (scikit-learn's
  ``LogisticRegression`` on ``StandardScaler``-ed features, labels loss > τ), places every
  confidence, lookahead and learned threshold at its pre-registered quantile of the pilot's
  signal, and, under ``procedure: pilot_ordered``, orders every candidate into one sequence by its
  pilot violation rate;
* the **certification** requests (the rest): the gated rows are derived on them with the
  thresholds the pilot fixed, and only they count in n, the violations, the per-task breakdown
  and the mean KV.

The draw (:func:`draw_pilot`) ranks the request ids by ``sha256(f"{seed}:{request_id}")`` and takes
the first ``round(p · R)``: it depends on the ids and the contract's seed only, never on a loss or
a signal, so the pilot is independent of the certification requests' outcomes given the ids, and
every command (certify, validate, report, export) draws the same one. The spec's sampling unit
draws it (:meth:`certkv.core.sampling_unit.SamplingUnit.draw_pilot`): requests, or whole contexts
under grouping, so a context is never split between the pilot and the certification requests;
:func:`draw_pilot`, :func:`draw_pilot_groups` and :class:`PilotSplit` live in
:mod:`certkv.core.sampling_unit` and are re-exported here. A quantile q sends about
the share q of the pilot's most suspicious requests to the full cache:

* confidence: b_q = q-quantile of the pilot's ``confidence_min`` (escalate when < b_q);
* lookahead: t_q = (1 − q)-quantile of the pilot's ``lookahead_mass`` (full cache when > t_q);
* learned: t_q = (1 − q)-quantile of the pilot's learned scores (full cache when > t_q);
* recompute: r_q = q-quantile of the pilot's ``confidence_min`` (a generation restarts on the full
  cache at its first token whose probability is < r_q);
* certificate recompute: b_q = (1 − q)-quantile of the pilot's ``certificate_max`` (a generation
  restarts at its first token whose step certificate is > b_q).

Quantiles are numpy's default (linear interpolation). Torch-free: numpy and scikit-learn.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict

from certkv.core.binomial import violation_mask
from certkv.core.gate_features import LearnedGate, expand_features, feature_matrix, learned_scores, needed_signals
from certkv.core.gated import check_signal, derive_gated
from certkv.core.loss_table import LossTable
from certkv.core.procedures import procedure_of
from certkv.core.sampling_unit import MIN_CERTIFICATION, PilotSplit, draw_pilot, draw_pilot_groups, pilot_size, sampling_unit
from certkv.core.spec import CandidateInfo, CertificationSpec, GateSettings
from certkv.errors import CertkvError


class PilotInfo(BaseModel):
    """The pilot of an operating point: its ``share`` and ``seed``, how many requests it took
    (``n_pilot``) and left to certify (``n_certification``), and the pilot's ``request_ids``.

    Examples
    --------
    >>> from certkv.core.certify import certify
    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0} for i in range(200)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]], pilot={"share": 0.25})
    >>> info = certify(LossTable.from_records(rows), spec).pilot
    >>> info.n_pilot, info.n_certification, info.request_ids[:3]
    (50, 150, ['r100', 'r109', 'r113'])
    """

    model_config = ConfigDict(extra="forbid")
    share: float
    seed: int
    n_pilot: int
    n_certification: int
    request_ids: list[str]


# ----------------------------------------------------------------------------- fitting


def fit_learned_gate(
    signals: Mapping[str, npt.ArrayLike | None] | Iterable[Mapping[str, Any]], features: Sequence[str], labels: npt.ArrayLike
) -> LearnedGate:
    """Fit the learned gate: ``StandardScaler`` then ``LogisticRegression`` (lbfgs, C = 1) on the
    expanded `features` of N requests, `labels` (N,) True where the request violates.

    `signals` is a mapping of arrays (:func:`certkv.core.gate_features.feature_matrix`: (N,) each,
    ``lookahead_heads`` (N, F)) or a list of N per-request signal dicts (the runtime's form).
    Labels of one class only (a pilot without a violation, or with nothing else) give the
    constant model (coef 0, intercept 0: score 0.5 on every request), which gates nothing at a
    threshold placed on its own scores.

    References
    ----------
    .. [1] F. Pedregosa et al., "Scikit-learn: Machine Learning in Python", JMLR 12, 2011
           (``StandardScaler`` and ``LogisticRegression``, the fit done here).

    Examples
    --------
    >>> from certkv.core.gate_features import learned_scores
    >>> gate = fit_learned_gate({"confidence_min": np.array([0.1, 0.2, 0.8, 0.9])}, ["confidence_min"],
    ...                         labels=[True, True, False, False])  # the unsure requests violated
    >>> learned_scores(gate, np.array([[0.15], [0.85]])).round(2)
    array([0.74, 0.26])
    >>> fit_learned_gate({"confidence_min": np.array([0.1, 0.9])}, ["confidence_min"], [False, False]).coef
    [0.0]
    """
    # Lazy: scikit-learn is heavy, and this module is on `certkv certify`'s import path (operating_point).
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    x = feature_matrix(_as_columns(signals, features), list(features))
    y = np.asarray(labels, dtype=bool)
    if y.shape != (x.shape[0],):
        raise CertkvError(f"learned gate: {x.shape[0]} requests but {y.size} labels")
    scaler = StandardScaler().fit(x)
    mean, scale = scaler.mean_.tolist(), scaler.scale_.tolist()
    if y.all() or not y.any():
        return LearnedGate(features=list(features), mean=mean, scale=scale, coef=[0.0] * len(features), intercept=0.0)
    model = LogisticRegression(C=1.0, max_iter=5000).fit(scaler.transform(x), y)
    return LearnedGate(
        features=list(features),
        mean=mean,
        scale=scale,
        coef=[float(c) for c in model.coef_[0]],
        intercept=float(model.intercept_[0]),
    )


def _as_columns(signals, features) -> Mapping:
    """Per-request signal dicts as the columns `features` read (a mapping passes through)."""
    if isinstance(signals, Mapping):
        return signals
    rows = list(signals)
    out = {}
    for key in needed_signals(features):
        if key == "lookahead_heads":
            out[key] = _heads(rows)
        else:
            out[key] = np.asarray([np.nan if r.get(key) is None else r[key] for r in rows], dtype=float)
    return out


def _heads(rows) -> np.ndarray | None:
    if any(r.get("lookahead_heads") is None for r in rows):
        return None
    return np.asarray([r["lookahead_heads"] for r in rows], dtype=float)


def signal_quantile(values: np.ndarray, q: float) -> float:
    """numpy's (linear) q-quantile of `values`, as a float.

    Examples
    --------
    >>> signal_quantile(np.array([0.0, 0.1, 0.2, 0.3, 0.4]), 0.5)
    0.2
    """
    return float(np.quantile(np.asarray(values, dtype=float), q))


# ----------------------------------------------------------------------------- resolution


@dataclass(frozen=True)
class PilotResolution:
    """A spec resolved on its pilot: ``table`` holds the certification requests only (recorded
    rows, no derived ones yet), ``spec`` the pilot-fixed gate settings (and, under pilot_ordered,
    the one ordered sequence), ``pilot_violations`` each candidate's pilot violation count (by
    name) and ``notes`` what the pilot did, in words.

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0} for i in range(200)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]], pilot={"share": 0.25})
    >>> resolution = resolve_pilot(LossTable.from_records(rows), spec)
    >>> resolution.table.n_requests, len(resolution.split.pilot_ids)
    (150, 50)
    """

    split: PilotSplit
    table: LossTable
    spec: CertificationSpec
    pilot_violations: dict[str, int]
    pilot_memory: dict[str, float]
    notes: tuple[str, ...]

    @property
    def info(self) -> PilotInfo:
        split = self.split
        return PilotInfo(
            share=split.share,
            seed=split.seed,
            n_pilot=len(split.pilot_ids),
            n_certification=len(split.certification_ids),
            request_ids=list(split.pilot_ids),
        )


def resolve_pilot(table: LossTable, spec: CertificationSpec) -> PilotResolution:
    """Draw `spec`'s pilot from `table`, fit and place its gates there, order (pilot_ordered) and
    return the certification part of the table with the resolved spec (:class:`PilotResolution`).

    The one resolution that certify, validate, report and export share. Errors (one line each):
    no pilot in the spec, a pilot that leaves fewer than 100 certification requests, a base
    candidate without records, a signal the gates need that the records lack (recalibrate hint).

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0} for i in range(200)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]], pilot={"share": 0.25})
    >>> print(resolve_pilot(LossTable.from_records(rows), spec).notes[0])
    pilot: 50 of 200 requests (share 0.25, seed 0) placed the gate thresholds and never certify; n counts the other 150
    """
    if spec.pilot is None:
        raise CertkvError("this spec has no pilot (gate.pilot); nothing to resolve")
    split = sampling_unit(spec).draw_pilot(table, spec.pilot.share, spec.pilot.seed, spec.pilot.min_certification)
    pilot = table.take_requests(split.pilot_columns, source=f"{table.source} (pilot)")
    certification = table.take_requests(split.certification_columns)
    notes = [
        f"pilot: {len(split.pilot_ids)} of {table.n_requests} requests (share {split.share:g}, seed {split.seed}) "
        f"placed the gate thresholds and never certify; n counts the other {len(split.certification_ids)}"
    ]
    models: dict[tuple[str, tuple[str, ...]], tuple[LearnedGate, np.ndarray]] = {}
    info = dict(spec.candidate_info)
    for name in spec.candidates:
        entry = info.get(name)
        if entry is None or entry.pilot_gate is None:
            continue
        info[name] = _resolve_candidate(name, entry, pilot, spec, models, notes)
    resolved = spec.model_copy(update={"candidate_info": info})

    violations: dict[str, int] = {}
    memory: dict[str, float] = {}
    if procedure_of(spec.procedure).orders_by_pilot:
        expanded = derive_gated(pilot, resolved)
        names = resolved.candidates
        rows = [expanded.index_of(n) for n in names]
        k = violation_mask(expanded.loss[rows], spec.tolerance).sum(axis=1)
        mem = np.round(expanded.memory[rows].mean(axis=1), 12)
        violations = {n: int(x) for n, x in zip(names, k.tolist())}
        memory = {n: float(x) for n, x in zip(names, mem.tolist())}
        order = sorted(range(len(names)), key=lambda i: (int(k[i]), -float(mem[i]), i))
        resolved = resolved.model_copy(update={"sequences": [[names[i] for i in order]]})
        notes.append(
            f"pilot_ordered: the pilot ordered all {len(names)} candidates into one sequence by pilot violation "
            "rate (ties: more KV first, then contract order), tested on the certification requests at the full δ"
        )
    return PilotResolution(split, certification, resolved, violations, memory, tuple(_merge_one_class(notes)))


def _resolve_candidate(
    name: str, entry: CandidateInfo, pilot: LossTable, spec: CertificationSpec, models: dict, notes: list[str]
) -> CandidateInfo:
    """`entry` with its pilot gate's threshold (and model) placed on `pilot`."""
    gate = entry.pilot_gate
    assert gate is not None and gate.quantile is not None, name  # only pilot-gated candidates are resolved
    base = entry.base_policy
    row = pilot.index_of(base)
    who = f"policy {base!r} (needed by {name!r}) on the pilot"
    settings = entry.gate.model_copy(update={"quantile": gate.quantile}) if entry.gate is not None else None
    if settings is None:
        settings = GateSettings(quantile=gate.quantile)
    if gate.pilot_kind in ("confidence", "recompute"):  # both read the lowest token probability
        values = check_signal(pilot, _row(pilot.confidence_min, row), "confidence_min", who)
        settings = settings.model_copy(update={gate.pilot_kind: signal_quantile(values, gate.quantile)})
    elif gate.pilot_kind == "certificate_recompute":  # the largest step certificate of the whole answer
        values = check_signal(pilot, _row(pilot.certificate_max, row), "certificate_max", who)
        settings = settings.model_copy(update={"certificate_recompute": signal_quantile(values, 1.0 - gate.quantile)})
    elif gate.pilot_kind == "lookahead":
        values = check_signal(pilot, _row(pilot.lookahead_mass, row), "lookahead_mass", who)
        settings = settings.model_copy(update={"lookahead": signal_quantile(values, 1.0 - gate.quantile)})
    else:
        key = (base, tuple(gate.features))
        if key not in models:
            models[key] = _fit_base(pilot, row, gate.features, spec, who, notes)
        model, scores = models[key]
        settings = settings.model_copy(
            update={"learned": model, "learned_threshold": signal_quantile(scores, 1.0 - gate.quantile)}
        )
    return entry.model_copy(update={"gate": settings})


def _fit_base(pilot: LossTable, row: int, groups, spec: CertificationSpec, who: str, notes: list[str]):
    n_heads = None
    if "lookahead" in groups:
        heads = pilot.lookahead_heads
        values = heads[row] if heads is not None and row < heads.shape[0] else None
        check_signal(pilot, values, "lookahead_heads", who)
        n_heads = heads.shape[2]
    features = expand_features(list(groups), n_heads)
    signals = pilot.signals_of(row)
    for key in needed_signals(features):
        check_signal(pilot, signals.get(key), key, who)
    labels = violation_mask(pilot.loss[row], spec.tolerance)
    model = fit_learned_gate(signals, features, labels)
    if labels.all() or not labels.any():
        kind = "no violation" if not labels.any() else "only violations"
        notes.append(f"{ONE_CLASS}{kind}: {pilot.policies[row]!r}")
    return model, learned_scores(model, feature_matrix(signals, features))


#: Prefix of the notes about learned gates whose pilot holds one class (merged per kind).
ONE_CLASS = "learned gate, constant model that gates nothing (one class on the pilot): "


def _merge_one_class(notes: list[str]) -> list[str]:
    """One note per kind instead of one per base candidate (a demo grid has dozens)."""
    merged: dict[str, list[str]] = {}
    out: list[str] = []
    for note in notes:
        if note.startswith(ONE_CLASS):
            kind, _, policy = note[len(ONE_CLASS) :].partition(": ")
            if kind not in merged:
                merged[kind] = []
                out.append(kind)  # placeholder, filled below in first-seen order
            merged[kind].append(policy)
        else:
            out.append(note)
    return [f"{ONE_CLASS}{n} for {', '.join(merged[n])}" if n in merged else n for n in out]


def is_unresolved(info: CandidateInfo) -> bool:
    """Whether `info` is a pilot gate whose threshold the pilot has not placed yet.

    Examples
    --------
    >>> from certkv.core.policy_names import GateChoice
    >>> from certkv.core.spec import CandidateInfo, GateSettings
    >>> is_unresolved(CandidateInfo(base_policy="p@0.50", pilot_gate=GateChoice(pilot_kind="confidence", quantile=0.9)))
    True
    >>> is_unresolved(CandidateInfo(base_policy="p@0.50", gate=GateSettings(agreement_drop=0.1)))  # set in the contract
    False
    """
    g = info.gate
    return info.pilot_gate is not None and (
        g is None or (g.confidence is None and g.lookahead is None and g.learned is None and g.recompute is None
                      and g.certificate_recompute is None)
    )


def _row(matrix, row: int):
    return None if matrix is None else matrix[row]


def apply_pilot(table: LossTable, spec: CertificationSpec) -> tuple[LossTable, CertificationSpec, PilotResolution | None]:
    """(certification table, resolved spec, resolution) when `spec` has a pilot, else the inputs
    and None; a pilot gate or pilot_ordered without a pilot is an error.

    The first step of :func:`certkv.core.certify.prepare`, before the gated candidates are derived.

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0} for i in range(200)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.50"]],
    ...                          pilot={"share": 0.25})
    >>> table, resolved, resolution = apply_pilot(LossTable.from_records(rows), spec)
    >>> table.n_requests, resolution.info.n_pilot
    (150, 50)
    """
    if spec.pilot is not None:
        res = resolve_pilot(table, spec)
        return res.table, res.spec, res
    if procedure_of(spec.procedure).orders_by_pilot:
        raise CertkvError("procedure pilot_ordered needs a pilot split; set gate.pilot (spec.pilot)")
    pending = [n for n, i in spec.candidate_info.items() if is_unresolved(i)]
    if pending:
        raise CertkvError(f"{pending[0]!r} places its threshold on a pilot split; set gate.pilot (spec.pilot)")
    return table, spec, None


__all__ = [
    "MIN_CERTIFICATION",
    "PilotInfo",
    "PilotResolution",
    "PilotSplit",
    "apply_pilot",
    "draw_pilot",
    "draw_pilot_groups",
    "fit_learned_gate",
    "is_unresolved",
    "pilot_size",
    "resolve_pilot",
    "signal_quantile",
]
