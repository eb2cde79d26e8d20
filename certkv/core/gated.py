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

with the base's nominal kv_retained and press. The thresholds are pre-registered in the contract
(each setting is a candidate of its own, tested like any other), or placed on a pilot split that
never certifies (:mod:`certkv.core.pilot`), so nothing here is tuned on the certification data.
The learned score is :func:`certkv.core.gate_features.learned_scores`, the runtime's definition.

Torch-free: numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import NamedTuple, NoReturn, Protocol, cast

import numpy as np
import numpy.typing as npt

from certkv.core.gate_features import feature_matrix, learned_scores, needed_signals
from certkv.core.loss_table import GatedRow, LossTable
from certkv.core.signals import signal
from certkv.core.spec import CertificationSpec, LearnedGate
from certkv.errors import CertkvError

RECALIBRATE = "recalibrate with a current certkv (`certkv calibrate CONTRACT --new-store`)"

#: Each gate part: the signal it reads and the side of its threshold that sends a request to the
#: full cache. Certification (:func:`gated_mask`) and the runtime (:mod:`certkv.runtime.gates`)
#: both decide through :func:`fires`, so they cannot compare differently.
GATE_PARTS = {
    "agreement_drop": ("agreement_drop", np.less),
    "certificate": ("certificate_max", np.greater),
    "confidence": ("confidence_min", np.less),
    "lookahead": ("lookahead_mass", np.greater),
    "learned": ("learned_score", np.greater),
}


def fires(part: str, value: npt.ArrayLike, threshold: float) -> np.bool_ | np.ndarray:
    """Whether gate `part` (a key of :data:`GATE_PARTS`) sends `value` (a signal, or an (R,)
    array of them) to the full cache at `threshold`: a bool, or an (R,) boolean array."""
    return GATE_PARTS[part][1](value, float(threshold))


class GateSpec(Protocol):
    """What a gated candidate needs (a contract's :class:`~certkv.contract.schema.GatedCandidateSpec`
    fits for fixed thresholds; pilot gates come as :class:`Derive` with their resolved thresholds)."""

    @property
    def policy(self) -> str: ...

    @property
    def base_policy(self) -> str: ...

    @property
    def agreement_drop(self) -> float | None: ...

    @property
    def certificate(self) -> float | None: ...


class _PilotSetting(Protocol):
    @property
    def pilot(self) -> float | None: ...


class GatedContract(Protocol):
    """What :func:`expand_for_contract` reads from a contract (:class:`certkv.contract.schema.Contract`,
    which the core does not import): its gate block (for the pilot share) and its gated candidates."""

    @property
    def gate(self) -> _PilotSetting | None: ...

    def gated_candidates(self) -> Sequence[GateSpec]: ...


class Derive(NamedTuple):
    """A gated candidate to derive, when no contract object is at hand (the certifier's spec)."""

    policy: str
    base_policy: str
    agreement_drop: float | None
    certificate: float | None
    confidence: float | None = None
    lookahead: float | None = None
    learned: LearnedGate | None = None
    learned_threshold: float | None = None


def _settings(g) -> tuple:
    """The gate settings of a spec (contract specs lack the pilot kinds: None)."""
    return (
        g.agreement_drop,
        g.certificate,
        getattr(g, "confidence", None),
        getattr(g, "lookahead", None),
        getattr(g, "learned", None),
        getattr(g, "learned_threshold", None),
    )


def _has_gate(g) -> bool:
    drop, cert, conf, look, learned, _ = _settings(g)
    return any(x is not None for x in (drop, cert, conf, look, learned))


def learned_table_scores(
    table: LossTable, base_row: int, model: LearnedGate, policy: str = "", columns: Sequence[int] | np.ndarray | None = None
) -> np.ndarray:
    """The learned score of each request (at `columns`, default all) of `base_row`: (R,) floats,
    through :func:`certkv.core.gate_features.feature_matrix` (the runtime's definition).

    columns : (R,) int array (or sequence) of request indices; None: every request of the table.
    """
    who = _who(table, base_row, policy)
    signals = table.signals_of(base_row, columns)
    for key in needed_signals(model.features):
        check_signal(table, signals.get(key), key, who, columns)
    return learned_scores(model, feature_matrix(signals, model.features))


