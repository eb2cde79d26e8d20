"""`certkv serve`: answer OpenAI-shaped requests with a certified operating point, monitored live."""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from certkv.errors import CertkvError

if TYPE_CHECKING:
    from collections.abc import Iterator

    import uvicorn

    from certkv.core.operating_point import OperatingPoint


def serve(
    operating_point: Path = typer.Argument(..., metavar="OPERATING_POINT", help="operating_point.json to deploy"),
    model: str = typer.Option("embedded", "--model", help="embedded, a local model folder or a Hugging Face id "
                              "(the model the operating point was calibrated on)"),
    host: str = typer.Option("127.0.0.1", "--host", help="interface to listen on (loopback by default)"),
    port: int = typer.Option(8000, "--port", help="TCP port (1-65535)"),
    shadow_rate: float = typer.Option(0.05, "--shadow-rate", help="share of evicted answers re-answered from the "
                                      "full cache by the live monitor, in [0, 1]; 0: no shadows and no monitor "
                                      "(nothing watches the deployed risk)"),
    api_key_env: str | None = typer.Option(None, "--api-key-env", help="environment variable holding the API key; "
                                    "requests must then send Authorization: Bearer <key>"),
    max_queue: int = typer.Option(64, "--max-queue", help="live requests that may wait; more get 503"),
    timeout: float = typer.Option(60.0, "--timeout", help="seconds per request (queue wait included); then 504"),
    shadow_store: Path | None = typer.Option(None, "--shadow-store", help="folder of the shadow store (records.sqlite, "
                                      "readable by certkv export; default: shadow/ next to the operating point)"),
    seed: int = typer.Option(0, "--seed", help="seed of the shadow coin"),
    max_body_bytes: int = typer.Option(4 << 20, "--max-body-bytes", help="largest request body; more get 413"),
    drain_seconds: float = typer.Option(30.0, "--drain-seconds", help="on SIGTERM, seconds to finish pending "
                                        "shadows before abandoning (and counting) the rest"),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]"),
    kv_budget: int | None = typer.Option(None, "--kv-budget", metavar="TOKENS", help="KV memory the requests in "
                                         "flight may hold, in token slots (one token's KV in every layer); a request "
                                         "waits until its prefill fits; default: unlimited"),
    kv_budget_mb: float | None = typer.Option(None, "--kv-budget-mb", metavar="MIB", help="the same budget in MiB, "
                                              "converted with the model's layers, KV heads, head size and dtype"),
    access_log: bool = typer.Option(False, "--access-log/--no-access-log", help="log one line per HTTP request "
                                    "(off by default: /metrics counts every request and answer)"),
    prompt_lookup: bool = typer.Option(True, "--prompt-lookup/--no-prompt-lookup", help="verify several greedy "
                                       "tokens per forward where an answer copies its context (same answers); off: "
                                       "one token per request per forward"),
    replicas: int | None = typer.Option(None, "--replicas", help="N replicas on Ray Serve, one shared live monitor"),
    ray_address: str | None = typer.Option(None, "--ray-address", help="with --replicas: a Ray cluster (auto, HOST:PORT)"),
    prefix_cache_mib: float = typer.Option(0.0, "--prefix-cache-mib", metavar="MIB", help="keep compressed "
                                           "contexts for later questions on them (a question-agnostic point), up to "
                                           "this many MiB, least recently used evicted first; counted in "
                                           "--kv-budget; 0: off"),
) -> None:
    """Serve OPERATING_POINT over HTTP (OpenAI-shaped /v1/completions and /v1/chat/completions)."""
    from certkv.core.operating_point import load_operating_point

    _check_limits(port, max_queue, timeout, max_body_bytes)
    _check_memory_flags(kv_budget, kv_budget_mb, prefix_cache_mib)
    _check_shadow_rate(shadow_rate)
    api_key = _api_key(api_key_env)
    op = load_operating_point(operating_point)
    if replicas is not None or ray_address is not None:
        return _serve_replicas(replicas, ray_address, operating_point, dict(locals()))
    sock = _bound_socket(host, port)
    try:
        _run(sock, op, operating_point, model=model, host=host, port=port, shadow_rate=shadow_rate, api_key=api_key,
             max_queue=max_queue, timeout=timeout, shadow_store=shadow_store, seed=seed,
             max_body_bytes=max_body_bytes, drain_seconds=drain_seconds, device=device, kv_budget=kv_budget,
             kv_budget_mb=kv_budget_mb, access_log=access_log, prompt_lookup=prompt_lookup,
             prefix_cache_mib=prefix_cache_mib)
    finally:
        sock.close()


