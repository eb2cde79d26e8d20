"""`certkv serve --replicas N`: the certified runtime as a Ray Serve deployment, one shared monitor.

Each replica is a Ray Serve replica running what one ``certkv serve`` process runs: its own model,
KV budget and scheduler (:class:`~certkv.serve.service.Service`), behind the same FastAPI app
(:func:`certkv.serve.app.create_app`, handed to Ray Serve's ingress: the same routes, errors and
metrics). What differs is the monitor: every replica's
:class:`~certkv.serve.monitor_client.SharedMonitorClient` feeds the one
:class:`~certkv.serve.shared_monitor.SharedMonitor` actor, which holds the one anytime-valid test,
writes the one shadow store and journals every call, so that it restarts with its state. Every
response carries the header ``x-certkv-replica`` (the replica that answered).

An operator composes the deployment in a Ray Serve application of their own with
:func:`replica_app` (docs/scaling.md, "Serving on Ray"); ``certkv serve OP --replicas N`` does it
with :func:`run_replicas` on a local Ray cluster or the one ``--ray-address`` names.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from certkv.errors import CertkvError
from certkv.serve.service import Service

if TYPE_CHECKING:
    from certkv.core.operating_point import OperatingPoint
    from certkv.serve.monitor_client import SharedMonitorClient

log = logging.getLogger("certkv.serve")

#: The header naming the replica that answered.
REPLICA_HEADER = "x-certkv-replica"
#: The Ray Serve application's name under ``certkv serve --replicas``.
APP_NAME = "certkv"


class ReplicaOptions(BaseModel):
    """What every replica is built from: ``certkv serve``'s options, as data that crosses to the replicas.

    ``operating_point`` is the point's path; ``shadow_store`` the store folder on the node that
    runs the shared monitor (default: ``shadow/`` next to the operating point). ``monitor_timeout``
    is how long a replica waits for one reply of the shared monitor before it serves on with the
    state it last saw; ``poll_seconds`` how often it reads that state when it has nothing to send.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    operating_point: str
    model: str = "embedded"
    device: str = "auto"
    shadow_rate: float = Field(0.05, ge=0.0, le=1.0)
    shadow_store: str | None = None
    seed: int = 0
    max_queue: int = Field(64, ge=1)
    timeout: float = Field(60.0, gt=0)
    kv_budget: int | None = Field(None, ge=1)
    kv_budget_mb: float | None = Field(None, gt=0)
    prompt_lookup: bool = True
    prefix_cache_mib: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    api_key: str | None = None
    max_body_bytes: int = Field(4 << 20, ge=1024)
    drain_seconds: float = Field(30.0, ge=0)
    threads: int = Field(1, ge=1)
    poll_seconds: float = Field(0.1, gt=0)
    monitor_timeout: float = Field(5.0, gt=0)

    def point(self) -> OperatingPoint:
        from certkv.core.operating_point import load_operating_point

        return load_operating_point(self.operating_point)

    def store_path(self) -> Path:
        return Path(self.shadow_store) if self.shadow_store else Path(self.operating_point).parent / "shadow"


class ReplicaService(Service):
    """A replica's :class:`Service`: at shutdown, once its shadows are done, it sends the shared
    monitor what it still holds (its own store is the shared monitor's)."""

    client: SharedMonitorClient | None = None

    def shutdown(self, drain_seconds: float = 30.0) -> None:
        super().shutdown(drain_seconds)
        if self.client is not None:
            self.client.close(timeout=max(5.0, drain_seconds))


class ReplicaHeader:
    """Pure ASGI middleware: every HTTP response names the replica that answered (:data:`REPLICA_HEADER`)."""

    def __init__(self, app, replica: str) -> None:
        self.app, self.value = app, replica.encode("latin-1")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), self.value)]}
            await send(message)

        return await self.app(scope, receive, named)


class CertkvReplica:
    """One replica of the deployment (Ray Serve builds its ASGI app with :meth:`__serve_build_asgi_app__`)."""

    def __init__(self, options: ReplicaOptions | dict) -> None:
        self.options = ReplicaOptions.model_validate(options)
        self.name = _replica_name()
        self.service = build_replica_service(self.options, self.name)
        self._app = _replica_asgi(self.service, self.options, self.name)

    def __serve_build_asgi_app__(self):
        return self._app


def _replica_name() -> str:
    """This replica's name: Ray Serve's id of it (new for each start), or the process id outside Serve."""
    try:
        from ray import serve

        return "r" + serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a Serve replica (a test builds one in-process)
        return f"p{os.getpid()}"


