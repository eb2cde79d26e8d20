"""`certkv calibrate --executor ray`: the calibration requests on Ray actors, the store written here.

Roles. Each worker is a Ray actor that loads the model once (:func:`certkv.calibration.run.load_engine`)
and turns the requests it is handed into their store rows with the very function a local run uses
(:func:`certkv.calibration.run.calibrate_request`); rows travel back as plain dicts in a
:class:`RequestOutcome`. The driver (this
process) hands out the requests still missing from the store, a bounded number in flight per
worker, and writes each result as it arrives with :func:`certkv.calibration.run.record_request`:
one transaction per request, and the driver is the store's only writer, so the store's guarantees
(all or nothing per request, resumable, never a duplicate) are the local run's. Requests are
handed out longest first, so that the run does not end waiting on one long request.

Faults. Actors are created with ``max_restarts=-1`` and ``max_task_retries=-1``: Ray restarts a
killed worker (which loads the model again) and runs its in-flight requests again; a request
whose call fails anyway goes back to the queue. A request is written once: the driver skips a
result whose request it has already written, and the store refuses a second write (its primary
key and the "already present" check). A killed driver leaves only committed requests; rerunning
resumes like a local run.

Identity. After loading, every worker reports the model fingerprint
(:func:`certkv.model.loading.model_fingerprint` of its own files) and its device type, and every
result carries them. The first report binds a fresh store; a worker that differs from what the
store records is refused: one line, nothing of it written.

``import ray`` happens only inside this module's functions, so certkv runs without the extra.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from rich.console import Console

# run's functions are looked up on the module at each call, so a patched run.record_request is used (tests/test_ray.py).
from certkv.calibration import run as local_run
from certkv.calibration.progress import progress_bar
from certkv.calibration.run import CalibrationSummary
from certkv.calibration.store import CalibrationStore
from certkv.contract.schema import Contract
from certkv.errors import CertkvError
from certkv.interrupts import reclaim
from certkv.model.loading import model_fingerprint, resolve_device
from certkv.requests.request_set import Request

EXTRA = 'pip install "certkv[ray]"'
#: Store facts a worker reports and the store binds: what the worker's answers depend on.
WORKER_FACTS = ("model_fingerprint", "device_type")
#: Seconds without an answer to its ping after which a worker no longer counts as live.
LIVE_WINDOW = 3.0
PING_EVERY = 1.0
WORKER_NAME = "certkv-worker"


def import_ray() -> ModuleType:
    """The ray module, or a one-line error naming the extra that provides it."""
    try:
        import ray  # here only: Ray is an optional extra, imported when --executor ray asks for it
    except ImportError:
        raise CertkvError(f"--executor ray needs Ray, an optional extra: {EXTRA}") from None
    return ray


@dataclass
class RayOptions:
    """How to run on Ray.

    ``address``: None starts a local Ray instance for the run (unless one is already initialised
    in this process); ``"auto"`` or ``HOST:PORT`` joins an existing cluster. ``workers``: actors to
    start (default: as many as the cluster's CPUs, or GPUs with ``gpus_per_worker``, allow).
    ``gpus_per_worker``: GPUs per actor (Ray places one model replica per GPU with 1).
    ``threads_per_worker``: the CPUs each actor reserves and its torch threads.
    ``in_flight``: requests handed to a worker at once (one running, the next already there).
    """

    address: str | None = None
    workers: int | None = None
    gpus_per_worker: float = 0.0
    threads_per_worker: int = 1
    in_flight: int = 2

    def check(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise CertkvError(f"--workers must be at least 1, got {self.workers}")
        if self.gpus_per_worker < 0:
            raise CertkvError(f"--gpus-per-worker must be 0 or more, got {self.gpus_per_worker}")
        if self.threads_per_worker < 1:
            raise CertkvError(f"--threads-per-worker must be at least 1, got {self.threads_per_worker}")
        if self.in_flight < 1:
            raise CertkvError(f"in_flight must be at least 1, got {self.in_flight}")


@dataclass
class WorkerReport:
    """What a worker reports once loaded (:meth:`CalibrationWorker.describe`): its facts
    (``pid`` and, once known, :data:`WORKER_FACTS`) or the error its load failed with."""

    facts: dict
    error: str | None = None

    @property
    def pid(self) -> int | None:
        return self.facts.get("pid")


@dataclass
class RequestOutcome:
    """One request's result from a worker (:meth:`CalibrationWorker.calibrate`): its store rows
    and skip reason (as :func:`certkv.calibration.run.calibrate_request` returns them) with the
    facts of the worker that computed them, or the error the request failed with."""

    request_id: str
    rows: list | None = None
    skipped: str | None = None
    facts: dict = field(default_factory=dict)
    error: str | None = None


class CalibrationWorker:
    """One model replica: the body of a Ray actor (wrapped by :func:`run_on_ray`).

    Loading happens in ``__init__`` so that a restarted actor is ready again by itself; a load
    failure is kept and reported (an exception there would make Ray restart it forever).
    """

    def __init__(self, contract: Contract, device: str | None, dtype: str | None, threads: int) -> None:
        torch.set_num_threads(threads)
        self.contract = contract
        self.error: str | None = None
        self.facts: dict[str, Any] = {"pid": os.getpid()}
        try:
            run_device = resolve_device(device or contract.protocol.device)
            self.facts.update(model_fingerprint=model_fingerprint(contract.model), device_type=run_device.split(":")[0])
            self.engine, self.tokenizer, self.max_positions = local_run.load_engine(contract, run_device, dtype)
        except CertkvError as exc:
            self.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the driver as one line
            self.error = f"{type(exc).__name__}: {exc}"

    def describe(self) -> WorkerReport:
        """The facts the driver checks (fingerprint, device type, pid) or the load error."""
        return WorkerReport(dict(self.facts), self.error)

    def ping(self) -> int:
        return os.getpid()

    def calibrate(self, request: Request) -> RequestOutcome:
        """One request → its rows, skip reason and this worker's facts, or its error."""
        if self.error is not None:
            return RequestOutcome(request.id, error=self.error)
        try:
            rows, reason = local_run.calibrate_request(request, self.engine, self.tokenizer, self.contract, self.max_positions)
        except CertkvError as exc:
            return RequestOutcome(request.id, error=str(exc))
        return RequestOutcome(request.id, rows, reason, self.facts)


def _connect(ray, options: RayOptions) -> bool:
    """Initialise Ray for the driver; True when this call started it (and must shut it down)."""
    if ray.is_initialized():
        return False
    kwargs = {"logging_level": logging.ERROR, "log_to_driver": False}
    try:
        if options.address is None:
            ray.init(include_dashboard=False, **kwargs)
        else:
            ray.init(address=options.address, **kwargs)
    except ConnectionError as exc:
        raise CertkvError(f"could not reach the Ray cluster at {options.address!r}: {exc}") from None
    return True


def _worker_count(ray, options: RayOptions, n_requests: int) -> int:
    """--workers, or as many as the cluster's resources hold now; refuse a worker that cannot fit."""
    resources = ray.cluster_resources()
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    if options.gpus_per_worker and gpus < options.gpus_per_worker:
        raise CertkvError(f"--gpus-per-worker {options.gpus_per_worker:g}: the Ray cluster has {gpus:g} GPUs")
    if cpus < options.threads_per_worker:
        raise CertkvError(f"--threads-per-worker {options.threads_per_worker}: the Ray cluster has {cpus:g} CPUs")
    if options.workers is not None:
        return options.workers
    fit = int(gpus // options.gpus_per_worker) if options.gpus_per_worker else int(cpus // options.threads_per_worker)
    return max(1, min(fit, n_requests))


def _check_facts(store, bound: dict, reported: dict, who: str) -> None:
    """Refuse a worker whose model or device differs from the store's; bind them on a fresh store."""
    for key in WORKER_FACTS:
        value = str(reported.get(key))
        if key in bound and bound[key] != value:
            raise CertkvError(
                f"{who} has {key} {value!r}, store {store.path} records {bound[key]!r}; it is refused "
                "(every worker must load the same model on the same kind of device; the requests stored so far are kept)"
            )
    new = {k: str(reported[k]) for k in WORKER_FACTS if k not in bound}
    if new:
        store.bind(new)
        bound.update(new)


def calibrate_on_ray(
    contract: Contract,
    *,
    new_store: bool = False,
    limit: int | None = None,
    quiet: bool = False,
    device: str | None = None,
    dtype: str | None = None,
    console: Console | None = None,
    options: RayOptions | None = None,
) -> CalibrationSummary:
    """Calibrate `contract` into its store on Ray actors; returns the
    :class:`~certkv.calibration.run.CalibrationSummary`. Safe to interrupt and rerun, like a local run."""
    options = options or RayOptions()
    import_ray()  # before anything else: without the extra, one line naming it and nothing created
    options.check()
    store, summary, todo, _ = local_run.open_run(
        contract, new_store=new_store, limit=limit, device=device, dtype=dtype, executor="ray"
    )
    try:
        if todo:
            run_on_ray(contract, todo, store, summary, device=device, dtype=dtype, options=options, quiet=quiet, console=console)
    finally:
        store.close()
    return summary


def _lost_call_errors(ray) -> tuple:
    """The exceptions of a call lost with its worker (Ray restarts the worker; the call is asked again)."""
    # here only, as `import ray` in import_ray: Ray is an optional extra
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        from ray.exceptions import ActorUnavailableError
    except ImportError:  # older Ray
        ActorUnavailableError = RayActorError  # noqa: N806
    return (RayActorError, ActorUnavailableError, GetTimeoutError)


def _start_actors(ray, contract, device: str | None, dtype: str | None, options: RayOptions, n_workers: int) -> list:
    """`n_workers` named :class:`CalibrationWorker` actors, restarted by Ray (calls and all) when killed."""
    actor_class = ray.remote(
        num_cpus=options.threads_per_worker,
        num_gpus=options.gpus_per_worker or None,
        max_restarts=-1,
        max_task_retries=-1,
        # the ping answers from its own thread while a request runs (liveness for the progress bar)
        concurrency_groups={"compute": 1},
    )(CalibrationWorker)
    token = os.urandom(4).hex()
    return [
        actor_class.options(name=f"{WORKER_NAME}-{i}-{token}").remote(contract, device, dtype, options.threads_per_worker)
        for i in range(n_workers)
    ]


def _warn_if_gpus_unused(ray, contract, device: str | None, options: RayOptions) -> None:
    gpus = ray.cluster_resources().get("GPU", 0)
    if gpus and not options.gpus_per_worker and (device or contract.protocol.device) != "cpu":
        print(f"certkv: the Ray cluster has {gpus:g} GPUs but --gpus-per-worker is 0: the workers run on CPU", file=sys.stderr)


@dataclass
class _Worker:
    """The driver's record of one actor: loaded or not, its calls in flight, when it last answered."""

    index: int
    actor: Any
    ready: bool = False  # loaded and its facts checked: it is handed requests
    in_flight: int = 0  # its request calls not yet come back
    pinging: bool = False  # a ping not yet answered
    last_seen: float = 0.0  # time.monotonic() of its last answer
    pid: int | None = None  # the process that last answered

    def seen(self, pid: int | None) -> bool:
        """An answer from process `pid` (None: not known); True when the pid is new: Ray restarted the worker."""
        restarted = pid is not None and self.pid is not None and pid != self.pid
        self.pid = pid if pid is not None else self.pid
        self.last_seen = time.monotonic()
        return restarted

    def live(self, now: float) -> bool:
        return self.ready and now - self.last_seen < LIVE_WINDOW

    def who(self, pid: int | None) -> str:
        return f"Ray worker {self.index} (pid {pid})"


@dataclass
class _Call:
    """A remote call not yet come back: ``kind`` is "describe", "ping" or "request" (with its request)."""

    kind: str
    worker: _Worker
    request: Any = None


class _Driver:
    """The loop of :func:`run_on_ray`: hands the requests out, pings the workers, writes each result once."""

    def __init__(self, ray, store, summary, options: RayOptions, actors: list, todo, lost_call: tuple, record_request):
        self.ray, self.store, self.summary, self.options = ray, store, summary, options
        self.lost_call = lost_call
        self.record_request = record_request
        self.workers = [_Worker(i, actor) for i, actor in enumerate(actors)]
        self.bound = {k: v for k, v in store.meta().items() if k in WORKER_FACTS}
        # Longest first: the run ends with short requests, so the last worker to finish waits the
        # least for the others (request-length skew); the records do not depend on the order.
        self.queue = deque(sorted(todo, key=lambda r: -len(r.context)))
        self.calls: dict = {}  # ObjectRef -> _Call
        self.written: set[str] = set()
        self.t0: float | None = None  # when the first worker was ready
        self.next_ping = 0.0
        for worker in self.workers:
            self._describe(worker)

    def run(self, progress, task) -> None:
        """Until every request is written: hand out, ping, handle what came back, show the live workers."""
        while self.queue or any(w.in_flight for w in self.workers):
            self.hand_out()
            self.ping_due()
            finished, _ = self.ray.wait(list(self.calls), num_returns=1, timeout=0.5)
            for ref in finished:
                if self.finish(ref) and progress:
                    progress.advance(task)
            if progress:
                now = time.monotonic()
                progress.update(task, workers=sum(1 for w in self.workers if w.live(now)))

    def seconds(self) -> float:
        return time.perf_counter() - self.t0 if self.t0 else 0.0

    def hand_out(self) -> None:
        """A bounded number of requests in flight per ready worker."""
        for worker in self.workers:
            while worker.ready and self.queue and worker.in_flight < self.options.in_flight:
                request = self.queue.popleft()
                ref = worker.actor.calibrate.options(concurrency_group="compute").remote(request)
                self.calls[ref] = _Call("request", worker, request)
                worker.in_flight += 1

    def ping_due(self) -> None:
        """Every PING_EVERY seconds, ping each ready worker whose last ping has come back."""
        now = time.monotonic()
        if now < self.next_ping:
            return
        for worker in self.workers:
            if worker.ready and not worker.pinging:
                self.calls[worker.actor.ping.remote()] = _Call("ping", worker)
                worker.pinging = True
        self.next_ping = now + PING_EVERY

    def finish(self, ref) -> bool:
        """Handle one finished call; True when it wrote a request."""
        call = self.calls.pop(ref)
        try:
            out = self.ray.get(ref)
        except self.lost_call:
            out = None
        if call.kind == "ping":
            call.worker.pinging = False
            if out is not None:
                self._seen(call.worker, out)
            return False
        if call.kind == "describe":
            self._described(call.worker, out)
            return False
        return self._calibrated(call.worker, call.request, out)

    def _describe(self, worker: _Worker) -> None:
        self.calls[worker.actor.describe.remote()] = _Call("describe", worker)

    def _seen(self, worker: _Worker, pid: int | None) -> None:
        if worker.seen(pid):
            self.summary.worker_restarts += 1

    def _described(self, worker: _Worker, report: WorkerReport | None) -> None:
        """A worker's report: refuse its load error or its facts, or make it ready."""
        if report is None:  # a restart is underway: ask again
            self._describe(worker)
            return
        if report.error:
            raise CertkvError(f"Ray worker {worker.index} could not load the model: {report.error}")
        _check_facts(self.store, self.bound, report.facts, worker.who(report.pid))
        worker.ready = True
        self._seen(worker, report.pid)
        self.t0 = self.t0 or time.perf_counter()

    def _calibrated(self, worker: _Worker, request, outcome: RequestOutcome | None) -> bool:
        """A request's outcome: written once (True), or handed out again when its call was lost."""
        worker.in_flight -= 1
        if outcome is None:  # the call was lost with its worker: hand the request out again
            self.queue.appendleft(request)
            return False
        if outcome.error:
            raise CertkvError(outcome.error)
        pid = outcome.facts.get("pid")
        _check_facts(self.store, self.bound, outcome.facts, worker.who(pid))
        self._seen(worker, pid)
        if outcome.request_id in self.written:  # a retried call whose first run also came back
            return False
        self.record_request(self.store, self.summary, outcome.request_id, outcome.rows, outcome.skipped)
        self.written.add(outcome.request_id)
        return True


def run_on_ray(
    contract: Contract,
    todo: Sequence[Request],
    store: CalibrationStore,
    summary: CalibrationSummary,
    *,
    device: str | None,
    dtype: str | None,
    options: RayOptions,
    quiet: bool = False,
    console: Console | None = None,
) -> None:
    """Calibrate `todo` on Ray actors into the open `store` (the driver: the only writer)."""
    ray = import_ray()
    started = _connect(ray, options)
    reclaim()  # ray.init replaced the SIGTERM handler with sys.exit(15): SIGTERM stops the run as Ctrl-C does
    lost_call = _lost_call_errors(ray)
    actors = []
    try:
        n_workers = _worker_count(ray, options, len(todo))
        summary.workers = n_workers
        actors = _start_actors(ray, contract, device, dtype, options, n_workers)
        _warn_if_gpus_unused(ray, contract, device, options)
        driver = _Driver(ray, store, summary, options, actors, todo, lost_call, local_run.record_request)
        with progress_bar(quiet, console, workers=True) as progress:
            task = progress.add_task("calibrating", total=len(todo), workers=0) if progress else None
            driver.run(progress, task)
        summary.seconds = driver.seconds()
    finally:
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - the cluster may already be gone
                pass
        if started:
            ray.shutdown()