#: The options of `serve` every replica of ``--replicas`` gets (:class:`certkv.serve.replicas.ReplicaOptions`).
_REPLICA_OPTIONS = ("model", "device", "shadow_rate", "seed", "max_queue", "timeout", "kv_budget", "kv_budget_mb",
                    "prompt_lookup", "prefix_cache_mib", "api_key", "max_body_bytes", "drain_seconds")


def _serve_replicas(replicas: int | None, ray_address: str | None, operating_point: Path, given: dict) -> None:
    """``--replicas N`` (and ``--ray-address``): the deployment on Ray Serve (:mod:`certkv.serve.replicas`), from
    `given`, the checked options of :func:`serve`."""
    if replicas is None:
        raise CertkvError("--ray-address needs --replicas N (the replicas to start on that cluster)")
    if replicas < 1:
        raise CertkvError(f"--replicas must be at least 1, got {replicas}")
    from certkv.serve.replicas import ReplicaOptions, run_replicas

    host, port, store = given["host"], given["port"], given["shadow_store"]
    config = ReplicaOptions(operating_point=str(operating_point), shadow_store=None if store is None else str(store),
                            **{k: given[k] for k in _REPLICA_OPTIONS})
    run_replicas(config, replicas=replicas, host=host, port=port, ray_address=ray_address,
                 echo=lambda line: typer.echo(line, err=True))
def _check_limits(port: int, max_queue: int, timeout: float, max_body_bytes: int) -> None:
    """One line naming the flag when ``--port``, ``--max-queue``, ``--timeout`` or ``--max-body-bytes`` is out of range."""
    if not 1 <= port <= 65535:
        raise CertkvError(f"--port must be in 1-65535, got {port}")
    if max_queue < 1:
        raise CertkvError(f"--max-queue must be at least 1, got {max_queue}")
    if not timeout > 0:
        raise CertkvError(f"--timeout must be positive seconds, got {timeout}")
    if max_body_bytes < 1024:
        raise CertkvError(f"--max-body-bytes must be at least 1024, got {max_body_bytes}")


def _check_memory_flags(kv_budget: int | None, kv_budget_mb: float | None, prefix_cache_mib: float) -> None:
    """One line naming the flag when ``--kv-budget``, ``--kv-budget-mb`` or ``--prefix-cache-mib`` is unusable."""
    from certkv.serve.kv_budget import check_flags

    check_flags(kv_budget, kv_budget_mb)
    if not (prefix_cache_mib >= 0 and math.isfinite(prefix_cache_mib)):
        raise CertkvError(f"--prefix-cache-mib must be a non-negative number of MiB (0: off), got {prefix_cache_mib}")


def _check_shadow_rate(shadow_rate: float) -> None:
    """--shadow-rate in [0, 1]: 0 turns the monitor off, anything else is the monitor's own rate."""
    if shadow_rate == 0:
        return
    from certkv.core.monitor import check_shadow_rate

    try:
        check_shadow_rate(shadow_rate)
    except CertkvError:
        raise CertkvError(f"--shadow-rate must be in [0, 1] (0: no shadows and no monitor), got {shadow_rate:g}") from None


def _api_key(api_key_env: str | None) -> str | None:
    """The API key from the environment variable `api_key_env` names (None: no key asked for)."""
    if api_key_env is None:
        return None
    api_key = os.environ.get(api_key_env)
    if not api_key:
        raise CertkvError(f"--api-key-env {api_key_env}: that environment variable is not set or empty")
    return api_key