def check_signal(
    table: LossTable, values: npt.ArrayLike | None, column: str, who: str, columns: Sequence[int] | np.ndarray | None = None
) -> np.ndarray:
    """`values` when fully recorded, else the one-line recalibrate error naming `column`.

    values : (R,) float array of a signal, or (R, F) for a per-head one; None: not recorded.
    columns : the request indices `values` cover ((R,) ints); None: every request of the table.
    """
    n = table.n_requests if columns is None else len(columns)
    if values is None:
        missing = np.ones(n, dtype=bool)
    else:
        values = np.asarray(values, dtype=float)
        missing = np.isnan(values) if values.ndim == 1 else np.isnan(values).any(axis=tuple(range(1, values.ndim)))
    if missing.any():
        ids = table.request_ids if columns is None else [table.request_ids[int(i)] for i in columns]
        _missing(column, who, missing, table, ids)
    return cast(np.ndarray, values)  # None only when there is no request to check (R = 0)


def gated_mask(
    table: LossTable,
    base_row: int,
    agreement_drop: float | None,
    certificate: float | None,
    policy: str = "",
    *,
    confidence: float | None = None,
    lookahead: float | None = None,
    learned: LearnedGate | None = None,
    learned_threshold: float | None = None,
) -> np.ndarray:
    """Boolean (R,) mask of the requests the gate sends to the full cache.

    Fires where agreement_drop < `agreement_drop`, certificate_max > `certificate`,
    confidence_min < `confidence`, lookahead_mass > `lookahead`, or the `learned` score >
    `learned_threshold` (each part off when None). A signal the gate needs but the records lack
    (NaN) is a one-line error: silently treating a missing signal as "not gated" would certify a
    gate that was never observed.
    """
    who = _who(table, base_row, policy)
    mask = np.zeros(table.n_requests, dtype=bool)
    for part, threshold in (
        ("confidence", confidence),
        ("lookahead", lookahead),
        ("agreement_drop", agreement_drop),
        ("certificate", certificate),
    ):
        if threshold is None:
            continue
        column = GATE_PARTS[part][0]
        # a request signal is one value per request (every row shares it); a candidate's, the base row's
        values = table.signals_of(base_row).get(column)
        mask |= fires(part, check_signal(table, values, column, who), threshold)
    if learned is not None:
        if learned_threshold is None:
            raise CertkvError(f"{policy or table.policies[base_row]!r}: a learned gate needs its threshold (learned_threshold)")
        mask |= fires("learned", learned_table_scores(table, base_row, learned, policy), learned_threshold)
    return mask


def _who(table: LossTable, base_row: int, policy: str) -> str:
    """How errors name a base candidate, and the gated candidate that needs it."""
    base = table.policies[base_row]
    return f"policy {base!r}" + (f" (needed by {policy!r})" if policy and policy != base else "")


def _missing(column: str, who: str, missing: np.ndarray, table: LossTable, ids=None) -> NoReturn:
    ids = table.request_ids if ids is None else ids
    example = ids[int(np.flatnonzero(missing)[0])]
    why = ""
    if column in ("lookahead_mass", "lookahead_heads"):
        why = " (a contract without a lookahead gate records none, nor does a pipeline-path press)"
    raise CertkvError(
        f"{table.source} lacks `{column}` for {who} on {int(missing.sum())} of {len(ids)} "
        f"requests (e.g. {example!r}){why}, so its gated candidates cannot be derived; {RECALIBRATE}"
    )


def expand_gated(table: LossTable, gated: Iterable[GateSpec | Derive]) -> LossTable:
    """A new table: `table`'s rows plus one derived row per gated candidate (in the given order).

    Candidates the table already derived with the same settings are kept as they are, so
    expanding twice is harmless. A gated name the input itself holds rows for is an error: certkv
    derives those rows, and a second source for the same candidate would be ambiguous. The input
    table is never modified.
    """
    specs = [g for g in gated if _to_derive(table, g)]
    if not specs:
        return table
    base_rows = np.array([table.index_of(g.base_policy) for g in specs], dtype=np.int64)
    masks = np.stack([_mask_of(table, int(row), g) for row, g in zip(base_rows, specs)])
    actual = None
    if table.kv_retained_actual is not None:
        actual = np.vstack([table.kv_retained_actual, np.where(masks, 1.0, table.kv_retained_actual[base_rows])])
    gated_rows = dict(table.gated)
    for g, count in zip(specs, masks.sum(axis=1).tolist()):
        gated_rows[g.policy] = _gated_row(g, int(count), table.n_requests)
    return replace(
        table,
        policies=table.policies + tuple(g.policy for g in specs),
        press=table.press + tuple(table.press[int(r)] for r in base_rows),
        kv_retained=np.concatenate([table.kv_retained, table.kv_retained[base_rows]]),
        loss=np.vstack([table.loss, np.where(masks, 0.0, table.loss[base_rows])]),
        memory=np.vstack([table.memory, np.where(masks, 1.0, table.memory[base_rows])]),
        kv_retained_actual=actual,
        gated=gated_rows,
        signals=_padded_signals(table, len(specs)),
    )