def stream_deltas(op: OperatingPoint, shadow_rate: float) -> dict[str, float]:
    """Each monitor stream of `op` and its δ, as the shared monitor runs them."""
    from certkv.serve.shared_monitor import new_risk_monitor

    return {name: s["delta"] for name, s in new_risk_monitor(op, shadow_rate).snapshot().items()}


def actor_sender(name: str, timeout: float):
    """:data:`~certkv.serve.monitor_client.Send` through the shared monitor actor called `name`: one
    call, waited for at most `timeout` seconds (then the client serves on and retries). The actor is
    looked up at the first call and again after a call finds it dead, so a replica can start before
    the monitor and reaches a monitor started anew under the same name."""
    import ray
    from ray.exceptions import RayActorError

    from certkv.serve.shared_monitor import NAMESPACE

    found: list[Any] = []

    def send(replica: str, events: list) -> dict:
        if not found:
            found.append(ray.get_actor(name, namespace=NAMESPACE))
        try:
            return ray.get(found[0].apply.remote(replica, events), timeout=timeout)
        except RayActorError:
            found.clear()
            raise

    return send


def build_replica_service(options: ReplicaOptions, name: str, send=None) -> ReplicaService:
    """The replica's model, runtime, KV budget and service, fed to the shared monitor through
    `send` (default: the running shared monitor actor of the operating point)."""
    import torch

    from certkv.model.loading import load_model
    from certkv.runtime.certified_runtime import CertifiedRuntime
    from certkv.serve.kv_budget import budget_slots, check_prefix_cache, prefix_cache_of
    from certkv.serve.metrics import Metrics
    from certkv.serve.monitor_client import ReplicaShadowRunner, SharedMonitorClient

    torch.set_num_threads(options.threads)
    op = options.point()
    loaded, tokenizer = load_model(options.model, device=options.device)
    runtime = CertifiedRuntime(loaded, tokenizer, op, prefix_cache=prefix_cache_of(options.prefix_cache_mib))
    check_prefix_cache(runtime)
    client = runner = None
    if options.shadow_rate > 0:
        if send is None:
            from certkv.serve.shared_monitor import monitor_actor_name

            send = actor_sender(monitor_actor_name(op), options.monitor_timeout)
        client = SharedMonitorClient(send, risk=op.contract.risk, shadow_rate=options.shadow_rate,
                                     streams=stream_deltas(op, options.shadow_rate), replica=name, seed=options.seed,
                                     poll_seconds=options.poll_seconds)
        client.flush()  # start from the monitor's state (a tripped stream answers from the full cache at once)
        if op.is_stratified or not op.fallback:
            runner = ReplicaShadowRunner(runtime, client)
    service = ReplicaService(runtime, client, runner, None, Metrics(),  # type: ignore[arg-type]
                             max_queue=options.max_queue, prompt_lookup=options.prompt_lookup,
                             kv_budget=budget_slots(loaded, options.kv_budget, options.kv_budget_mb))
    service.client = client
    if client is not None:
        service.metrics.registry.register(_ClientCollector(client))
    return service


def _replica_asgi(service: ReplicaService, options: ReplicaOptions, name: str):
    from certkv.serve.app import create_app

    app = create_app(service, model_id=options.model, operating_point_path=options.operating_point,
                     timeout=options.timeout, api_key=options.api_key, max_body_bytes=options.max_body_bytes,
                     drain_seconds=options.drain_seconds,
                     shadow_store_path=None if service.client is None else str(options.store_path()))
    return ReplicaHeader(app, name)


class _ClientCollector:
    """``certkv_monitor_shared`` (1), ``certkv_monitor_reachable`` and ``certkv_monitor_buffered_events``
    of a replica, read at each scrape."""

    def __init__(self, client: SharedMonitorClient) -> None:
        self.client = client

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily("certkv_monitor_shared", "1: this replica's monitor is the deployment's shared "
                                "monitor", value=1.0)
        yield GaugeMetricFamily("certkv_monitor_reachable", "1 when the last call to the shared monitor was "
                                "answered", value=1.0 if self.client.reachable else 0.0)
        yield GaugeMetricFamily("certkv_monitor_buffered_events", "Monitor events of this replica the shared "
                                "monitor has not acknowledged yet", value=float(self.client.buffered()))