def _bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), before the model loads, so a taken port fails at once."""
    # proto IPPROTO_TCP, not the default 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose
    # proto says TCP, and with Nagle on every keep-alive response waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CertkvError(f"cannot listen on {host}:{port} ({exc.strerror}); choose another --host or --port") from None
    return sock


def _run(sock: socket.socket, op: OperatingPoint, operating_point: Path, *, model: str, host: str, port: int,
         shadow_rate: float, api_key: str | None, max_queue: int, timeout: float, shadow_store: Path | None, seed: int,
         max_body_bytes: int, drain_seconds: float, device: str, kv_budget: int | None = None,
         kv_budget_mb: float | None = None, access_log: bool = False, prompt_lookup: bool = True,
         prefix_cache_mib: float = 0.0) -> None:
    """Load the model, build the service and serve on the bound socket until SIGTERM/SIGINT."""
    import logging

    from certkv.core.monitor import RiskMonitor
    from certkv.core.spec import delta_of
    from certkv.model.loading import load_model
    from certkv.runtime.certified_runtime import CertifiedRuntime
    from certkv.serve.app import create_app
    from certkv.serve.kv_budget import budget_slots, check_prefix_cache, prefix_cache_of
    from certkv.serve.metrics import Metrics
    from certkv.serve.service import Service
    from certkv.serve.shadow import ShadowRunner
    from certkv.serve.shadow_store import ShadowStore

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    loaded, tokenizer = load_model(model, device=device)
    runtime = CertifiedRuntime(loaded, tokenizer, op, prefix_cache=prefix_cache_of(prefix_cache_mib))
    for name, why in check_prefix_cache(runtime).items():
        typer.echo(f"certkv serve: stratum {name} answers without the prefix cache: {why}", err=True)
    budget = budget_slots(loaded, kv_budget, kv_budget_mb)
    streams = None
    if op.strata is not None:  # a stratified point: one monitor stream per stratum
        streams = {name: delta_of(op.strata.confidence) for name in op.strata.entries}
    monitor = None
    if shadow_rate > 0:
        monitor = RiskMonitor(op.contract.risk, delta_of(op.contract.confidence), shadow_rate, seed=seed,
                              streams=streams)
    else:
        logging.getLogger("certkv.serve").warning(
            "--shadow-rate 0: no shadows and no live monitor; nothing watches the deployed risk, and no stream "
            "falls back to the full cache if the certified risk is exceeded")
    store_path = shadow_store or operating_point.parent / "shadow"
    store = runner = None
    if monitor is not None and (op.is_stratified or not op.fallback):  # a fallback point answers from the full cache
        store = ShadowStore(store_path, op)
        runner = ShadowRunner(runtime, monitor, store)
    service = Service(runtime, monitor, runner, store, Metrics(), max_queue=max_queue, kv_budget=budget,
                      prompt_lookup=prompt_lookup)
    app = create_app(service, model_id=model, operating_point_path=str(operating_point), timeout=timeout,
                     api_key=api_key, max_body_bytes=max_body_bytes, drain_seconds=drain_seconds,
                     shadow_store_path=None if monitor is None else str(store_path))
    import uvicorn

    server_class = _graceful_server_class()
    # loop / http "auto": uvloop and httptools (dependencies of certkv) where they import, else
    # asyncio and h11; with no access log they took ~0.25 ms off a request's round trip here.
    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=int(timeout + drain_seconds) + 5,
                            lifespan="on", access_log=access_log, loop="auto", http="auto")
    shadows = f"shadow rate {shadow_rate:g}, store {store_path}" if monitor is not None else "no shadows, no monitor"
    kv = "unlimited" if budget is None else f"{budget} token slots"
    prefix = f", prefix cache {prefix_cache_mib:g} MiB" if runtime.prefix_cache is not None else ""
    typer.echo(f"certkv serve: {op.policy} on http://{host}:{port} (model {model}, {shadows}, KV budget {kv}{prefix})",
               err=True)
    server_class(config).run(sockets=[sock])


def _graceful_server_class() -> type[uvicorn.Server]:
    import contextlib
    import signal
    import threading

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server, but SIGTERM/SIGINT end it with exit code 0 once it has shut down
        gracefully (uvicorn re-raises the signal after its shutdown, which ends the process by
        the signal: a clean, drained stop would look like a crash to a supervisor)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    return GracefulServer