def _mask_of(table: LossTable, row: int, g: GateSpec | Derive) -> np.ndarray:
    """:func:`gated_mask` of `g`'s settings on base row `row`."""
    drop, cert, conf, look, learned, learned_t = _settings(g)
    return gated_mask(
        table, row, drop, cert, g.policy, confidence=conf, lookahead=look, learned=learned, learned_threshold=learned_t
    )


def _to_derive(table: LossTable, g: GateSpec | Derive) -> bool:
    """Whether `g` is still to be derived (False: the table derived it already, identically);
    a gated name with rows of its own, a missing base or no gate setting is an error."""
    if g.policy in table:
        done = table.gated.get(g.policy)
        if done is None:
            raise CertkvError(
                f"{table.source} has rows for {g.policy!r}, a gated candidate that certkv derives from "
                f"{g.base_policy!r} and the gate signals; remove those rows (or rename the policy)"
            )
        drop, cert, conf, look, _, learned_t = _settings(g)
        if (done.base_policy, done.agreement_drop, done.certificate, done.confidence, done.lookahead, done.learned_threshold) != (
            g.base_policy,
            drop,
            cert,
            conf,
            look,
            learned_t,
        ):
            raise CertkvError(f"{g.policy!r} was derived with other gate settings; derive it from the records again")
        return False
    if g.base_policy not in table:
        raise CertkvError(
            f"gated candidate {g.policy!r} needs its base {g.base_policy!r}, which has no records in "
            f"{table.source}; calibrate it or remove it from the contract"
        )
    if not _has_gate(g):
        raise CertkvError(f"{g.policy!r} has no gate setting; it is not a gated candidate")
    return True


def _gated_row(g: GateSpec | Derive, count: int, n_requests: int) -> GatedRow:
    drop, bound, conf, look, _, learned_t = _settings(g)
    return GatedRow(
        base_policy=g.base_policy,
        agreement_drop=None if drop is None else float(drop),
        certificate=None if bound is None else float(bound),
        gated_count=count,
        gated_share=count / n_requests,
        confidence=None if conf is None else float(conf),
        lookahead=None if look is None else float(look),
        learned_threshold=None if learned_t is None else float(learned_t),
    )


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


def spec_derivations(spec: CertificationSpec) -> list[Derive]:
    """The gated candidates a :class:`~certkv.core.spec.CertificationSpec` lists, with their gate
    settings; a pilot gate whose threshold is not placed yet is an error."""
    out = []
    for name in spec.candidates:
        info = spec.candidate_info.get(name)
        if info is None or info.gate is None:
            continue
        g = info.gate
        if info.pilot_gate is not None and g.confidence is None and g.lookahead is None and g.learned is None:
            raise CertkvError(
                f"{name!r} places its threshold on the pilot split; resolve the spec first "
                "(certkv.core.pilot.resolve_pilot, which certify and validate run)"
            )
        out.append(
            Derive(
                name, info.base_policy, g.agreement_drop, g.certificate, g.confidence, g.lookahead, g.learned, g.learned_threshold
            )
        )
    return out


def expand_for_contract(table: LossTable, contract: GatedContract) -> LossTable:
    """`table` with every gated candidate of `contract` derived (the table itself when it has no
    gate). A contract with a pilot split is left as it is: its gates are resolved on the pilot and
    derived on the certification requests only, when it is certified (:mod:`certkv.core.pilot`)."""
    if contract.gate is not None and contract.gate.pilot is not None:
        return table
    gated = contract.gated_candidates()
    return expand_gated(table, gated) if gated else table


def gated_share(table: LossTable, policy: str) -> float:
    """Share of the table's requests the gate of `policy` sends to the full cache (0: ungated)."""
    row = table.gated.get(policy)
    return 0.0 if row is None else row.gated_share


__all__ = [
    "GATE_PARTS",
    "RECALIBRATE",
    "Derive",
    "GateSpec",
    "check_signal",
    "expand_for_contract",
    "expand_gated",
    "fires",
    "gated_mask",
    "spec_derivations",
    "gated_share",
    "learned_table_scores",
]
