"""`certkv calibrate`: measure every candidate's loss on every calibration request."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from certkv.calibration.driver import CalibrationSummary, Executor
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
    concurrency: int | None = typer.Option(None, "--concurrency",
                                           help="endpoints: requests in flight (default 4)"),
    retries: int | None = typer.Option(None, "--retries",
                                       help="endpoints: further tries after a connection error, 429 or 5xx (default 8)"),
    probe_every: int | None = typer.Option(None, "--probe-every",
                                           help="endpoints: answered requests between two probes of the full endpoint "
                                                "(default 50)"),
) -> None:
    """Run the full cache and every candidate policy on the calibration requests; resumable.

    With --executor ray, Ray actors each load the model once and run the requests this process
    hands them; this process alone writes the store, one transaction per request, as a local run.
    An endpoint contract (model: {endpoint: URL, name: NAME}) sends every request to its servers
    instead, without loading a model (docs/engines.md).
    """
    from rich.console import Console

    from certkv.contract.loading import load_contract
    from certkv.errors import CertkvError
    from certkv.workflow import calibrate as run_calibration

    console = Console(stderr=True)
    ray = RayGiven(address, workers, gpus_per_worker, threads_per_worker)
    if executor not in ("local", "ray"):
        raise CertkvError(f"--executor must be local or ray, got {executor!r}")
    if executor == "local" and ray.given():
        given = ray.given()
        raise CertkvError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --executor ray")
    contract = load_contract(contract_path)
    endpoint_given = {"--concurrency": concurrency, "--retries": retries, "--probe-every": probe_every}
    if contract.endpoint is not None:
        runner = _endpoint_executor(contract, executor, concurrency, retries, probe_every)
    elif any(v is not None for v in endpoint_given.values()):
        given = [k for k, v in endpoint_given.items() if v is not None]
        raise CertkvError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to endpoint contracts "
                          "(model: {endpoint: URL, name: NAME}) only")
    else:
        runner = ray.executor() if executor == "ray" else _local_executor()
    summary = run_calibration(contract, executor=runner, new_store=new_store, limit=limit, quiet=quiet, device=device,
                              dtype=dtype, console=console)
    show_calibration(contract, summary, quiet, console)


@dataclass(frozen=True)
class RayGiven:
    """The Ray options as given on the command line (None: not given)."""

    address: str | None
    workers: int | None
    gpus_per_worker: float | None
    threads_per_worker: int | None

    def given(self) -> list[str]:
        """The options given, as the user typed them."""
        names = {"address": "--address", "workers": "--workers", "gpus_per_worker": "--gpus-per-worker",
                 "threads_per_worker": "--threads-per-worker"}
        return [flag for key, flag in names.items() if getattr(self, key) is not None]

    def executor(self) -> Executor:
        """The Ray executor of these options (Ray imported when it runs)."""
        from certkv.calibration.ray_executor import RayExecutor, RayOptions

        return RayExecutor(RayOptions(address=self.address, workers=self.workers,
                                      gpus_per_worker=self.gpus_per_worker or 0.0,
                                      threads_per_worker=self.threads_per_worker or 1))


def _local_executor() -> Executor:
    """The model in this process (the calibration run's model side, imported only here)."""
    from certkv.calibration.run import LocalExecutor

    return LocalExecutor()


def _endpoint_executor(contract: Contract, executor: str, concurrency: int | None, retries: int | None,
                       probe_every: int | None) -> Executor:
    """The executor of an endpoint contract, its options from the command line; each retry told on
    stderr (a server that is down is waited for, and the user sees why the run pauses)."""
    from certkv.calibration.endpoints import EndpointExecutor, EndpointOptions
    from certkv.errors import CertkvError

    if executor != "local":
        raise CertkvError("an endpoint contract sends its requests to its servers; --executor ray loads a model: "
                          "remove --executor")
    defaults = EndpointOptions()
    options = EndpointOptions(concurrency=defaults.concurrency if concurrency is None else concurrency,
                              retries=defaults.retries if retries is None else retries,
                              probe_every=defaults.probe_every if probe_every is None else probe_every)

    def on_retry(url: str, why: str, attempt: int, tries: int, wait_s: float) -> None:
        typer.echo(f"certkv: endpoint {url}: {why}; try {attempt} of {tries} failed, retrying in {wait_s:g} s", err=True)

    return EndpointExecutor(contract, options, on_retry=on_retry)


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