def replica_app(options: ReplicaOptions, *, num_replicas: int = 1, ray_actor_options: dict | None = None,
                deployment_options: dict | None = None):
    """The certified runtime as a bound Ray Serve application: `num_replicas` replicas of
    :class:`CertkvReplica`, and the operating point's shared monitor actor started (or found) on
    this node. Call it on a Ray driver (after ``ray.init``); pass the result to ``serve.run``.

    `ray_actor_options` is each replica's reservation (default one CPU; ``{"num_gpus": 1}`` puts
    one replica per GPU); `deployment_options` goes to ``serve.deployment`` as it is.
    """
    import ray
    from ray import serve

    if options.shadow_rate > 0:
        from certkv.serve.shared_monitor import monitor_actor

        actor = monitor_actor(options.point(), options.store_path(), options.shadow_rate)
        try:
            running = ray.get(actor.settings.remote())  # started (and its journal replayed) before any replica sends
        except ray.exceptions.RayActorError as exc:
            raise CertkvError(f"the shared monitor could not start: {_cause(exc)}") from None
        _check_running_monitor(running, options)
    drain = options.timeout + options.drain_seconds + 10
    settings = {"num_replicas": num_replicas, "ray_actor_options": ray_actor_options or {"num_cpus": options.threads},
                "graceful_shutdown_timeout_s": drain, "max_ongoing_requests": options.max_queue + 8,
                **(deployment_options or {})}
    return serve.deployment(name="certkv", **settings)(serve.ingress()(CertkvReplica)).bind(options.model_dump())


def _check_running_monitor(running: dict, options: ReplicaOptions) -> None:
    """One line when the operating point's monitor, already running from an earlier deployment, was
    started with another store or shadow rate than `options` (replicas would shadow at one rate
    while it tests at another)."""
    store = Path(options.store_path()).resolve()
    if running["shadow_rate"] != options.shadow_rate or Path(running["store_path"]).resolve() != store:
        raise CertkvError(
            f"the shared monitor of this operating point is already running with shadow rate {running['shadow_rate']:g} "
            f"and store {running['store_path']}; serve with those (--shadow-rate, --shadow-store) or stop it first "
            "(ray.kill of the actor named in docs/scaling.md)"
        )


def run_replicas(options: ReplicaOptions, *, replicas: int, host: str, port: int, ray_address: str | None,
                 echo=print) -> None:
    """``certkv serve --replicas``: start Ray (a local cluster, or join `ray_address`), the shared
    monitor and `replicas` replicas behind Ray Serve's HTTP proxy on `host`:`port`; serve until
    SIGTERM or SIGINT, then let the replicas drain, stop the monitor and, for a local cluster, Ray."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise CertkvError('--replicas needs Ray Serve, an optional extra: pip install "certkv[ray]"') from None
    from certkv.serve.shared_monitor import NAMESPACE, monitor_actor_name

    try:
        ray.init(address=ray_address, namespace=NAMESPACE, include_dashboard=False, log_to_driver=True)
    except (ConnectionError, RuntimeError) as exc:
        raise CertkvError(f"cannot join the Ray cluster at --ray-address {ray_address} ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0]}); check the address and that this node may join it") from None
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(replica_app(options, num_replicas=replicas), name=APP_NAME, route_prefix="/", blocking=False)
        shadows = (f"shadow rate {options.shadow_rate:g}, one shared monitor, store {options.store_path()}"
                   if options.shadow_rate > 0 else "no shadows, no monitor")
        echo(f"certkv serve: {options.point().policy} on http://{host}:{port} ({replicas} replicas on Ray Serve, "
             f"model {options.model}, {shadows})")
        _wait_for_stop()
    finally:
        try:
            serve.delete(APP_NAME)  # the replicas drain: live requests, then shadows, then their events
            if options.shadow_rate > 0:
                actor = ray.get_actor(monitor_actor_name(options.point()), namespace=NAMESPACE)
                ray.get(actor.close.remote())
                ray.kill(actor, no_restart=True)
        finally:
            if ray_address is None:
                serve.shutdown()
                ray.shutdown()


def _wait_for_stop() -> None:
    """Block until SIGTERM or SIGINT arrives (Python's handlers, set after ``ray.init``: they replace
    the handlers Ray's driver installs, which would end the process before the replicas drain)."""
    import signal
    import threading

    stop = threading.Event()
    old = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(3600):
            pass
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _cause(exc: BaseException) -> str:
    """The one-line reason inside a Ray actor error (a CertkvError raised in the actor's constructor)."""
    text = str(exc)
    for line in reversed(text.splitlines()):
        if "CertkvError:" in line:
            return line.split("CertkvError:", 1)[1].strip()
    return " ".join(text.split())[:300]


__all__ = ["APP_NAME", "REPLICA_HEADER", "CertkvReplica", "ReplicaHeader", "ReplicaOptions", "ReplicaService",
           "build_replica_service", "replica_app", "run_replicas", "stream_deltas"]
