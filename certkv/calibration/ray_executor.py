"""`certkv calibrate --executor ray`: the calibration requests on Ray actors, the store written here.

Roles. Each worker is a Ray actor that loads the model once (:func:`certkv.calibration.run.load_engine`)
and turns the requests it is handed into their store records with the very function a local run uses
(:func:`certkv.calibration.run.calibrate_request`); records travel back as plain dicts in a
:class:`RequestOutcome`. The driver (this process, :class:`RayExecutor`) hands the requests still
missing from the store to Ray's own actor pool (``ray.util.ActorPool``: one request per worker at a
time, the next handed out the moment a result is fetched) from the moment the first worker has
loaded, each further worker joining the pool when it has (one that Ray cannot place never holds the
run up), and writes each result as it arrives
through the run's :class:`~certkv.calibration.run.Recorder`: one transaction per request, and the
driver is the store's only writer, so the store's guarantees (all or nothing per request,
resumable, never a duplicate) are the local run's. Requests are handed out longest first, so that
the run does not end waiting on one long request.

Faults. Actors are created with ``max_restarts=-1`` and ``max_task_retries=-1``: Ray restarts a
killed worker (which loads the model again) and runs its in-flight request again. A request whose
call fails anyway is handed out again once the pool has drained, until every request is written,
to the workers not dead for good (a call that raised ``ActorDiedError``); when every worker is, the
run stops with :data:`ALL_DIED`.
A request is written once: the driver skips a result whose request it has already written, and the
store refuses a second write (its primary key and the "already present" check). A killed driver
leaves only committed requests; rerunning resumes like a local run.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress, TaskID

from certkv.calibration.progress import progress_bar
from certkv.calibration.run import Recorder, calibrate_request, load_engine
from certkv.contract.schema import Contract
from certkv.errors import CertkvError
from certkv.interrupts import reclaim
from certkv.model.loading import model_fingerprint, resolve_device
from certkv.requests.request_set import Request

EXTRA = 'pip install "certkv[ray]"'
#: Store facts a worker reports and the store binds: what the worker's answers depend on.
WORKER_FACTS = ("model_fingerprint", "device_type")
WORKER_NAME = "certkv-worker"
ALL_DIED = "every Ray worker died; rerun to resume (the requests stored so far are kept)"
#: Longest single wait for a result, in seconds: signals are handled between two waits.
WAIT_SECONDS = 0.5


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
    """

    address: str | None = None
    workers: int | None = None
    gpus_per_worker: float = 0.0
    threads_per_worker: int = 1

    def check(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise CertkvError(f"--workers must be at least 1, got {self.workers}")
        if self.gpus_per_worker < 0:
            raise CertkvError(f"--gpus-per-worker must be 0 or more, got {self.gpus_per_worker}")
        if self.threads_per_worker < 1:
            raise CertkvError(f"--threads-per-worker must be at least 1, got {self.threads_per_worker}")


@dataclass
class WorkerReport:
    """What a worker reports once loaded (:meth:`CalibrationWorker.describe`): its facts
    (``pid``, ``worker`` (its index) and, once known, :data:`WORKER_FACTS`) or the error its load failed with."""

    facts: dict
    error: str | None = None

    @property
    def pid(self) -> int | None:
        return self.facts.get("pid")


@dataclass
class RequestOutcome:
    """One request's result from a worker (:meth:`CalibrationWorker.calibrate`): its store records
    and skip reason (as :func:`certkv.calibration.run.calibrate_request` returns them) with the
    facts of the worker that computed them, or the error the request failed with."""

    request_id: str
    records: list | None = None
    skipped: str | None = None
    facts: dict = field(default_factory=dict)
    error: str | None = None


class CalibrationWorker:
    """One model replica: the body of a Ray actor (wrapped by :meth:`RayExecutor.run`).

    Loading happens in ``__init__`` so that a restarted actor is ready again by itself; a load
    failure is kept and reported (an exception there would make Ray restart it forever).
    """

    def __init__(self, contract: Contract, device: str | None, dtype: str | None, threads: int, index: int = 0) -> None:
        torch.set_num_threads(threads)
        self.contract = contract
        self.error: str | None = None
        self.facts: dict[str, Any] = {"pid": os.getpid(), "worker": index}
        try:
            run_device = resolve_device(device or contract.protocol.device)
            self.facts.update(model_fingerprint=model_fingerprint(contract.local_model), device_type=run_device.split(":")[0])
            self.engine, self.tokenizer, self.max_positions = load_engine(contract, run_device, dtype)
        except CertkvError as exc:
            self.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the driver as one line
            self.error = f"{type(exc).__name__}: {exc}"

    def describe(self) -> WorkerReport:
        """The facts the driver checks (fingerprint, device type, pid, index) or the load error."""
        return WorkerReport(dict(self.facts), self.error)

    def ping(self) -> int:
        """This worker's process id (answered from its own thread, even while a request runs)."""
        return os.getpid()

    def calibrate(self, request: Request) -> RequestOutcome:
        """One request → its records, skip reason and this worker's facts, or its error."""
        if self.error is not None:
            return RequestOutcome(request.id, error=self.error)
        try:
            records, reason = calibrate_request(request, self.engine, self.tokenizer, self.contract, self.max_positions)
        except CertkvError as exc:
            return RequestOutcome(request.id, error=str(exc))
        return RequestOutcome(request.id, records, reason, self.facts)


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


def _lost_call_errors(ray) -> tuple:
    """The exceptions of a call lost with its worker (Ray restarts the worker; the request is handed out again)."""
    # here only, as `import ray` in import_ray: Ray is an optional extra
    from ray.exceptions import RayActorError

    try:
        from ray.exceptions import ActorUnavailableError
    except ImportError:  # older Ray
        ActorUnavailableError = RayActorError  # noqa: N806
    return (RayActorError, ActorUnavailableError)


def _start_actors(ray, contract, device: str | None, dtype: str | None, options: RayOptions, n_workers: int) -> list:
    """`n_workers` named :class:`CalibrationWorker` actors, restarted by Ray (calls and all) when killed."""
    actor_class = ray.remote(
        num_cpus=options.threads_per_worker,
        num_gpus=options.gpus_per_worker or None,
        max_restarts=-1,
        max_task_retries=-1,
        # describe and ping answer from their own thread while a request runs
        concurrency_groups={"compute": 1},
    )(CalibrationWorker)
    token = os.urandom(4).hex()
    return [
        actor_class.options(name=f"{WORKER_NAME}-{i}-{token}").remote(contract, device, dtype, options.threads_per_worker, i)
        for i in range(n_workers)
    ]


def _warn_if_gpus_unused(ray, contract, device: str | None, options: RayOptions) -> None:
    gpus = ray.cluster_resources().get("GPU", 0)
    if gpus and not options.gpus_per_worker and (device or contract.protocol.device) != "cpu":
        print(f"certkv: the Ray cluster has {gpus:g} GPUs but --gpus-per-worker is 0: the workers run on CPU", file=sys.stderr)


class _Driver:
    """The loop of :meth:`RayExecutor.run`: runs the requests through a ``ray.util.ActorPool`` of the
    workers that have loaded, and writes each result once.

    A worker joins the pool the moment its report arrives and passes :func:`_check_facts`, so one
    that Ray cannot place (more workers than the cluster holds, a busy shared cluster) never holds
    the run up. A worker is dead for good when a call to it raises ``ActorDiedError`` (Ray gave up
    restarting it, or it was killed with ``no_restart``): each round's pool is built from the workers
    that have loaded and are not dead, whatever the pool itself does with a dead actor (recent Ray
    drops it from rotation, older Ray keeps handing it calls that fail at once).
    """

    def __init__(self, ray, record: Recorder, actors: list, lost_call: tuple,
                 on_workers: Callable[[int], None] | None = None) -> None:
        self.ray, self.record, self.actors, self.lost_call = ray, record, actors, lost_call
        self.died = ray.exceptions.ActorDiedError
        self.on_workers = on_workers or (lambda n: None)  # called with the live loaded workers, as it changes
        self.bound = {k: v for k, v in record.store.meta().items() if k in WORKER_FACTS}
        self.pids: dict[int, int | None] = {}  # worker index -> the process that last answered
        self.written: set[str] = set()
        self.loading: dict = {}  # describe call -> worker index: the reports not yet in
        self.ready: list[int] = []  # workers loaded and checked, in the order they reported
        self.dead: set[int] = set()  # workers Ray reported dead for good
        self.calls: dict = {}  # this round's request calls -> worker index
        self.pool: Any = None  # this round's ActorPool
        self.t0: float | None = None  # when the first worker was ready

    def seconds(self) -> float:
        return time.perf_counter() - self.t0 if self.t0 else 0.0

    def load(self) -> None:
        """Ask every worker for its report; return once the first has passed (the others join as they report)."""
        self.loading = {actor.describe.remote(): index for index, actor in enumerate(self.actors)}
        while not self.ready:
            self._next_report(WAIT_SECONDS)

    def calibrate(self, todo: Sequence[Request], advance) -> None:
        """Every request of `todo` written once (`advance()` after each); a request whose call was
        lost goes round again."""
        # Longest first: the run ends with short requests, so the last worker to finish waits the
        # least for the others (request-length skew); the records do not depend on the order.
        missing = sorted(todo, key=lambda r: -len(r.context))
        while missing:
            self._round(missing, advance)
            missing = [r for r in missing if r.id not in self.written]

    def _round(self, requests: Sequence[Request], advance) -> None:
        """Each of `requests` handed out once to the live loaded workers; returns when every call has come back."""
        self.calls = {}
        # ray.util is imported by ray itself; ActorPool is its pool of actor handles
        self.pool = self.ray.util.ActorPool([self.actors[i] for i in self.ready if i not in self.dead])
        for request in requests:
            self.pool.submit(self._compute, request)
        left = len(requests)  # calls not yet come back, handed out or waiting for a worker
        while left:
            self._next_report(0.0)  # a worker that has just loaded joins the pool
            if not self.pool.has_next():  # every worker of the pool died: wait for one still loading
                if not self.loading:  # none is (then _dead has raised already): never spin
                    raise CertkvError(ALL_DIED)
                self._next_report(WAIT_SECONDS)
                continue
            try:  # a bounded wait: Ctrl-C and SIGTERM are handled between two waits
                outcome = self.pool.get_next_unordered(timeout=WAIT_SECONDS)
            except TimeoutError:
                continue
            except self.lost_call as exc:  # the request is handed out again in the next round
                left -= 1
                if isinstance(exc, self.died):
                    self._find_dead()
                continue
            left -= 1
            if self._write(outcome):
                advance()

    def _compute(self, actor, request: Request):
        """The pool's call: one request on `actor`, in its compute group (one at a time per worker)."""
        ref = actor.calibrate.options(concurrency_group="compute").remote(request)
        self.calls[ref] = self.actors.index(actor)
        return ref

    def _next_report(self, timeout: float) -> None:
        """Handle one worker's report if one arrives within `timeout` seconds: refuse its load error or
        its facts, or make it ready (and a member of the running pool)."""
        if not self.loading:
            return
        finished, _ = self.ray.wait(list(self.loading), num_returns=1, timeout=timeout)
        if not finished:
            return
        index = self.loading.pop(finished[0])
        try:
            report = self.ray.get(finished[0])
        except self.died:
            self._dead(index)
            return
        except self.lost_call:  # a restart is underway: ask again
            self.loading[self.actors[index].describe.remote()] = index
            return
        if report.error:
            raise CertkvError(f"Ray worker {index} could not load the model: {report.error}")
        _check_facts(self.record.store, self.bound, report.facts, f"Ray worker {index} (pid {report.pid})")
        self._seen(index, report.pid)
        self.ready.append(index)
        self.t0 = self.t0 or time.perf_counter()
        if self.pool is not None:
            self.pool.push(self.actors[index])
        self.on_workers(self._live())

    def _find_dead(self) -> None:
        """After an ``ActorDiedError``: mark dead every worker with a call of this round that came back
        so (the pool does not say whose call failed). A call that has come back is looked at once."""
        refs = list(self.calls)
        finished, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in finished:
            index = self.calls.pop(ref)
            if index in self.dead:
                continue
            try:
                self.ray.get(ref)
            except self.died:
                self._dead(index)
            except self.lost_call:
                pass

    def _dead(self, index: int) -> None:
        self.dead.add(index)
        self.on_workers(self._live())
        if len(self.dead) == len(self.actors):
            raise CertkvError(ALL_DIED)

    def _live(self) -> int:
        return sum(1 for index in self.ready if index not in self.dead)

    def _seen(self, index: int, pid: int | None) -> None:
        """An answer from worker `index`'s process `pid`: a new pid means Ray restarted the worker."""
        last = self.pids.get(index)
        if pid is not None and last is not None and pid != last:
            self.record.summary.worker_restarts += 1
        if pid is not None or index not in self.pids:
            self.pids[index] = pid

    def _write(self, outcome: RequestOutcome) -> bool:
        """A request's outcome written once (True); its error or a refused worker stops the run."""
        if outcome.error:
            raise CertkvError(outcome.error)
        index, pid = outcome.facts.get("worker", -1), outcome.facts.get("pid")
        _check_facts(self.record.store, self.bound, outcome.facts, f"Ray worker {index} (pid {pid})")
        self._seen(index, pid)
        if outcome.request_id in self.written:  # a retried call whose first run also came back
            return False
        self.record(outcome.request_id, outcome.records, outcome.skipped)
        self.written.add(outcome.request_id)
        return True


@dataclass
class _Bar:
    """The progress bar's two updates (no bar: nothing): requests written, workers loaded."""

    progress: Progress | None = None
    task: TaskID | None = None

    def advance(self) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.advance(self.task)

    def workers(self, n: int) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, workers=n)


