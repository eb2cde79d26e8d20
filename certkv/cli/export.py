"""`certkv export`: write a calibration store's records as CSV or JSONL.

The records are what certification reads; exporting them lets users audit every per-request loss
with their own tools, or hand the table to `certkv certify` on another machine.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import typer


class ExportFormat(StrEnum):
    csv = "csv"
    jsonl = "jsonl"


def export(
    store: Path = typer.Argument(..., help="Store folder, or a contract YAML (its `store:` is used)."),
    format: ExportFormat = typer.Option(ExportFormat.csv, "--format", "-f", help="csv or jsonl."),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Output file ('-' for stdout); default <store>/records.<format>."
    ),
) -> None:
    """Export calibration records (one per request × candidate) to CSV or JSONL."""
    import sys

    from certkv.calibration.store import CalibrationStore, write_records

    folder = store
    if store.suffix.lower() in (".yaml", ".yml"):
        from certkv.contract.loading import load_contract

        folder = load_contract(store).resolved_store_path()
    fmt = format.value
    with CalibrationStore.read(folder) as calib:
        if output is not None and str(output) == "-":
            write_records(calib.records(), sys.stdout, fmt)
            return
        target = output or folder / f"records.{fmt}"
        n = calib.export(target, fmt)
    print(f"wrote {n} records to {target}", file=sys.stderr)
