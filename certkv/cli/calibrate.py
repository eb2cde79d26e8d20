"""`certkv calibrate`: measure every candidate's loss on every calibration request."""

from __future__ import annotations

from pathlib import Path

import typer


def calibrate(
    contract_path: Path = typer.Argument(..., metavar="CONTRACT", help="the contract YAML"),
    limit: int = typer.Option(None, "--limit", help="calibrate at most this many requests of the contract's set"),
    new_store: bool = typer.Option(False, "--new-store", help="move an existing store of another contract aside and start anew"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or summary table"),
    device: str = typer.Option(None, "--device", help="override the contract's device: auto, cpu, cuda[:N]"),
    dtype: str = typer.Option(None, "--dtype", help="override the contract's dtype: auto, float32, bfloat16, float16"),
) -> None:
    """Run the full cache and every candidate policy on the calibration requests; resumable."""
    from rich.console import Console

    from certkv.calibration.run import calibrate as run_calibration
    from certkv.calibration.task_health import failed_task_warnings
    from certkv.contract.loading import load_contract
    from certkv.report.calibration_summary import print_calibration_summary

    console = Console(stderr=True)
    contract = load_contract(contract_path)
    summary = run_calibration(contract, new_store=new_store, limit=limit, quiet=quiet, device=device, dtype=dtype,
                              console=console)
    if quiet:
        typer.echo(f"{summary.calibrated} calibrated, {summary.already_done} already stored, "
                   f"{len(summary.skipped)} skipped -> {summary.store}")
    else:
        print_calibration_summary(contract, summary, console)
    for line in failed_task_warnings(summary.store, contract.model):  # even with --quiet: it voids a task
        typer.echo(f"certkv: {line}", err=True)
