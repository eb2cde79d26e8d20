"""Gated candidates, derived from their base candidate's records (docs/design.md, "Gate signals").

A runtime gate sends a request to the full cache when its agreement drop D is below a threshold t,
or escalates it to the full cache when the candidate's survey-variance certificate ĉ exceeds a
bound b, its answer's lowest token probability is below b_c (confidence), the lookahead probe's
evicted attention mass exceeds t_l, or its learned score exceeds t_s. On such a request the answer
is the full-KV answer, so the gated candidate loses nothing there and uses the whole cache. A
gated candidate therefore needs no calibration of its own: from the base candidate's rows and the
recorded signals,

    gated_i  = (agreement_drop_i < t) or (certificate_max_i > b) or (confidence_min_i < b_c)
               or (lookahead_mass_i > t_l) or (learned_score_i > t_s)   (a part is off when unset)
    loss_i   = 0    where gated_i, else the base's loss
    memory_i = 1.0  where gated_i, else the base's memory

A recompute gate (threshold r) restarts a generation on the full cache at its first token whose
probability is < r, keeping the tokens before it. Under greedy decoding that gives exactly the
full-KV answer when the restart comes at or before the answer's first departure from it
(``confidence_min_agreeing_i < r``); a later restart continues from tokens the full cache would
not have produced, and is counted as violated (loss 1, the largest a utility in [0, 1] allows)
rather than decoded again: conservative, never optimistic. So

    restarted_i = confidence_min_i < r
    loss_i      = 0 where confidence_min_agreeing_i < r; 1 where restarted_i otherwise; else the base's
    memory_i    = 1.0 where restarted_i (the restart prefills everything again), else the base's

A certificate recompute gate (bound b, certkv's probabilistic decoding press) restarts the same way
at the first token whose decoding step's survey-variance certificate is > b, and is counted the same
way from the largest step certificate over the whole answer and up to its first departure:
restarted_i = certificate_max_i > b, in time where certificate_max_agreeing_i > b. With both parts
set, the restart comes at the first token either fires on, in time where either fires up to the
departure.

with the base's nominal kv_retained and press. The thresholds are pre-registered in the contract
(each setting is a candidate of its own, tested like any other), or placed on a pilot split that
never certifies (:mod:`certkv.core.pilot`), so nothing here is tuned on the certification data.
The learned score is :func:`certkv.core.gate_features.learned_scores`, the runtime's definition,
and every comparison is :func:`certkv.core.gate_features.fires`, the runtime's own. :func:`derive_gated` is
the one step that derives a spec's gated candidates; pilot resolution, pooled and stratified
certification and validation all go through it.

Torch-free: numpy only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NoReturn, cast

import numpy as np
import numpy.typing as npt

from certkv.core.gate_features import GATE_PARTS, feature_matrix, fires, learned_scores, needed_signals
from certkv.core.loss_table import GatedRow, LossTable
from certkv.core.signals import signal
from certkv.core.spec import CertificationSpec, GateSettings
from certkv.errors import CertkvError

RECALIBRATE = "recalibrate with a current certkv (`certkv calibrate CONTRACT --new-store`)"


#: A gated candidate to derive: (its name, its base's name, its gate settings).
_Wanted = tuple[str, str, GateSettings]


def derive_gated(table: LossTable, spec: CertificationSpec) -> LossTable:
    """`table` plus one derived row per gated candidate of `spec`, in spec order: the one step
    that turns a spec's gates into rows.

    A gated candidate (``spec.candidate_info[name].gate`` set) is its base's row with every
    request its gate fires on replaced by the full cache (loss 0, memory 1.0). Candidates the
    table already derived with the same settings are kept as they are, so deriving twice is
    harmless; the input table is never modified. Errors (one line each): a pilot gate whose
    threshold is not placed yet (resolve the pilot first: :func:`certkv.core.pilot.apply_pilot`),
    a base without records, a signal the gate needs that the records lack, or recorded rows under
    a gated name.

    Parameters
    ----------
    table : LossTable
        The recorded rows (and signals) of the base candidates.
    spec : CertificationSpec
        Its ``candidate_info`` says which candidates are gated, on which base, with which settings.

    Returns
    -------
    LossTable
        `table` itself when nothing is left to derive, else a new table with the derived rows appended.

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> from certkv.core.spec import CandidateInfo, CertificationSpec, GateSettings
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": float(i == 0),
    ...          "agreement_drop": 0.0 if i == 0 else 0.5} for i in range(4)]
    >>> spec = CertificationSpec(tolerance=0.0, risk=0.5, confidence=0.9, sequences=[["p@0.50+drop0.1"]],
    ...     candidate_info={"p@0.50+drop0.1": CandidateInfo(base_policy="p@0.50", gate=GateSettings(agreement_drop=0.1))})
    >>> derived = derive_gated(LossTable.from_records(rows), spec)
    >>> derived.loss[derived.index_of("p@0.50+drop0.1")].tolist()  # r0 (drop 0 < 0.1) went to the full cache
    [0.0, 0.0, 0.0, 0.0]
    >>> derived.gated["p@0.50+drop0.1"].gated_count
    1
    """
    wanted: list[_Wanted] = []
    for name in spec.candidates:
        info = spec.candidate_info.get(name)
        if info is None or info.gate is None:
            continue
        if info.pilot_gate is not None and not info.gate.kind:
            raise CertkvError(
                f"{name!r} places its threshold on the pilot split; resolve the spec first "
                "(certkv.core.pilot.apply_pilot, which certify and validate run)"
            )
        wanted.append((name, info.base_policy, info.gate))
    return _expand(table, [w for w in wanted if _to_derive(table, *w)])


def check_signal(table: LossTable, values: npt.ArrayLike | None, column: str, who: str) -> np.ndarray:
    """`values` when fully recorded, else the one-line recalibrate error naming `column`.

    values : (R,) float array of a signal, or (R, F) for a per-head one; None: not recorded.

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0, "agreement_drop": 0.1 * i}
    ...         for i in range(3)]
    >>> table = LossTable.from_records(rows)
    >>> check_signal(table, table.agreement_drop, "agreement_drop", "the drop gate").round(2).tolist()
    [0.0, 0.1, 0.2]
    >>> check_signal(table, table.confidence_min, "confidence_min", "the confidence gate")  # not recorded
    Traceback (most recent call last):
    ...
    certkv.errors.CertkvError: records lacks `confidence_min` for the confidence gate on 3 of 3 requests (e.g. 'r0'), ...
    """
    n = table.n_requests
    if values is None:
        missing = np.ones(n, dtype=bool)
    else:
        values = np.asarray(values, dtype=float)
        missing = np.isnan(values) if values.ndim == 1 else np.isnan(values).any(axis=tuple(range(1, values.ndim)))
    if missing.any():
        _missing(column, who, missing, table)
    return cast(np.ndarray, values)  # None only when there is no request to check (R = 0)


def gated_mask(table: LossTable, base_row: int, gate: GateSettings, policy: str = "") -> np.ndarray:
    """Boolean (R,) mask of the requests `gate` sends to the full cache from base row `base_row`.

    Fires where any set part of `gate` fires (:meth:`GateSettings.thresholds`, each through
    :func:`~certkv.core.gate_features.fires`): agreement_drop < its threshold, certificate_max >
    ``certificate`` or > ``certificate_recompute``, confidence_min < ``confidence`` or <
    ``recompute``, lookahead_mass > ``lookahead``, or the ``learned`` score > ``learned_threshold``.
    A signal the gate needs but the records lack (NaN) is a one-line error: silently treating a
    missing signal as "not gated" would certify a gate that was never observed. `policy` names
    the gated candidate in errors.

    Examples
    --------
    >>> from certkv.core.loss_table import LossTable
    >>> rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": 0.0, "agreement_drop": drop}
    ...         for i, drop in enumerate([0.0, 0.3, 0.05])]
    >>> gated_mask(LossTable.from_records(rows), 0, GateSettings(agreement_drop=0.1)).tolist()
    [True, False, True]
    """
    who = _who(table, base_row, policy)
    mask = np.zeros(table.n_requests, dtype=bool)
    # a request signal is one value per request (every row shares it); a candidate's, the base row's
    signals = table.signals_of(base_row)
    for part, threshold in gate.thresholds().items():
        if part == "learned":
            assert gate.learned is not None  # the settings' validator: a learned threshold comes with its model
            for key in needed_signals(gate.learned.features):
                check_signal(table, signals.get(key), key, who)
            values = learned_scores(gate.learned, feature_matrix(signals, gate.learned.features))
        else:
            column = GATE_PARTS[part][0]
            values = check_signal(table, signals.get(column), column, who)
        mask |= fires(part, values, threshold)
    return mask


def _who(table: LossTable, base_row: int, policy: str) -> str:
    """How errors name a base candidate, and the gated candidate that needs it."""
    base = table.policies[base_row]
    return f"policy {base!r}" + (f" (needed by {policy!r})" if policy and policy != base else "")


def _missing(column: str, who: str, missing: np.ndarray, table: LossTable) -> NoReturn:
    ids = table.request_ids
    example = ids[int(np.flatnonzero(missing)[0])]
    why = ""
    if column in ("lookahead_mass", "lookahead_heads"):
        why = " (a contract without a lookahead gate records none, nor does a pipeline-path press)"
    raise CertkvError(
        f"{table.source} lacks `{column}` for {who} on {int(missing.sum())} of {len(ids)} "
        f"requests (e.g. {example!r}){why}, so its gated candidates cannot be derived; {RECALIBRATE}"
    )


def _expand(table: LossTable, wanted: list[_Wanted]) -> LossTable:
    """A new table: `table`'s rows plus one derived row per entry of `wanted`, in order (`table`
    itself when `wanted` is empty)."""
    if not wanted:
        return table
    base_rows = np.array([table.index_of(base) for _, base, _ in wanted], dtype=np.int64)
    masks = np.stack([gated_mask(table, int(row), g, name) for row, (name, _, g) in zip(base_rows, wanted)])
    late = np.stack([_late_restarts(table, int(row), name, g) for row, (name, _, g) in zip(base_rows, wanted)])
    actual = None
    if table.kv_retained_actual is not None:
        actual = np.vstack([table.kv_retained_actual, np.where(masks, 1.0, table.kv_retained_actual[base_rows])])
    gated_rows = dict(table.gated)
    for (name, base, g), count in zip(wanted, masks.sum(axis=1).tolist()):
        gated_rows[name] = GatedRow(base, g, int(count), int(count) / table.n_requests)
    return replace(
        table,
        policies=table.policies + tuple(name for name, _, _ in wanted),
        press=table.press + tuple(table.press[int(r)] for r in base_rows),
        kv_retained=np.concatenate([table.kv_retained, table.kv_retained[base_rows]]),
        loss=np.vstack([table.loss, np.where(late, 1.0, np.where(masks, 0.0, table.loss[base_rows]))]),
        memory=np.vstack([table.memory, np.where(masks, 1.0, table.memory[base_rows])]),
        kv_retained_actual=actual,
        byte_costs={name: np.vstack([costs, np.where(masks, 1.0, costs[base_rows])]) for name, costs in table.byte_costs.items()},
        gated=gated_rows,
        signals=_padded_signals(table, len(wanted)),
    )


#: Each restarting gate part: the signal over the whole answer and the one up to its first departure.
_RESTARTS = {"recompute": ("confidence_min", "confidence_min_agreeing"),
             "certificate_recompute": ("certificate_max", "certificate_max_agreeing")}


def _late_restarts(table: LossTable, row: int, name: str, g: GateSettings) -> np.ndarray:
    """(R,) bool: the requests `g`'s restarting parts restart after their first departure from the
    full-KV answer (all False without one): counted as violated. A restart comes at the first
    token any part fires on, so it is in time where some part fires up to the departure."""
    restarted = np.zeros(table.n_requests, dtype=bool)
    in_time = np.zeros(table.n_requests, dtype=bool)
    who = _who(table, row, name)
    signals = table.signals_of(row)
    for part, (whole, agreeing) in _RESTARTS.items():
        threshold = g.thresholds().get(part)
        if threshold is None:
            continue
        restarted |= fires(part, check_signal(table, signals.get(whole), whole, who), threshold)
        in_time |= fires(part, check_signal(table, signals.get(agreeing), agreeing, who), threshold)
    return restarted & ~in_time


def _to_derive(table: LossTable, name: str, base: str, g: GateSettings) -> bool:
    """Whether `name` is still to be derived (False: the table derived it already, identically);
    a gated name with rows of its own, a missing base or no gate setting is an error."""
    if name in table:
        done = table.gated.get(name)
        if done is None:
            raise CertkvError(
                f"{table.source} has rows for {name!r}, a gated candidate that certkv derives from "
                f"{base!r} and the gate signals; remove those rows (or rename the policy)"
            )
        if (done.base_policy, done.gate.thresholds()) != (base, g.thresholds()):
            raise CertkvError(f"{name!r} was derived with other gate settings; derive it from the records again")
        return False
    if base not in table:
        raise CertkvError(
            f"gated candidate {name!r} needs its base {base!r}, which has no records in "
            f"{table.source}; calibrate it or remove it from the contract"
        )
    if not g.kind:
        raise CertkvError(f"{name!r} has no gate setting; it is not a gated candidate")
    return True


def _padded_signals(table: LossTable, n_new: int) -> dict[str, np.ndarray]:
    """The table's signals with `n_new` derived rows: a derived row records no candidate signal of
    its own (NaN); request signals are the request's; per-head masses cover recorded rows only."""
    out = {}
    for name, values in table.signals.items():
        s = signal(name)
        if s.per == "candidate" and s.kind == "scalar":
            values = np.vstack([values, np.full((n_new, table.n_requests), np.nan)])
        out[name] = values
    return out


__all__ = [
    "RECALIBRATE",
    "check_signal",
    "derive_gated",
    "gated_mask",
]
