"""The four steps of certkv as plain functions: calibrate, certify, validate, report.

Each takes a validated contract (:func:`certkv.contract.loading.load_contract`) and returns a typed
result; none prints. The commands of :mod:`certkv.cli` parse their options, call one step and print
its result; ``certkv demo`` calls the four in a row. A program or a notebook calls them the same
way::

    from certkv import workflow
    from certkv.contract.loading import load_contract

    contract = load_contract("contract.yaml")
    workflow.calibrate(contract)
    point = workflow.certify(contract).operating_point

``calibrate`` runs the calibration (:func:`certkv.calibration.driver.run_calibration`) on a local,
Ray or endpoint executor (its summary carries a warning per task that measures nothing); the
executors are imported when a run needs one: importing this module never imports the model stack,
an endpoint contract calibrates without it, and the report's figures are imported by :func:`report`
only, so ``certkv certify`` stays torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from certkv.calibration.certification import (
    ContractRecords,
    certify_contract_with_comparison,
    default_output,
    load_records,
)
from certkv.calibration.validation_file import VALIDATION_FILE, read_validation, run_validation, write_validation
from certkv.contract.schema import Contract
from certkv.core.file_format import FormatVersionError
from certkv.core.operating_point import OperatingPoint
from certkv.core.validation import ValidationResult
from certkv.errors import CertkvError

if TYPE_CHECKING:
    from certkv.calibration.driver import CalibrationSummary, Executor


def calibrate(contract: Contract, *, executor: Executor | None = None, **options: Any) -> CalibrationSummary:
    """Calibrate `contract` into its store (:func:`certkv.calibration.driver.run_calibration`, whose
    `options` these are: new_store, limit, quiet, device, dtype, console, on_written) on `executor`,
    by default the one the contract needs: an endpoint contract's
    (:class:`certkv.calibration.endpoints.EndpointExecutor`, torch-free), else the model in this
    process (:class:`certkv.calibration.run.LocalExecutor`). Safe to interrupt and rerun."""
    from certkv.calibration.driver import run_calibration

    if executor is None and contract.endpoint is not None:
        from certkv.calibration.endpoints import EndpointExecutor

        executor = EndpointExecutor(contract)
    elif executor is None:
        from certkv.calibration.run import LocalExecutor

        executor = LocalExecutor()
    return run_calibration(contract, executor=executor, **options)


#: The operating point's file name in the store folder (``certkv certify``'s default output).
OPERATING_POINT_FILE = "operating_point.json"
#: The report's folder name in the store folder (``certkv report``'s default output).
REPORT_DIR = "report"


@dataclass(frozen=True)
class Certification:
    """What :func:`certify` decided and where it wrote it.

    ``pooled`` is the contract certified without its strata (None without strata): a comparison
    shown beside a stratified point, never deployed nor written.
    """

    evidence: ContractRecords
    operating_point: OperatingPoint
    pooled: OperatingPoint | None
    path: Path


@dataclass(frozen=True)
class Validation:
    """The repeated-split validation of :func:`validate`, and the file it was written to."""

    evidence: ContractRecords
    result: ValidationResult
    path: Path


@dataclass(frozen=True)
class Report:
    """The files :func:`report` wrote (``report.html`` and the figures, by name) into `folder`."""

    paths: dict[str, Path]
    folder: Path


def certify(
    contract: Contract,
    *,
    contract_label: str | None = None,
    records: Path | None = None,
    output: Path | None = None,
    allow_incomplete: bool = False,
) -> Certification:
    """Certify `contract` on its store (or the loss table `records`) and write the operating point
    to `output` (default ``<store>/operating_point.json``); the pooled comparison is not written.

    `contract_label`, the contract's path as the user typed it, makes the "run calibrate first"
    hint copy-pastable. Raises :class:`CertkvError` (one line) for missing or foreign evidence.
    """
    evidence, op, pooled = certify_contract_with_comparison(
        contract, records, contract_label=contract_label, allow_incomplete=allow_incomplete
    )
    target = output or default_output(contract, OPERATING_POINT_FILE)
    op.write_json(target)  # the contract's point only: the pooled comparison is never deployed
    return Certification(evidence, op, pooled, target)


def validate(
    contract: Contract,
    *,
    contract_label: str | None = None,
    splits: int = 1000,
    calibration_fraction: float = 0.5,
    seed: int = 0,
    records: Path | None = None,
    output: Path | None = None,
    allow_incomplete: bool = False,
) -> Validation:
    """Split the contract's records `splits` times, check certkv and empirical thresholding on each
    test half, and write the result to `output` (default ``<store>/validation.json``)."""
    evidence = load_records(contract, records, contract_label=contract_label, allow_incomplete=allow_incomplete)
    result = run_validation(contract, evidence, splits, calibration_fraction, seed)
    target = output or default_output(contract, VALIDATION_FILE)
    write_validation(result, contract, evidence, target)
    return Validation(evidence, result, target)


def report(
    contract: Contract,
    *,
    contract_label: str | None = None,
    output: Path | None = None,
    records: Path | None = None,
    splits: int = 1000,
    seed: int = 0,
    allow_incomplete: bool = False,
    notify: Callable[[str], None] | None = None,
) -> Report:
    """Write the figures and report.html of `contract`'s certificate into `output` (default
    ``<store>/report/``).

    The operating point is certified again from the records, so the page cannot describe another
    table than the one it plots. An up-to-date validation.json (the store's, then the report
    folder's) is reused; otherwise `splits` validation splits run here (`notify` is told so first,
    and of each file of another ``format_version`` passed over) and their file is written into the
    report folder.
    """
    from certkv.report.html import write_report

    evidence, op, pooled = certify_contract_with_comparison(
        contract, records, contract_label=contract_label, allow_incomplete=allow_incomplete
    )
    out_dir = output or default_output(contract, REPORT_DIR)
    notes = stored_point_note(default_output(contract, OPERATING_POINT_FILE), op)
    validation = None
    for candidate in (default_output(contract, VALIDATION_FILE), out_dir / VALIDATION_FILE):
        try:
            validation = read_validation(candidate, contract, evidence)
        except FormatVersionError as exc:  # a cache of a computation this step can redo: say so, redo it
            if notify is not None:
                notify(f"{exc.args[0].split(';')[0]}: not reused")
            continue
        if validation is not None:
            break
    if validation is None:
        if notify is not None:
            notify(f"no up-to-date {VALIDATION_FILE}; running {splits} validation splits")
        validation = run_validation(contract, evidence, splits=splits, seed=seed)
        write_validation(validation, contract, evidence, out_dir / VALIDATION_FILE)
    paths = write_report(contract, evidence, op, validation, out_dir, notes=notes, pooled=pooled)
    return Report(paths, out_dir)


def stored_point_note(path: Path, op: OperatingPoint) -> list[str]:
    """A note when the operating point stored at `path` disagrees with `op`, the one certified from
    the current records (a report shows the records, a server deploys the file); else nothing."""
    if not path.is_file():
        return []
    from certkv.core.operating_point import load_operating_point

    try:
        stored = load_operating_point(path)
    except CertkvError:
        return [f"{path} could not be read; re-run `certkv certify`"]
    if stored.records_sha256 != op.records_sha256 or stored.contract_sha256 != op.contract_sha256:
        return [f"{path} was certified from other records or another contract (chosen there: {stored.policy}); "
                "this report shows the current records; re-run `certkv certify` to update it"]
    return []
