"""`certkv validate`: repeated calibration/test splits of the records, certkv vs empirical thresholding.

It answers "does the certificate hold on requests it has not seen, and what does the usual
practice (pick the cheapest candidate whose calibration rate is ≤ ε) cost in broken promises?".
A stratified contract is validated per stratum and pooled; the JSON holds both (``by``, ``strata``).
Torch-free: it only reads records.
"""

from __future__ import annotations

from pathlib import Path

import typer


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

    from certkv.calibration.certification import default_output, load_records
    from certkv.calibration.validation_file import VALIDATION_FILE, run_validation, write_validation
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
