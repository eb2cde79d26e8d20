"""`certkv report`: figures and one self-contained HTML page explaining a contract's certificate.

The operating point is recomputed from the records (certification is deterministic and fast), so
the page can never describe a different table than the one it plots; validation results are reused
when a validation.json computed from the same records exists, and computed otherwise. A stratified
contract gets a panel per stratum and, in the summary, the pooled comparison `certkv certify` prints.
"""

from __future__ import annotations

from pathlib import Path

import typer


def report(
    contract_path: Path = typer.Argument(..., metavar="CONTRACT", help="the contract YAML"),
    output: Path | None = typer.Option(None, "--output", "-o", help="output folder; default <store>/report/"),
    records: Path | None = typer.Option(None, "--records", help="use a CSV/JSONL loss table instead of the store"),
    splits: int = typer.Option(1000, "--splits", help="validation splits when no up-to-date validation.json exists"),
    seed: int = typer.Option(0, "--seed", help="seed of the validation splits when they are computed here"),
    allow_incomplete: bool = typer.Option(
        False, "--allow-incomplete", help="use an unfinished store for a preview (no guarantee)"
    ),
) -> None:
    """Write risk_vs_kv.png, per_task.png (per stratum when stratified), validation.png and report.html."""
    from rich.console import Console

    from certkv.calibration.certification import certify_contract_with_comparison, default_output
    from certkv.calibration.validation_file import VALIDATION_FILE, read_validation, run_validation, write_validation
    from certkv.contract.loading import load_contract
    from certkv.report.html import write_report

    console = Console(stderr=True)
    contract = load_contract(contract_path)
    evidence, op, pooled = certify_contract_with_comparison(
        contract, records, contract_label=str(contract_path), allow_incomplete=allow_incomplete
    )
    out_dir = output or default_output(contract, "report")
    notes = _stored_point_note(default_output(contract, "operating_point.json"), op)

    validation = None
    for candidate in (default_output(contract, VALIDATION_FILE), out_dir / VALIDATION_FILE):
        validation = read_validation(candidate, contract, evidence)
        if validation is not None:
            break
    if validation is None:
        console.print(f"no up-to-date {VALIDATION_FILE}; running {splits} validation splits", highlight=False)
        validation = run_validation(contract, evidence, splits=splits, seed=seed)
        write_validation(validation, contract, evidence, out_dir / VALIDATION_FILE)

    paths = write_report(contract, evidence, op, validation, out_dir, notes=notes, pooled=pooled)
    print(f"wrote {paths['report.html']} and {len(paths) - 1} figures to {out_dir}")


def _stored_point_note(path: Path, op) -> list[str]:
    """Warn when the operating point on disk disagrees with the records the report shows."""
    if not path.is_file():
        return []
    from certkv.core.operating_point import load_operating_point
    from certkv.errors import CertkvError

    try:
        stored = load_operating_point(path)
    except CertkvError:
        return [f"{path} could not be read; re-run `certkv certify`"]
    if stored.records_sha256 != op.records_sha256 or stored.contract_sha256 != op.contract_sha256:
        return [f"{path} was certified from other records or another contract (chosen there: {stored.policy}); "
                "this report shows the current records; re-run `certkv certify` to update it"]
    return []
