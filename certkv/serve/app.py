"""The FastAPI app of `certkv serve`: endpoints, API key, body limit and OpenAI-shaped errors.

Endpoints: POST /v1/completions, POST /v1/chat/completions (OpenAI's shapes, certkv's extension
fields in :mod:`certkv.serve.schemas`, a ``certkv`` object in every answer: ``decision`` (the
runtime's Decision record), ``stream`` and ``monitor`` (its stream's monitor state), ``shadowed``,
``request_id``, ``seconds``), GET /v1/models, /v1/operating-point, /health and /metrics. With an
API key every route but /health needs ``Authorization: Bearer KEY`` (401). Errors are
``{"error": {"message", "type", "param", "code"}}``: 401, 404, 413 (body over the limit), 422 (a
schema error, one line naming the field, or a text that does not split), 400 (the runtime refused
the request, e.g. an empty context), 503 + Retry-After (queue full, or shutting down), 504 (over
the per-request timeout), 500 (that request failed; the server stays up). A 401 or 413 is sent
before the body is read; the server then reads and discards the rest of the body (bounded) before
it ends the response, so that a client that writes its whole body first still reads the answer.
``/health`` reports ``in_flight``, the HTTP requests received and not yet answered.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING

from certkv.errors import CertkvError
from certkv.serve.schemas import ChatCompletionRequest, CompletionRequest, SplitError

if TYPE_CHECKING:
    from certkv.serve.service import Service

log = logging.getLogger("certkv.serve")


ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/operating-point", "/health", "/metrics")


def _route(path: str) -> str:
    """A metrics label: the route, or "other" (an unknown path must not grow the label set)."""
    return path if path in ROUTES else "other"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": " ".join(str(message).split()), "type": type_, "param": param, "code": code}}


def _json(status: int, body: dict, headers: dict | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(body, status_code=status, headers=headers)


#: After a 401 or 413, the rest of the body is read and discarded up to this much and this long, so
#: that a client that writes its whole body before it reads (Python's urllib) still gets the answer
#: instead of a connection reset (a "lingering close", as web servers do it).
LINGER_BYTES = 64 << 20
LINGER_SECONDS = 10.0


class InFlight:
    """HTTP requests the server has begun to receive and not yet answered (``/health`` aside)."""

    def __init__(self) -> None:
        self.count = 0


class _Limits:
    """Pure ASGI middleware: the body limit (413) and the bearer key (401), before any parsing;
    it also counts the requests in flight."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics, in_flight: InFlight):
        self.app, self.api_key, self.max_body, self.metrics = app, api_key, max_body_bytes, metrics
        self.in_flight = in_flight

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope.get("path") == "/health":  # the body limit holds there too; the count leaves it out
            return await self._checked(scope, receive, send)
        self.in_flight.count += 1
        try:
            return await self._checked(scope, receive, send)
        finally:
            self.in_flight.count -= 1

    async def _checked(self, scope, receive, send):
        path = _route(scope.get("path", ""))
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        # a client that asked "Expect: 100-continue" sends no body after a refusal: nothing to drain
        unsent = headers.get("expect", "").lower() != "100-continue"
        if self.api_key is not None and path != "/health":
            given = headers.get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                return await self._refuse(path, 401, error_body(
                    "missing or wrong API key; send Authorization: Bearer <key>", "invalid_request_error", None,
                    "invalid_api_key"), receive, send, more=unsent)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await self._refuse(path, 413, self._too_large_body(), receive, send, more=unsent)
        # Read the body here, bounded (a chunked upload has no content-length to check), then replay it.
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                return await self._refuse(path, 413, self._too_large_body(), receive, send, more=more)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _too_large_body(self) -> dict:
        return error_body(f"request body over the limit of {self.max_body} bytes (--max-body-bytes)",
                          "invalid_request_error", None, "request_too_large")

    async def _refuse(self, path: str, status: int, body: dict, receive, send, *, more: bool) -> None:
        """Answer `status` before the body is read, then read and discard what the client still
        sends (bounded by :data:`LINGER_BYTES` and :data:`LINGER_SECONDS`) before the response ends:
        closing the socket while the client is still writing would reset the connection, and a
        client that reads only after it has sent everything would never see the answer."""
        self.metrics.errors.labels(path, str(status)).inc()
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload, "more_body": True})
        drained, deadline = 0, time.monotonic() + LINGER_SECONDS
        while more and drained <= LINGER_BYTES:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                break
            if message["type"] != "http.request":
                break  # the client went away
            drained += len(message.get("body", b""))
            more = message.get("more_body", False)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _one_line_validation(exc) -> tuple[str, str | None]:
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
               shadow_store_path: str | None = None) -> _Limits:
    """The app around a started-on-startup :class:`~certkv.serve.service.Service`: the FastAPI app
    behind the body-limit and API-key middleware (an ASGI app)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from certkv.serve.service import BudgetExceeded, QueueFull, Stopping

    metrics = service.metrics
    op = service.runtime.operating_point
    started_at = time.time()
    in_flight = InFlight()

    @asynccontextmanager
    async def lifespan(app):
        service.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, service.shutdown, drain_seconds)

    app = FastAPI(title="certkv serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, field = _one_line_validation(exc)
        metrics.errors.labels(_route(request.url.path), "422").inc()
        return _json(422, error_body(message, "invalid_request_error", field, "invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        metrics.errors.labels(_route(request.url.path), str(exc.status_code)).inc()
        return _json(exc.status_code, error_body(str(exc.detail), "invalid_request_error", None, str(exc.status_code)))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("certkv serve: %s failed", request.url.path)
        metrics.errors.labels(_route(request.url.path), "500").inc()
        return _json(500, error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", None,
                                     "internal_error"))

    def fail(route: str, status: int, message: str, type_: str, param=None, code=None, headers=None):
        metrics.errors.labels(route, str(status)).inc()
        return _json(status, error_body(message, type_, param, code), headers)

    async def answer(route: str, req, chat: bool):
        if req.model is not None and req.model != model_id:
            return fail(route, 404, f"model {req.model!r} is not served here; this server serves {model_id!r}",
                        "invalid_request_error", "model", "model_not_found")
        try:
            context, question = req.split()
        except SplitError as exc:
            return fail(route, 422, str(exc), "invalid_request_error", exc.param, "unsplittable_prompt")
        max_new = service.runtime.max_new_tokens
        if req.max_tokens is not None and req.max_tokens != max_new:
            return fail(route, 422, f"max_tokens: the operating point is certified for answers of {max_new} tokens; "
                        "omit max_tokens or pass that", "invalid_request_error", "max_tokens", "invalid_value")
        try:
            future = service.submit(context, question, req.stratum, req.reference_answers(), req.answer_prefix)
        except QueueFull:
            return fail(route, 503, f"the queue is full ({service.max_queue} requests waiting); retry later",
                        "server_error", None, "queue_full", {"Retry-After": str(service.retry_after())})
        except Stopping:
            return fail(route, 503, "the server is shutting down", "server_error", None, "shutting_down",
                        {"Retry-After": "5"})
        try:
            served = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
        except TimeoutError:
            future.cancel()  # still queued: never run; running: its answer is discarded
            return fail(route, 504, f"the request took longer than the {timeout:g} s timeout (--timeout)",
                        "server_error", None, "timeout")
        except BudgetExceeded as exc:
            return fail(route, 413, str(exc), "invalid_request_error", None, "kv_budget_exceeded")
        except CertkvError as exc:
            return fail(route, 400, str(exc), "invalid_request_error", None, "refused")
        except Exception as exc:  # noqa: BLE001
            log.exception("certkv serve: request failed")
            return fail(route, 500, f"the request failed: {type(exc).__name__}: {exc}", "server_error", None,
                        "internal_error")
        metrics.observe_answer(route, served.answer.decision, served.seconds, served.waited)
        return respond(served, chat, req.stream)

    def certkv_object(served) -> dict:
        return {"request_id": served.request_id, "decision": served.answer.decision.to_dict(),
                "stream": served.stream, "monitor": served.monitor, "shadowed": served.shadowed,
                "seconds": served.answer.seconds}

    def respond(served, chat: bool, stream: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        text = served.answer.answer
        n_out = len(served.answer.token_ids)
        usage = {"prompt_tokens": served.prompt_tokens, "completion_tokens": n_out,
                 "total_tokens": served.prompt_tokens + n_out}
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_id}
        if not stream:
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": served.finish_reason} if chat else
                      {"index": 0, "text": text, "logprobs": None, "finish_reason": served.finish_reason})
            return _json(200, {**head, "choices": [choice], "usage": usage, "certkv": certkv_object(served)})
        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        pieces = _pieces(service.runtime.tokenizer, served.answer.token_ids, text)

        def chunk(piece, finish, first=False):
            if chat:
                delta = ({"role": "assistant"} if first else {}) | ({"content": piece} if piece is not None else {})
                return {"index": 0, "delta": delta, "finish_reason": finish}
            return {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}

        def events():
            for i, piece in enumerate(pieces or [""]):
                yield f"data: {json.dumps({**head, 'choices': [chunk(piece, None, i == 0)]})}\n\n"
            last = {**head, "choices": [chunk(None, served.finish_reason)], "usage": usage,
                    "certkv": certkv_object(served)}
            yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await answer("/v1/completions", req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        return await answer("/v1/chat/completions", req, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": int(started_at),
                                            "owned_by": "certkv", "certkv": {"policy": op.policy}}]}

    @app.get("/v1/operating-point")
    async def operating_point():
        return op.to_dict()

    @app.get("/health")
    async def health():
        snap = service.monitor.snapshot()
        tripped = [s for s, v in snap.items() if v["tripped"]]
        return {"status": "stopping" if service.stopping else ("tripped" if tripped else "ok"),
                "model": model_id,
                "operating_point": {"path": operating_point_path, "policy": op.policy, "press": op.press,
                                    "kv_retained": op.kv_retained, "fallback": op.fallback,
                                    "stratified": op.is_stratified, "risk": op.contract.risk,
                                    "confidence": op.contract.confidence, "tolerance": op.contract.tolerance,
                                    "utility": op.contract.utility, "query_aware": op.query_aware},
                "queue": {"depth": service.queue_depth(), "max": service.max_queue,
                          "shadow_pending": service.shadow_depth()},
                "in_flight": in_flight.count,
                "kv": {"budget": service.kv_budget, "in_use": service.scheduler.kv_in_use,
                       "peak": service.scheduler.peak_kv, "requests_in_flight": service.scheduler.in_flight(),
                       "admissions_waiting": service.scheduler.waiting(), "decode_steps": service.scheduler.steps,
                       "max_batch": service.scheduler.peak_rows},
                "shadow_rate": service.monitor.shadow_rate, "shadow_store": shadow_store_path,
                "shadows": {"scored": service.shadows_done, "abandoned": service.abandoned},
                "monitor": snap, "tripped": tripped, "uptime_s": round(time.time() - started_at, 3)}

    @app.get("/metrics")
    async def prometheus():
        body, ctype = metrics.render(service)
        return Response(body, media_type=ctype)

    return _Limits(app, api_key, max_body_bytes, metrics, in_flight)


def _pieces(tokenizer, ids: list[int], text: str) -> list[str]:
    """The answer's text cut at token boundaries (each piece the new text its token adds)."""
    out, prev = [], ""
    for i in range(len(ids)):
        cur = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        if cur.startswith(prev) and cur != prev:
            out.append(cur[len(prev):])
            prev = cur
    if prev != text:
        return [text]
    return out
