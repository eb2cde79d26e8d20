"""`certkv gateway`: serve an endpoint contract's operating point in front of its servers (torch-free)."""

from __future__ import annotations

from pathlib import Path

import typer

from certkv.errors import CertkvError


def gateway(
    operating_point: Path = typer.Argument(..., metavar="OPERATING_POINT", help="operating_point.json that `certkv "
                                           "certify` wrote for an endpoint contract"),
    contract: Path | None = typer.Option(None, "--contract", help="the endpoint contract the point was certified from "
                                         "(default: the one in the calibration store beside the point)"),
    host: str = typer.Option("127.0.0.1", "--host", help="interface to listen on (loopback by default)"),
    port: int = typer.Option(8000, "--port", help="TCP port (1-65535)"),
    shadow_rate: float = typer.Option(0.05, "--shadow-rate", help="share of kept candidate answers the full endpoint "
                                      "answers too, for the live monitor, in [0, 1]; 0: no shadows and no monitor"),
    api_key_env: str | None = typer.Option(None, "--api-key-env", help="environment variable holding the API key; "
                                           "requests must then send Authorization: Bearer <key>"),
    timeout: float = typer.Option(60.0, "--timeout", help="seconds a call to the full endpoint may take; then 503"),
    candidate_timeout: float = typer.Option(10.0, "--candidate-timeout", help="seconds a call to the candidate may "
                                            "take; then the full endpoint answers"),
    candidate_retry: float = typer.Option(1.0, "--candidate-retry", help="seconds a failed upstream stays out of use "
                                          "before a request tries it again"),
    shadow_store: Path | None = typer.Option(None, "--shadow-store", help="folder of the shadow store (default: "
                                             "gateway-shadow/ next to the operating point)"),
    seed: int = typer.Option(0, "--seed", help="seed of the shadow coin"),
    shadow_concurrency: int = typer.Option(2, "--shadow-concurrency", help="shadows in flight to the full endpoint at "
                                           "once; the rest wait, so escalated requests find it free"),
    shadow_queue: int = typer.Option(1024, "--shadow-queue", help="shadows that may wait for a slot; more are "
                                     "abandoned (counted by the monitor as violations)"),
    max_body_bytes: int = typer.Option(4 << 20, "--max-body-bytes", help="largest request body; more get 413"),
    drain_seconds: float = typer.Option(30.0, "--drain-seconds", help="on SIGTERM, seconds to finish shadows in flight"),
    access_log: bool = typer.Option(False, "--access-log/--no-access-log", help="log one line per HTTP request"),
) -> None:
    """Serve OPERATING_POINT's endpoints as one OpenAI-compatible server: the certified candidate behind its gate,
    the full endpoint otherwise, monitored live (docs/engines.md)."""
    from certkv.cli.serve import _api_key, _bound_socket, _check_limits, _check_shadow_rate
    from certkv.core.operating_point import load_operating_point

    _check_limits(port, 1, timeout, max_body_bytes)
    _check_shadow_rate(shadow_rate)
    for flag, value in (("--candidate-timeout", candidate_timeout), ("--candidate-retry", candidate_retry)):
        if not value > 0:
            raise CertkvError(f"{flag} must be positive seconds, got {value:g}")
    for flag, count, least in (("--shadow-concurrency", shadow_concurrency, 1), ("--shadow-queue", shadow_queue, 0)):
        if count < least:
            raise CertkvError(f"{flag} must be at least {least}, got {count}")
    api_key = _api_key(api_key_env)
    op = load_operating_point(operating_point)
    app, model_id, note = _build(op, operating_point, contract, shadow_rate=shadow_rate, seed=seed, timeout=timeout,
                                 candidate_timeout=candidate_timeout, candidate_retry=candidate_retry,
                                 shadow_store=shadow_store, api_key=api_key, max_body_bytes=max_body_bytes,
                                 drain_seconds=drain_seconds, shadows=(shadow_concurrency, shadow_queue))
    sock = _bound_socket(host, port)
    try:
        _run(app, sock, timeout + candidate_timeout + drain_seconds, access_log, f"{note}, as model {model_id}")
    finally:
        sock.close()


def _build(op, op_path: Path, contract_path: Path | None, *, shadow_rate: float, seed: int, timeout: float,
           candidate_timeout: float, candidate_retry: float, shadow_store: Path | None, api_key: str | None,
           max_body_bytes: int, drain_seconds: float, shadows: tuple[int, int]):
    """(the ASGI app, the model id it answers as, a line saying what it deploys) for `op`; `shadows`:
    (in flight at once, waiting) to the full endpoint."""
    from certkv.gateway.app import create_gateway_app
    from certkv.gateway.gateway import Gateway
    from certkv.gateway.setup import point_contract, upstreams
    from certkv.runtime.gating import deployable
    from certkv.serve.metrics import AnswerMetrics
    from certkv.serve.shadow_store import ShadowStore
    from certkv.serve.shared_monitor import new_risk_monitor

    contract, identities = point_contract(op_path, op, contract_path)
    for entry in op.strata.entries.values() if op.strata is not None else [op]:
        if entry.gate is not None:
            deployable(entry.gate)
    full, candidates = upstreams(op, contract, identities, timeout=timeout, candidate_timeout=candidate_timeout,
                                 retry_after=candidate_retry)
    monitor = new_risk_monitor(op, shadow_rate, seed=seed) if shadow_rate > 0 else None
    store_path = shadow_store or op_path.parent / "gateway-shadow"
    store = ShadowStore(store_path, op) if monitor is not None and (op.is_stratified or not op.fallback) else None
    gw = Gateway(op, full, candidates, contract.route, monitor, store, AnswerMetrics(), contract.asks_logprobs,
                 shadow_concurrency=shadows[0], shadow_queue=shadows[1])
    app = create_gateway_app(gw, model_id=full.name, operating_point_path=str(op_path), api_key=api_key,
                             max_body_bytes=max_body_bytes, drain_seconds=drain_seconds,
                             shadow_store_path=None if store is None else str(store_path))
    said = (f"shadow rate {shadow_rate:g} ({shadows[0]} in flight at most), store {store_path}" if store is not None
            else "no shadows")
    where = ", ".join(f"{p} at {u.url}" for p, u in candidates.items()) or "no candidate"
    return app, full.name, f"{op.policy}: {where}, full cache at {full.url}, {said}"


def _run(app, sock, graceful_seconds: float, access_log: bool, note: str) -> None:
    """Serve `app` on the bound `sock` until SIGTERM/SIGINT (``certkv serve``'s graceful server)."""
    import logging

    import uvicorn

    from certkv.cli.serve import _graceful_server_class

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    host, port = sock.getsockname()[:2]
    typer.echo(f"certkv gateway: {note}, on http://{host}:{port}", err=True)
    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=int(graceful_seconds) + 5, lifespan="on",
                            access_log=access_log, loop="auto", http="auto")
    _graceful_server_class()(config).run(sockets=[sock])
