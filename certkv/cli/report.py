"""`certkv report`: figures and one self-contained HTML page explaining a contract's certificate.

The operating point is recomputed from the records (certification is deterministic and fast), so
the page can never describe a different table than the one it plots; validation results are reused
when a validation.json computed from the same records exists, and computed otherwise. A stratified
contract gets a panel per stratum and, in the summary, the pooled comparison `certkv certify` prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from certkv.workflow import Report


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
    from certkv.contract.loading import load_contract
    from certkv.workflow import report as report_contract

    result = report_contract(load_contract(contract_path), contract_label=str(contract_path), output=output,
                             records=records, splits=splits, seed=seed, allow_incomplete=allow_incomplete,
                             notify=notice)
    show_report(result)


def notice(line: str) -> None:
    """A step the report takes (validation splits run here) on stderr, before it takes it."""
    from rich.console import Console

    Console(stderr=True).print(line, highlight=False)


def show_report(result: Report) -> None:
    """What `certkv report` prints on stdout: the page and how many figures, and where."""
    print(f"wrote {result.paths['report.html']} and {len(result.paths) - 1} figures to {result.folder}")
