"""`certkv validate`: repeated calibration/test splits of the records, certkv vs empirical thresholding.

It answers "does the certificate hold on requests it has not seen, and what does the usual
practice (pick the cheapest candidate whose calibration rate is ≤ ε) cost in broken promises?".
A stratified contract is validated per stratum and pooled; the JSON holds both (``by``, ``strata``).
Torch-free: it only reads records.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

VALIDATION_FILE = "validation.json"


def validate(
    contract_path: Path = typer.Argument(..., metavar="CONTRACT", help="the contract YAML"),
    splits: int = typer.Option(1000, "--splits", help="number of random calibration/test splits"),
    calibration_fraction: float = typer.Option(0.5, "--calibration-fraction", help="share of requests in the calibration half"),
    seed: int = typer.Option(0, "--seed", help="seed of the split generator"),
    records: Path | None = typer.Option(None, "--records", help="use a CSV/JSONL loss table instead of the store"),
    output: Path | None = typer.Option(None, "--output", "-o", help="validation JSON; default <store>/validation.json"),
    allow_incomplete: bool = typer.Option(
        False, "--allow-incomplete", help="use an unfinished store for a preview (no guarantee)"
    ),
) -> None:
    """Split the calibration records many times and check both selection methods on the test half."""
    from rich.console import Console

    from certkv.calibration.records import default_output, load_records
    from certkv.contract.loading import load_contract
    from certkv.report.console import print_validation
    from certkv.report.tables import say_path

    contract = load_contract(contract_path)
    evidence = load_records(contract, records, contract_label=str(contract_path), allow_incomplete=allow_incomplete)
    result = run_validation(contract, evidence, splits, calibration_fraction, seed)
    target = output or default_output(contract, VALIDATION_FILE)
    write_validation(result, contract, evidence, target)
    console = Console()
    print_validation(result, console)
    say_path(console, "wrote", target)


def run_validation(contract, evidence, splits: int = 1000, calibration_fraction: float = 0.5, seed: int = 0):
    """certkv.core.validation.validate on the contract's spec and the loaded records."""
    from certkv.calibration.records import preview_spec
    from certkv.contract.spec import certification_spec
    from certkv.core.validation import validate as run

    return run(evidence.table, preview_spec(certification_spec(contract), evidence), n_splits=splits,
               calibration_fraction=calibration_fraction, seed=seed)


def write_validation(result, contract, evidence, path: Path) -> Path:
    """The result plus the hashes it was computed from, so a report can tell a stale file."""
    from certkv.core.spec import delta_of

    data = result.to_dict()
    data["delta"] = delta_of(result.contract.confidence)
    data["contract_sha256"] = contract.sha256()
    data["records_sha256"] = evidence.records_sha256
    from certkv.atomic_io import write_text_atomic

    return write_text_atomic(path, json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def read_validation(path: Path, contract, evidence):
    """A validation.json computed from these very records under this contract, else None.

    The hashes alone do not tell a file that an older certkv wrote for a stratified contract before
    it validated strata (no ``by``, no ``strata``): such a file is stale too, so a report recomputes it.
    """
    from pydantic import ValidationError

    from certkv.core.validation import ValidationResult

    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if data.pop("contract_sha256", None) != contract.sha256() or data.pop("records_sha256", None) != evidence.records_sha256:
        return None
    data.pop("delta", None)
    if data.get("by") != _strata_by(contract):  # written before strata were validated, or under other strata
        return None
    try:
        return ValidationResult.model_validate(data)
    except ValidationError:
        return None


def _strata_by(contract) -> str | None:
    """The field a contract's strata are drawn from, or None for a pooled contract."""
    from certkv.contract.spec import certification_spec

    strata = certification_spec(contract).strata
    return None if strata is None else strata.by
