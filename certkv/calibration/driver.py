"""The calibration run's driver: the store opened and bound, the executor handed the requests
still missing, each outcome written in one transaction. Torch-free.

:func:`run_calibration` is the one loop every executor runs under: :class:`certkv.calibration.run.
LocalExecutor` (the model in this process), :class:`certkv.calibration.ray_executor.RayExecutor`
(Ray actors) and :class:`certkv.calibration.endpoints.EndpointExecutor` (OpenAI-compatible servers,
docs/engines.md). Each turns requests into store records and hands them to a :class:`Recorder`,
which writes them with :func:`record_request` in the process that owns the store, so the store
they leave is the same: all or nothing per request, resumable, never a duplicate. Nothing here
imports the model stack, so that an endpoint contract calibrates without torch (the local
executor's facts, the model's fingerprint and device, are imported where they are needed).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from certkv.calibration.store import CalibrationStore
from certkv.calibration.task_health import failed_task_warnings
from certkv.contract.schema import Contract
from certkv.errors import CertkvError
from certkv.requests.context_groups import group_of
from certkv.requests.request_set import Request, check_strata, stratum_of

if TYPE_CHECKING:
    from rich.console import Console


@dataclass
class CalibrationSummary:
    """What one `calibrate` invocation did."""

    store: str
    total: int = 0
    already_done: int = 0
    calibrated: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    #: time spent writing the store (its transactions, fsync included), summed over the requests
    write_seconds: float = 0.0
    executor: str = "local"
    #: Ray workers the run started (0 on the local executor), and how often Ray restarted one
    workers: int = 0
    worker_restarts: int = 0
    #: one line per task the model fails even with the full cache (it measures no eviction), read
    #: from the store after the run (:func:`certkv.calibration.task_health.failed_task_warnings`)
    warnings: list[str] = field(default_factory=list)


def requests_digest(requests: Iterable[Request]) -> str:
    """sha256 of the request set's content, in order."""
    digest = hashlib.sha256()
    for r in requests:
        digest.update(json.dumps(r.as_record(), sort_keys=True, ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def record_head(
    request: Request, policy: str, press: str, kv: float, kv_actual: float, utility: float, utility_full: float, answer: str
) -> dict:
    """The columns every store record starts with (loss = utility_full − utility), whichever executor made it."""
    return {
        "request_id": request.id,
        "task": request.task,
        "policy": policy,
        "press": press,
        "kv_retained": kv,
        "kv_retained_actual": kv_actual,
        "utility": utility,
        "utility_full": utility_full,
        "loss": utility_full - utility,
        "answer": answer,
    }


def labelled(records: list[dict], request: Request, contract: Contract) -> list[dict]:
    """`records` with the request's labels the contract certifies by: its stratum value when it
    stratifies by a metadata key (a ``stratum`` column), its context group when it groups by context
    (the certificate's unit of sampling, :mod:`certkv.core.grouped`)."""
    by = contract.strata.by if contract.strata is not None else "task"
    for record in records:
        if by != "task":
            record["stratum"] = stratum_of(request, by)
        if contract.requests.group_by == "context":
            record["group"] = group_of(request)
    return records


#: Called after each request is written: (the run's summary so far, the request's id). For a caller
#: that watches the run (a benchmark's timestamps, a test that injects a fault at a known write).
OnWritten = Callable[[CalibrationSummary, str], None]


@dataclass
class Recorder:
    """Writes each request's outcome to the run's store (:func:`record_request`), then tells `on_written`.

    Every executor hands its outcomes to one of these, in the process that owns the store: the
    store has one writer, and the watcher sees every write whichever executor computed it.
    """

    store: CalibrationStore
    summary: CalibrationSummary
    on_written: OnWritten | None = None

    def __call__(self, request_id: str, records: list[dict] | None, reason: str | None) -> None:
        record_request(self.store, self.summary, request_id, records, reason)
        if self.on_written is not None:
            self.on_written(self.summary, request_id)


class Executor(Protocol):
    """Where a calibration's requests run: this process (:class:`LocalExecutor`) or Ray actors
    (:class:`certkv.calibration.ray_executor.RayExecutor`). Both turn a request into its records with
    :func:`calibrate_request` and hand them to the :class:`Recorder`, so the store they leave is the same."""

    #: "local" or "ray": the store binds the model's facts here (local) or from the workers' reports.
    name: str

    def check(self) -> None:
        """Fail fast, before the store is opened: a missing extra, an impossible option (one line)."""

    def run(self, contract: Contract, todo: Sequence[Request], record: Recorder, *, device: str | None,
            dtype: str | None, quiet: bool, console: Console | None, kv_amax: list[list[float]] | None = None) -> None:
        """Calibrate `todo`, handing each outcome to `record`; set ``record.summary.seconds``;
        `kv_amax`: the pilot's magnitudes that place fp8 pilot scales (:mod:`certkv.calibration.kv_scales`).

        `device` is resolved on the local executor, the user's override (or None) on Ray."""


def run_calibration(
    contract: Contract,
    *,
    executor: Executor,
    new_store: bool = False,
    limit: int | None = None,
    quiet: bool = False,
    device: str | None = None,
    dtype: str | None = None,
    console: Console | None = None,
    on_written: OnWritten | None = None,
) -> CalibrationSummary:
    """Calibrate `contract` into its store with `executor`; returns a summary, with a warning per
    task that measures nothing. Safe to interrupt and rerun. :func:`certkv.workflow.calibrate`
    chooses the executor a contract needs and calls this.

    Parameters
    ----------
    contract : certkv.contract.schema.Contract
        A validated contract; its store is opened (created, or resumed) here.
    executor : Executor
        Where the requests run: :class:`certkv.calibration.run.LocalExecutor`,
        :class:`certkv.calibration.ray_executor.RayExecutor` or, for an endpoint contract,
        :class:`certkv.calibration.endpoints.EndpointExecutor`. The records do not depend on where.
    new_store : bool
        Move an existing store of another contract aside and start anew.
    limit : int, optional
        Calibrate at most this many requests of the contract's set (a preview).
    quiet : bool
        No progress bar.
    device, dtype : str, optional
        Override the contract's device and dtype (in-process executors).
    console : rich.console.Console, optional
        Where the progress bar goes.
    on_written : callable, optional
        Called after each request is written, with the summary and the request's id.
    """
    executor.check()  # before the store: a missing extra leaves nothing created
    store, summary, todo, run_device = open_run(
        contract, new_store=new_store, limit=limit, device=device, dtype=dtype, executor=executor.name
    )
    try:
        kv_amax = None
        if contract.endpoint is None:  # fp8 scales placed on the pilot: the model's own magnitudes
            from certkv.calibration.kv_scales import placed_amax

            kv_amax = placed_amax(contract, store, contract.load_requests(), run_device, dtype, executor.name)
        if todo:
            executor.run(contract, todo, Recorder(store, summary, on_written), device=run_device or device,
                         dtype=dtype, quiet=quiet, console=console, kv_amax=kv_amax)
    finally:
        store.close()
    model = contract.endpoint.name if contract.endpoint is not None else contract.local_model
    summary.warnings = failed_task_warnings(summary.store, model)
    return summary


def open_run(
    contract: Contract,
    *,
    new_store: bool = False,
    limit: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
    executor: str = "local",
) -> tuple[CalibrationStore, CalibrationSummary, list[Request], str | None]:
    """(store, summary, todo, device): the contract's store opened and bound to this run's facts,
    the requests still missing from it, in order, and the resolved device; the caller closes the store.

    On the local executor the device is resolved and the model fingerprinted here; on Ray (device
    None returned) the workers that load the model report both, and the driver binds and checks them;
    an endpoint executor binds the servers' identities and the probe's answer
    (:mod:`certkv.calibration.endpoints`).
    """
    if limit is not None and limit < 1:
        raise CertkvError(f"--limit must be at least 1, got {limit}")
    requests = contract.load_requests()
    if contract.strata is not None:  # before the model and the store: a missing stratum fails fast
        check_strata(requests, contract.strata.by)
    run_device = None
    facts: dict[str, Any] = {
        # The population the certificate is about: its size lets certify refuse a partial store.
        "planned_requests": len(requests),
        "requests_sha256": requests_digest(requests),
    }
    if executor == "local":  # the model in this process: its files and device bind the store here
        from certkv.model.loading import model_fingerprint, resolve_device

        run_device = resolve_device(device or contract.protocol.device)
        facts.update(model_fingerprint=model_fingerprint(contract.local_model), device_type=run_device.split(":")[0])
    if executor != "endpoint":  # an endpoint's identity and probe answer are bound by its executor
        facts["dtype"] = dtype or contract.protocol.dtype
    if limit is not None:
        requests = requests[:limit]
    store = CalibrationStore.open(contract.resolved_store_path(), contract, new=new_store)
    summary = CalibrationSummary(store=str(store.path), total=len(requests), executor=executor)
    try:
        store.bind(facts)
        done = store.done_request_ids()
    except BaseException:
        store.close()
        raise
    todo = [r for r in requests if r.id not in done]
    summary.already_done = len(requests) - len(todo)
    return store, summary, todo, run_device


def record_request(
    store: CalibrationStore, summary: CalibrationSummary, request_id: str, records: list[dict] | None, reason: str | None
) -> None:
    """Write one request's outcome in one transaction (its records, or its skip reason) and count it."""
    t0 = time.perf_counter()
    if reason is not None:
        store.write_skipped(request_id, reason)
        summary.skipped[request_id] = reason
    else:
        assert records is not None  # calibrate_request returns records or a skip reason
        store.write_request(request_id, records)
        summary.calibrated += 1
    summary.write_seconds += time.perf_counter() - t0
