"""Gated candidates, derived from their base candidate's records (docs/design.md, "Gate signals").

A runtime gate sends a request to the full cache when its agreement drop D is below a threshold t,
or escalates it to the full cache when the candidate's survey-variance certificate ĉ exceeds a
bound b. On such a request the answer is the full-KV answer, so the gated candidate loses nothing
there and uses the whole cache. A gated candidate therefore needs no calibration of its own: from
the base candidate's rows and the recorded signals,

    gated_i  = (agreement_drop_i < t) or (certificate_max_i > b)      (a part is off when unset)
    loss_i   = 0    where gated_i, else the base's loss
    memory_i = 1.0  where gated_i, else the base's memory

with the base's nominal kv_retained and press. The thresholds are pre-registered in the contract
(each setting is a candidate of its own, tested like any other), so nothing here is tuned on the
calibration data.

Torch-free: numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import NamedTuple, Protocol

import numpy as np

from certkv.core.loss_table import GatedRow, LossTable
from certkv.errors import CertkvError

RECALIBRATE = "recalibrate with a current certkv (`certkv calibrate CONTRACT --new-store`)"


class GateSpec(Protocol):
    """What a gated candidate needs (a contract's :class:`~certkv.contract.schema.GatedCandidateSpec` fits)."""

    policy: str
    base_policy: str
    agreement_drop: float | None
    certificate: float | None


class Derive(NamedTuple):
    """A gated candidate to derive, when no contract object is at hand (the certifier's spec)."""

    policy: str
    base_policy: str
    agreement_drop: float | None
    certificate: float | None


def gated_mask(table: LossTable, base_row: int, agreement_drop: float | None,
               certificate: float | None, policy: str = "") -> np.ndarray:
    """Boolean (R,) mask of the requests the gate sends to the full cache.

    A signal the gate needs but the records lack (NaN) is a one-line error: silently treating a
    missing drop as "not gated" would certify a gate that was never observed.
    """
    base = table.policies[base_row]
    who = f"policy {base!r}" + (f" (needed by {policy!r})" if policy and policy != base else "")
    mask = np.zeros(table.n_requests, dtype=bool)
    if agreement_drop is not None:
        drop = table.agreement_drop
        missing = np.ones(table.n_requests, bool) if drop is None else np.isnan(drop)
        if missing.any():
            _missing("agreement_drop", who, missing, table)
        mask |= drop < float(agreement_drop)
    if certificate is not None:
        cert = None if table.certificate_max is None else table.certificate_max[base_row]
        missing = np.ones(table.n_requests, bool) if cert is None else np.isnan(cert)
        if missing.any():
            _missing("certificate_max", who, missing, table)
        mask |= cert > float(certificate)
    return mask


def _missing(column: str, who: str, missing: np.ndarray, table: LossTable) -> None:
    example = table.request_ids[int(np.flatnonzero(missing)[0])]
    raise CertkvError(
        f"{table.source} lacks `{column}` for {who} on {int(missing.sum())} of {table.n_requests} "
        f"requests (e.g. {example!r}), so its gated candidates cannot be derived; {RECALIBRATE}"
    )


def expand_gated(table: LossTable, gated: Iterable[GateSpec]) -> LossTable:
    """A new table: `table`'s rows plus one derived row per gated candidate (in the given order).

    Candidates the table already derived with the same settings are kept as they are, so
    expanding twice is harmless. A gated name the input itself holds rows for is an error: certkv
    derives those rows, and a second source for the same candidate would be ambiguous. The input
    table is never modified.
    """
    specs = []
    for g in gated:
        if g.policy in table:
            done = table.gated.get(g.policy)
            if done is None:
                raise CertkvError(
                    f"{table.source} has rows for {g.policy!r}, a gated candidate that certkv derives from "
                    f"{g.base_policy!r} and the gate signals; remove those rows (or rename the policy)"
                )
            if (done.base_policy, done.agreement_drop, done.certificate) != (
                g.base_policy, g.agreement_drop, g.certificate
            ):
                raise CertkvError(
                    f"{g.policy!r} was derived with other gate settings; derive it from the records again"
                )
            continue
        if g.base_policy not in table:
            raise CertkvError(
                f"gated candidate {g.policy!r} needs its base {g.base_policy!r}, which has no records in "
                f"{table.source}; calibrate it or remove it from the contract"
            )
        if g.agreement_drop is None and g.certificate is None:
            raise CertkvError(f"{g.policy!r} has no gate setting; it is not a gated candidate")
        specs.append(g)
    if not specs:
        return table

    n_new = len(specs)
    base_rows = np.array([table.index_of(g.base_policy) for g in specs], dtype=np.int64)
    masks = np.stack([
        gated_mask(table, int(row), g.agreement_drop, g.certificate, g.policy)
        for row, g in zip(base_rows, specs)
    ])
    loss = np.where(masks, 0.0, table.loss[base_rows])
    memory = np.where(masks, 1.0, table.memory[base_rows])
    actual = None
    if table.kv_retained_actual is not None:
        actual = np.vstack([table.kv_retained_actual, np.where(masks, 1.0, table.kv_retained_actual[base_rows])])
    cert = None
    if table.certificate_max is not None:
        cert = np.vstack([table.certificate_max, np.full((n_new, table.n_requests), np.nan)])
    counts = masks.sum(axis=1)
    gated_rows = dict(table.gated)
    for g, count in zip(specs, counts.tolist()):
        gated_rows[g.policy] = GatedRow(
            base_policy=g.base_policy,
            agreement_drop=None if g.agreement_drop is None else float(g.agreement_drop),
            certificate=None if g.certificate is None else float(g.certificate),
            gated_count=int(count),
            gated_share=int(count) / table.n_requests,
        )
    return replace(
        table,
        policies=table.policies + tuple(g.policy for g in specs),
        press=table.press + tuple(table.press[int(r)] for r in base_rows),
        kv_retained=np.concatenate([table.kv_retained, table.kv_retained[base_rows]]),
        loss=np.vstack([table.loss, loss]),
        memory=np.vstack([table.memory, memory]),
        kv_retained_actual=actual,
        certificate_max=cert,
        gated=gated_rows,
    )


def expand_for_contract(table: LossTable, contract) -> LossTable:
    """`table` with every gated candidate of `contract` derived (the table itself when it has no
    gate)."""
    gated = contract.gated_candidates()
    return expand_gated(table, gated) if gated else table


def gated_share(table: LossTable, policy: str) -> float:
    """Share of the table's requests the gate of `policy` sends to the full cache (0: ungated)."""
    row = table.gated.get(policy)
    return 0.0 if row is None else row.gated_share


__all__ = ["Derive", "GateSpec", "expand_for_contract", "expand_gated", "gated_mask", "gated_share"]
