"""`certkv calibrate`: measure every candidate's loss on every calibration request."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from certkv.calibration.run import CalibrationSummary
    from certkv.contract.schema import Contract


def calibrate(
    contract_path: Path = typer.Argument(..., metavar="CONTRACT", help="the contract YAML"),
    limit: int | None = typer.Option(None, "--limit", help="calibrate at most this many requests of the contract's set"),
    new_store: bool = typer.Option(False, "--new-store", help="move an existing store of another contract aside and start anew"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or summary table"),
    device: str | None = typer.Option(None, "--device", help="override the contract's device: auto, cpu, cuda[:N]"),
    dtype: str | None = typer.Option(None, "--dtype", help="override the contract's dtype: auto, float32, bfloat16, float16"),
    executor: str = typer.Option("local", "--executor", metavar="local|ray",
                                 help="where requests run: this process, or Ray actors (needs certkv's ray extra)"),
    address: str | None = typer.Option(None, "--address", metavar="auto|HOST:PORT",
                                help="Ray: join this cluster (default: start a local Ray instance for the run)"),
    workers: int | None = typer.Option(None, "--workers",
                                       help="Ray: model replicas to start (default: as many as the cluster fits)"),
    gpus_per_worker: float | None = typer.Option(None, "--gpus-per-worker",
                                                 help="Ray: GPUs per replica (1: one replica per GPU)"),
    threads_per_worker: int | None = typer.Option(None, "--threads-per-worker",
                                                  help="Ray: CPUs and torch threads per replica (default 1)"),
) -> None:
    """Run the full cache and every candidate policy on the calibration requests; resumable.

    With --executor ray, Ray actors each load the model once and run the requests this process
    hands them; this process alone writes the store, one transaction per request, as a local run.
    """
    from rich.console import Console

    from certkv.calibration.run import Executor, LocalExecutor
    from certkv.contract.loading import load_contract
    from certkv.errors import CertkvError
    from certkv.workflow import calibrate as run_calibration

    console = Console(stderr=True)
    ray_given = {"--address": address, "--workers": workers, "--gpus-per-worker": gpus_per_worker,
                 "--threads-per-worker": threads_per_worker}
    runner: Executor = LocalExecutor()
    if executor == "ray":
        from certkv.calibration.ray_executor import RayExecutor, RayOptions

        runner = RayExecutor(RayOptions(address=address, workers=workers, gpus_per_worker=gpus_per_worker or 0.0,
                                        threads_per_worker=threads_per_worker or 1))
    elif executor != "local":
        raise CertkvError(f"--executor must be local or ray, got {executor!r}")
    elif any(v is not None for v in ray_given.values()):
        given = [k for k, v in ray_given.items() if v is not None]
        raise CertkvError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --executor ray")
    contract = load_contract(contract_path)
    summary = run_calibration(contract, executor=runner, new_store=new_store, limit=limit, quiet=quiet, device=device,
                             dtype=dtype, console=console)
    show_calibration(contract, summary, quiet, console)


def show_calibration(contract: Contract, summary: CalibrationSummary, quiet: bool, console: Console) -> None:
    """What `certkv calibrate` prints: the summary table on `console` (one line on stdout when
    `quiet`), then each failed-task warning on stderr, even when quiet: such a task voids itself."""
    from certkv.report.calibration_summary import print_calibration_summary

    if quiet:
        typer.echo(f"{summary.calibrated} calibrated, {summary.already_done} already stored, "
                   f"{len(summary.skipped)} skipped -> {summary.store}")
    else:
        print_calibration_summary(contract, summary, console)
    for line in summary.warnings:
        typer.echo(f"certkv: {line}", err=True)
