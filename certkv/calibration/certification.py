"""From a contract to what the certifier needs: the CertificationSpec and the loss table.

The certifier (`certkv.core.certify`) knows nothing about contracts or stores, so that it can certify
any loss table. The commands `certify`, `validate` and `report` all start the same way: validate
the contract, turn its pre-registered choices into a spec, and load the evidence, either from the
contract's own calibration store or from a plain CSV/JSONL loss table produced by another system.
Doing that in one place keeps the three commands consistent: the same table, hence the same
records hash, the same n and the same decision; :func:`certify_contract` goes one step further,
to the operating point that `certify` writes and `report` explains.

Torch-free: numpy, scipy and pydantic only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from certkv.calibration.store import CalibrationStore, db_path
from certkv.contract.schema import Contract
from certkv.contract.spec import certification_spec
from certkv.core.certify import certify
from certkv.core.loss_table import LossTable, read_loss_table, records_sha256
from certkv.core.operating_point import OperatingPoint
from certkv.core.sampling_unit import draw_pilot
from certkv.core.spec import CertificationSpec
from certkv.errors import CertkvError


@dataclass(frozen=True)
class ContractRecords:
    """The loss table a command certifies, and where it came from.

    ``source`` is shown to users ("store runs/demo" or "loss table losses.csv"). ``skipped`` lists
    requests the calibration skipped (empty for a loss table): they are not part of n, so the
    guarantee covers the requests calibration could run, which reports must say.
    """

    table: LossTable
    source: str
    records_sha256: str
    store_path: Path
    from_store: bool
    skipped: list[dict] = field(default_factory=list)
    incomplete: str | None = None  # "k of n planned requests" when calibration has not finished
    kv_amax: list[list[float]] | None = None  # the pilot's magnitudes placing fp8 pilot scales (kv_scales)


def mark_incomplete(op: OperatingPoint, evidence: ContractRecords) -> OperatingPoint:
    """Strip the guarantee from an operating point computed on an unfinished calibration.

    Certifying, adding requests and certifying again until something passes is optional stopping,
    which voids the binomial guarantee; so a partial store yields a labelled preview, never a
    certificate.
    """
    if evidence.incomplete:
        op.guarantee = (
            f"NO GUARANTEE: calibration is incomplete ({evidence.incomplete}); this is a preview. "
            "Finish `certkv calibrate` and certify again."
        )
        op.notes.insert(0, f"incomplete calibration: {evidence.incomplete}")
    return op


def certify_contract(
    contract: Contract,
    records_file: Path | str | None = None,
    contract_label: str | None = None,
    allow_incomplete: bool = False,
) -> tuple[ContractRecords, OperatingPoint]:
    """Certify `contract` on its evidence: spec, records, certificate, incomplete-store label.

    `certkv certify` and `certkv report` must describe the very same decision, so the one path
    from a validated contract to an operating point lives here: the contract's pre-registered
    spec, the records of :func:`load_records`, the certifier bound to both hashes, and
    :func:`mark_incomplete`, so that no caller can forget to strip the guarantee from a partial
    store.

    Parameters
    ----------
    contract : certkv.contract.schema.Contract
        A validated contract (:func:`certkv.contract.loading.load_contract`).
    records_file : path, optional
        A CSV/JSONL loss table to certify instead of the contract's store.
    contract_label : str, optional
        The contract path as the user typed it, quoted in "run calibrate first" hints.
    allow_incomplete : bool
        Accept an unfinished store; the result is then a labelled preview without guarantee.

    Returns
    -------
    evidence : ContractRecords
        What was certified: its source, hash and skipped requests are shown next to the result.
    operating_point : certkv.core.operating_point.OperatingPoint
        The certified choice (or the full-cache fallback) and every candidate's evidence.

    Raises
    ------
    CertkvError
        No store, an empty store, a store of another contract, an unfinished store without
        `allow_incomplete`, or a loss table that lacks a candidate (one line each).
    """
    evidence = load_records(contract, records_file, contract_label=contract_label, allow_incomplete=allow_incomplete)
    return evidence, _certify_evidence(contract, evidence, _contract_spec(contract, evidence))


def certify_contract_with_comparison(
    contract: Contract,
    records_file: Path | str | None = None,
    contract_label: str | None = None,
    allow_incomplete: bool = False,
) -> tuple[ContractRecords, OperatingPoint, OperatingPoint | None]:
    """:func:`certify_contract` plus :func:`pooled_comparison` of the same evidence.

    `certkv certify`, `certkv report` and `certkv demo` show a stratified certificate next to what
    one pooled certificate of the same records would have chosen; computing both here means the
    three commands print the same two numbers. Returns ``(evidence, operating_point, pooled)``,
    ``pooled`` None for a contract without strata.
    """
    evidence, op = certify_contract(contract, records_file, contract_label, allow_incomplete)
    return evidence, op, pooled_comparison(contract, evidence)


def pooled_comparison(contract: Contract, evidence: ContractRecords) -> OperatingPoint | None:
    """The contract certified on `evidence` with its strata removed, or None when it has none.

    A COMPARISON ONLY, never deployed and never written as the operating point: it answers "what
    would one certificate for the whole mix have chosen?", so a reader can see what stratifying
    bought (or cost). Same spec otherwise (τ, ε, δ, sequences, gates, pilot), same records and
    hashes, and the incomplete-store label when there is one; its first note says what it is.
    """
    spec = _contract_spec(contract, evidence)
    if spec.strata is None:
        return None
    op = _certify_evidence(contract, evidence, spec.model_copy(update={"strata": None}))
    op.notes.insert(0, POOLED_COMPARISON_NOTE.format(by=spec.strata.by))
    return op


#: The first note of :func:`pooled_comparison`'s operating point.
POOLED_COMPARISON_NOTE = (
    "pooled comparison: the contract certified with its {by} strata removed (one certificate "
    "for the whole mix); shown for comparison only, not deployed"
)


def _contract_spec(contract: Contract, evidence: ContractRecords) -> CertificationSpec:
    return preview_spec(certification_spec(contract, evidence.kv_amax), evidence)


def _certify_evidence(contract: Contract, evidence: ContractRecords, spec: CertificationSpec) -> OperatingPoint:
    """Certify `evidence` under `spec`, bound to both hashes, labelled when the store is unfinished."""
    op = certify(evidence.table, spec, contract_sha256=contract.sha256(), records_sha256=evidence.records_sha256)
    return mark_incomplete(op, evidence)


def preview_spec(spec: CertificationSpec, evidence: ContractRecords) -> CertificationSpec:
    """`spec` as certified on `evidence`: on an unfinished store (a preview without guarantee) a
    pilot may leave fewer than the 100 certification requests a guarantee needs, so that
    ``certkv demo --limit 30`` still shows its gates; a finished store keeps the rule."""
    if evidence.incomplete and spec.pilot is not None:
        return spec.model_copy(update={"pilot": spec.pilot.model_copy(update={"min_certification": 1})})
    return spec


def load_records(
    contract: Contract,
    records_file: Path | str | None = None,
    contract_label: str | None = None,
    allow_incomplete: bool = False,
) -> ContractRecords:
    """Load the evidence for `contract`: `records_file` when given, else the contract's store.

    A store calibrated under another contract is refused: its hash is bound to the contract, and
    certifying records against a contract they were not produced under voids the guarantee.
    `contract_label` (the path the user typed) makes the "run calibrate first" hint copy-pastable.
    The table holds the recorded rows only: the certifier and validation derive the contract's
    gated candidates from them in one step (:func:`certkv.core.certify.prepare`: the pilot
    resolved first when there is one, then :func:`certkv.core.gated.derive_gated`), so certify,
    validate and report all see the same candidates; the records hash covers every recorded
    request (pilot included) and the gate signals, not the derived rows.
    """
    store_path = contract.resolved_store_path()
    if records_file is not None:
        table = read_loss_table(records_file)
        return ContractRecords(table, f"loss table {records_file}", records_sha256(table), store_path, False)
    return _load_store(contract, store_path, contract_label or contract.name, allow_incomplete)


def _load_store(contract: Contract, store_path: Path, contract_label: str, allow_incomplete: bool = False) -> ContractRecords:
    hint = f"run `certkv calibrate {contract_label}` first"
    if not db_path(store_path).is_file():
        raise CertkvError(f"no calibration store at {store_path} (contract {contract.name}); {hint}")
    with CalibrationStore.read(store_path) as store:
        stored_sha = store.meta().get("contract_sha256")
        if stored_sha != contract.sha256():
            raise CertkvError(
                f"store {store_path} was calibrated under another contract (sha256 {str(stored_sha)[:12]}, "
                f"this one {contract.sha256()[:12]}); certify it with the contract it was calibrated for, "
                "or recalibrate with `--new-store`"
            )
        records = store.records()
        skipped = store.skipped()
        meta = store.meta()
        planned = meta.get("planned_requests")
    if not records:
        extra = f" ({len(skipped)} requests were skipped)" if skipped else ""
        raise CertkvError(f"calibration store {store_path} has no records yet{extra}; {hint}")
    incomplete = None
    done = len({r["request_id"] for r in records}) + len(skipped)
    if planned is not None and done < int(planned):
        incomplete = f"{done} of {planned} planned requests"
        if not allow_incomplete:
            raise CertkvError(
                f"store {store_path} holds {incomplete}; finish it with `certkv calibrate {contract_label}` "
                "(certifying a partial store and adding requests until something passes voids the "
                "guarantee), or pass --allow-incomplete for a preview without guarantee"
            )
    table = LossTable.from_records(records, source=f"store {store_path}")
    kv_amax = _placed_on_pilot(contract, table, meta, store_path)
    return ContractRecords(table, f"store {store_path}", records_sha256(table), store_path, True, skipped, incomplete,
                           kv_amax)


def _placed_on_pilot(contract: Contract, table: LossTable, meta: dict[str, str], store_path: Path) -> list[list[float]] | None:
    """The store's fp8 pilot magnitudes (None: none placed), checked to have been placed on requests
    the certifier's pilot holds, so that no request that placed a scale certifies."""
    if "kv_pilot_amax" not in meta:
        return None
    gate = contract.gate
    placed_on = set(json.loads(meta.get("kv_pilot_ids", "[]")))
    pilot = set()
    if gate is not None and gate.pilot is not None:
        pilot = set(draw_pilot(table.request_ids, gate.pilot, contract.requests.seed, min_certification=1).pilot_ids)
    leaked = sorted(placed_on & set(table.request_ids) - pilot)
    if leaked:
        raise CertkvError(
            f"store {store_path}: the fp8 scales were placed on request {leaked[0]!r}, which this pilot leaves to certify "
            "(skipped requests moved the pilot); recalibrate with `--new-store`"
        )
    return json.loads(meta["kv_pilot_amax"])


def default_output(contract: Contract, name: str) -> Path:
    """Where a command writes its result when no -o is given: ``<store>/<name>``."""
    return contract.resolved_store_path() / name


__all__ = [
    "POOLED_COMPARISON_NOTE",
    "ContractRecords",
    "certify_contract",
    "certify_contract_with_comparison",
    "default_output",
    "load_records",
    "mark_incomplete",
    "pooled_comparison",
    "preview_spec",
]
