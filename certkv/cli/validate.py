"""`certkv validate`: repeated calibration/test splits of the records, certkv vs empirical thresholding.

It answers "does the certificate hold on requests it has not seen, and what does the usual
practice (pick the cheapest candidate whose calibration rate is ≤ ε) cost in broken promises?".
A stratified contract is validated per stratum and pooled; the JSON holds both (``by``, ``strata``).
Torch-free: it only reads records.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from certkv.workflow import Validation


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
    from certkv.contract.loading import load_contract
    from certkv.workflow import validate as validate_contract

    result = validate_contract(load_contract(contract_path), contract_label=str(contract_path), splits=splits,
                               calibration_fraction=calibration_fraction, seed=seed, records=records, output=output,
                               allow_incomplete=allow_incomplete)
    show_validation(result)


def show_validation(result: Validation) -> None:
    """What `certkv validate` prints on stdout: both methods' promise-keeping, then the file written."""
    from rich.console import Console

    from certkv.report.console import print_validation
    from certkv.report.tables import say_path

    console = Console()
    print_validation(result.result, console)
    say_path(console, "wrote", result.path)