@dataclass
class RayExecutor:
    """The :class:`~certkv.calibration.run.Executor` on Ray actors: ``calibrate(contract,
    executor=RayExecutor(RayOptions(...)))``. The store is written here; see the module's docstring."""

    options: RayOptions = field(default_factory=RayOptions)
    name: str = field(default="ray", init=False)

    def check(self) -> None:
        import_ray()  # before anything else: without the extra, one line naming it and nothing created
        self.options.check()

    def run(self, contract: Contract, todo: Sequence[Request], record: Recorder, *, device: str | None,
            dtype: str | None, quiet: bool, console: Console | None, kv_amax: list[list[float]] | None = None) -> None:
        """Calibrate `todo` on Ray actors into the run's store (this process: the only writer);
        `kv_amax` is always None here (fp8 pilot scales are placed by the local executor)."""
        ray = import_ray()
        started = _connect(ray, self.options)
        reclaim()  # ray.init replaced the SIGTERM handler with sys.exit(15): SIGTERM stops the run as Ctrl-C does
        actors = []
        try:
            n_workers = _worker_count(ray, self.options, len(todo))
            record.summary.workers = n_workers
            actors = _start_actors(ray, contract, device, dtype, self.options, n_workers)
            _warn_if_gpus_unused(ray, contract, device, self.options)
            with progress_bar(quiet, console, workers=True) as progress:
                bar = _Bar(progress, progress.add_task("calibrating", total=len(todo), workers=0)) if progress else _Bar()
                driver = _Driver(ray, record, actors, _lost_call_errors(ray), bar.workers)
                driver.load()
                driver.calibrate(todo, bar.advance)
            record.summary.seconds = driver.seconds()
        finally:
            for actor in actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - the cluster may already be gone
                    pass
            if started:
                ray.shutdown()
