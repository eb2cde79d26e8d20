"""`certkv calibrate --executor ray`: the calibration requests on Ray actors, the store written here.

Roles. Each worker is a Ray actor that loads the model once (:func:`certkv.calibration.run.load_engine`)
and turns the requests it is handed into their store rows with the very function a local run uses
(:func:`certkv.calibration.run.calibrate_request`); rows travel back as plain dicts. The driver (this
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

import os
import sys
import time
from collections import deque
from dataclasses import dataclass

from certkv.errors import CertkvError
from certkv.interrupts import reclaim

EXTRA = 'pip install "certkv[ray]"'
#: Store facts a worker reports and the store binds: what the worker's answers depend on.
WORKER_FACTS = ("model_fingerprint", "device_type")
#: Seconds without an answer to its ping after which a worker no longer counts as live.
LIVE_WINDOW = 3.0
PING_EVERY = 1.0
WORKER_NAME = "certkv-worker"


def import_ray():
    """The ray module, or a one-line error naming the extra that provides it."""
    try:
        import ray
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


class CalibrationWorker:
    """One model replica: the body of a Ray actor (wrapped by :func:`run_on_ray`).

    Loading happens in ``__init__`` so that a restarted actor is ready again by itself; a load
    failure is kept and reported (an exception there would make Ray restart it forever).
    """

    def __init__(self, contract, device: str | None, dtype: str | None, threads: int):
        import torch

        from certkv.calibration.run import load_engine
        from certkv.model.loading import model_fingerprint, resolve_device

        torch.set_num_threads(threads)
        self.contract = contract
        self.error = None
        self.facts = {"pid": os.getpid()}
        try:
            run_device = resolve_device(device or contract.protocol.device)
            self.facts.update(model_fingerprint=model_fingerprint(contract.model), device_type=run_device.split(":")[0])
            self.engine, self.tokenizer, self.max_positions = load_engine(contract, run_device, dtype)
        except CertkvError as exc:
            self.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the driver as one line
            self.error = f"{type(exc).__name__}: {exc}"

    def describe(self) -> dict:
        """The facts the driver checks (fingerprint, device type, pid) or the load error."""
        return dict(self.facts, error=self.error)

    def ping(self) -> int:
        return os.getpid()

    def calibrate(self, request) -> dict:
        """One request → ``{request_id, rows, skipped, facts}`` or ``{request_id, error}``."""
        from certkv.calibration.run import calibrate_request

        if self.error is not None:
            return {"request_id": request.id, "error": self.error}
        try:
            rows, reason = calibrate_request(request, self.engine, self.tokenizer, self.contract, self.max_positions)
        except CertkvError as exc:
            return {"request_id": request.id, "error": str(exc)}
        return {"request_id": request.id, "rows": rows, "skipped": reason, "facts": self.facts}


def _connect(ray, options: RayOptions) -> bool:
    """Initialise Ray for the driver; True when this call started it (and must shut it down)."""
    import logging

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


def calibrate_on_ray(contract, *, new_store: bool = False, limit: int | None = None, quiet: bool = False,
                     device: str | None = None, dtype: str | None = None, console=None,
                     options: RayOptions | None = None):
    """Calibrate `contract` into its store on Ray actors; returns the
    :class:`~certkv.calibration.run.CalibrationSummary`. Safe to interrupt and rerun, like a local run."""
    from certkv.calibration.run import open_run

    options = options or RayOptions()
    import_ray()  # before anything else: without the extra, one line naming it and nothing created
    options.check()
    store, summary, todo, _ = open_run(contract, new_store=new_store, limit=limit, device=device, dtype=dtype,
                                       executor="ray")
    try:
        if todo:
            run_on_ray(contract, todo, store, summary, device=device, dtype=dtype, options=options, quiet=quiet,
                       console=console)
    finally:
        store.close()
    return summary


def run_on_ray(contract, todo, store, summary, *, device: str | None, dtype: str | None, options: RayOptions,
               quiet: bool = False, console=None) -> None:
    """Calibrate `todo` on Ray actors into the open `store` (the driver: the only writer)."""
    from certkv.calibration.run import _progress, record_request

    ray = import_ray()
    started = _connect(ray, options)
    reclaim()  # ray.init replaced the SIGTERM handler with sys.exit(15): SIGTERM stops the run as Ctrl-C does
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        from ray.exceptions import ActorUnavailableError
    except ImportError:  # older Ray
        ActorUnavailableError = RayActorError  # noqa: N806
    lost_call = (RayActorError, ActorUnavailableError, GetTimeoutError)
    actors = []
    try:
        n_workers = _worker_count(ray, options, len(todo))
        summary.workers = n_workers
        actor_class = ray.remote(
            num_cpus=options.threads_per_worker, num_gpus=options.gpus_per_worker or None,
            max_restarts=-1, max_task_retries=-1,
            # the ping answers from its own thread while a request runs (liveness for the progress bar)
            concurrency_groups={"compute": 1},
        )(CalibrationWorker)
        token = os.urandom(4).hex()
        actors = [
            actor_class.options(name=f"{WORKER_NAME}-{i}-{token}").remote(contract, device, dtype, options.threads_per_worker)
            for i in range(n_workers)
        ]
        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus and not options.gpus_per_worker and (device or contract.protocol.device) != "cpu":
            print(f"certkv: the Ray cluster has {gpus:g} GPUs but --gpus-per-worker is 0: the workers run on CPU",
                  file=sys.stderr)
        bound = {k: v for k, v in store.meta().items() if k in WORKER_FACTS}
        # Longest first: the run ends with short requests, so the last worker to finish waits the
        # least for the others (request-length skew); the records do not depend on the order.
        queue = deque(sorted(todo, key=lambda r: -len(r.context)))
        calls: dict = {}  # ObjectRef -> (kind, worker index, request or None)
        for i, actor in enumerate(actors):
            calls[actor.describe.remote()] = ("describe", i, None)
        ready = [False] * n_workers
        in_flight = [0] * n_workers
        pinging = [False] * n_workers
        last_seen = [0.0] * n_workers
        pids: list[int | None] = [None] * n_workers

        def seen(i: int, pid: int | None) -> None:  # a new pid: Ray restarted the worker
            if pid is not None and pids[i] is not None and pid != pids[i]:
                summary.worker_restarts += 1
            pids[i] = pid if pid is not None else pids[i]
            last_seen[i] = time.monotonic()

        written: set[str] = set()
        t0 = None
        next_ping = 0.0
        with _progress(quiet, console, workers=True) as progress:
            task = progress.add_task("calibrating", total=len(todo), workers=0) if progress else None
            while queue or any(in_flight):
                for i, actor in enumerate(actors):  # hand out: a bounded number in flight per worker
                    while ready[i] and queue and in_flight[i] < options.in_flight:
                        request = queue.popleft()
                        ref = actor.calibrate.options(concurrency_group="compute").remote(request)
                        calls[ref] = ("request", i, request)
                        in_flight[i] += 1
                now = time.monotonic()
                if now >= next_ping:
                    for i, actor in enumerate(actors):
                        if ready[i] and not pinging[i]:
                            calls[actor.ping.remote()] = ("ping", i, None)
                            pinging[i] = True
                    next_ping = now + PING_EVERY
                finished, _ = ray.wait(list(calls), num_returns=1, timeout=0.5)
                for ref in finished:
                    kind, i, request = calls.pop(ref)
                    try:
                        out = ray.get(ref)
                    except lost_call:
                        out = None
                    if kind == "ping":
                        pinging[i] = False
                        if out is not None:
                            seen(i, out)
                        continue
                    if kind == "describe":
                        if out is None:  # a restart is underway: ask again
                            calls[actors[i].describe.remote()] = ("describe", i, None)
                            continue
                        if out.get("error"):
                            raise CertkvError(f"Ray worker {i} could not load the model: {out['error']}")
                        _check_facts(store, bound, out, f"Ray worker {i} (pid {out.get('pid')})")
                        ready[i] = True
                        seen(i, out.get("pid"))
                        t0 = t0 or time.perf_counter()
                        continue
                    in_flight[i] -= 1
                    if out is None:  # the call was lost with its worker: hand the request out again
                        queue.appendleft(request)
                        continue
                    if out.get("error"):
                        raise CertkvError(out["error"])
                    _check_facts(store, bound, out["facts"], f"Ray worker {i} (pid {out['facts'].get('pid')})")
                    seen(i, out["facts"].get("pid"))
                    if out["request_id"] in written:  # a retried call whose first run also came back
                        continue
                    record_request(store, summary, out["request_id"], out["rows"], out["skipped"])
                    written.add(out["request_id"])
                    if progress:
                        progress.advance(task)
                if progress:
                    now = time.monotonic()
                    live = sum(1 for i in range(n_workers) if ready[i] and now - last_seen[i] < LIVE_WINDOW)
                    progress.update(task, workers=live)
        summary.seconds = time.perf_counter() - t0 if t0 else 0.0
    finally:
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - the cluster may already be gone
                pass
        if started:
            ray.shutdown()
