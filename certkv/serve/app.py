"""The ASGI app of `certkv serve`: the routes, the service's lifetime and OpenAI-shaped errors.

Endpoints (:mod:`certkv.serve.routes`): POST /v1/completions and /v1/chat/completions (OpenAI's
shapes, certkv's extension fields in :mod:`certkv.serve.schemas`, typed responses in
:mod:`certkv.serve.responses`, streams in :mod:`certkv.serve.streaming`), GET /v1/models,
/v1/operating-point, /health and /metrics. In front of them the body limit and the API key
(:mod:`certkv.serve.middleware`). Errors are ``{"error": {"message", "type", "param", "code"}}``:
401, 404, 413 (body over the limit, or a request larger than the whole KV budget), 422 (a schema
error, one line naming the field, or a text that does not split), 400 (the runtime refused the
request), 503 + Retry-After (queue full, or shutting down), 504 (over the per-request timeout), 500
(that request failed; the server stays up).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from certkv.serve.middleware import InFlight, Limits, route_label
from certkv.serve.responses import ErrorResponse
from certkv.serve.routes import build_router, json_response

if TYPE_CHECKING:
    from certkv.serve.metrics import AnswerMetrics
    from certkv.serve.service import Service

log = logging.getLogger("certkv.serve")


def one_line_validation(exc) -> tuple[str, str | None]:
    """A request validation error as one line (``field: what is wrong; ...``) and the first field."""
    parts, first = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc) or "body"
        first = first or field
        msg = err.get("msg", "invalid value")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling"
        parts.append(f"{field}: {msg}")
    return "; ".join(parts), first


def create_app(service: Service, *, model_id: str, operating_point_path: str | None = None, timeout: float = 60.0,
               api_key: str | None = None, max_body_bytes: int = 4 << 20, drain_seconds: float = 30.0,
               shadow_store_path: str | None = None) -> Limits:
    """The app around a started-on-startup :class:`~certkv.serve.service.Service`: the FastAPI app
    behind the body-limit and API-key middleware (an ASGI app)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    metrics = service.metrics
    in_flight = InFlight()

    @asynccontextmanager
    async def lifespan(app):
        service.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, service.shutdown, drain_seconds)

    app = FastAPI(title="certkv serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app, metrics, "certkv serve")
    app.include_router(build_router(service, model_id=model_id, operating_point_path=operating_point_path,
                                    timeout=timeout, shadow_store_path=shadow_store_path, in_flight=in_flight))
    return Limits(app, api_key, max_body_bytes, metrics, in_flight)


def install_error_handlers(app, metrics: AnswerMetrics, server: str) -> None:
    """OpenAI-shaped errors on `app`, each counted in `metrics`: 422 for a schema error (one line
    naming the field), the status of an HTTP error, 500 for a crash (logged; the server stays up).
    ``certkv serve`` and ``certkv gateway`` (`server`, the name in the log) answer alike."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, field = one_line_validation(exc)
        metrics.errors.labels(route_label(request.url.path), "422").inc()
        return json_response(422, ErrorResponse.of(message, "invalid_request_error", field, "invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        metrics.errors.labels(route_label(request.url.path), str(exc.status_code)).inc()
        return json_response(exc.status_code, ErrorResponse.of(str(exc.detail), "invalid_request_error", None,
                                                               str(exc.status_code)))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("%s: %s failed", server, request.url.path)
        metrics.errors.labels(route_label(request.url.path), "500").inc()
        return json_response(500, ErrorResponse.of(f"internal error: {type(exc).__name__}: {exc}", "server_error",
                                                   None, "internal_error"))
