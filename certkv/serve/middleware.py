"""Pure ASGI middleware in front of `certkv serve`'s routes: the body limit, the API key, the in-flight count.

Both refusals happen before any parsing: with an API key every route but /health needs
``Authorization: Bearer KEY`` (401), and a body over ``--max-body-bytes`` is a 413 whether it
declares its length or arrives chunked. After either, the rest of the body is read and discarded
(bounded) before the response ends, so that a client that writes its whole body first still
reads the answer.
"""

from __future__ import annotations

import asyncio
import hmac
import time

from certkv.serve.responses import ErrorResponse

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/operating-point", "/health", "/metrics")


def route_label(path: str) -> str:
    """A metrics label: the route, or "other" (an unknown path must not grow the label set)."""
    return path if path in ROUTES else "other"


#: After a 401 or 413, the rest of the body is read and discarded up to this much and this long, so
#: that a client that writes its whole body before it reads (Python's urllib) still gets the answer
#: instead of a connection reset (a "lingering close", as web servers do it).
LINGER_BYTES = 64 << 20
LINGER_SECONDS = 10.0


class InFlight:
    """HTTP requests the server has begun to receive and not yet answered (``/health`` aside)."""

    def __init__(self) -> None:
        self.count = 0


class Limits:
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
        path = route_label(scope.get("path", ""))
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        # a client that asked "Expect: 100-continue" sends no body after a refusal: nothing to drain
        unsent = headers.get("expect", "").lower() != "100-continue"
        if self.api_key is not None and path != "/health":
            given = headers.get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                return await self._refuse(path, 401, ErrorResponse.of(
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

    def _too_large_body(self) -> ErrorResponse:
        return ErrorResponse.of(f"request body over the limit of {self.max_body} bytes (--max-body-bytes)",
                                "invalid_request_error", None, "request_too_large")

    async def _refuse(self, path: str, status: int, body: ErrorResponse, receive, send, *, more: bool) -> None:
        """Answer `status` before the body is read, then read and discard what the client still
        sends (bounded by :data:`LINGER_BYTES` and :data:`LINGER_SECONDS`) before the response ends:
        closing the socket while the client is still writing would reset the connection, and a
        client that reads only after it has sent everything would never see the answer."""
        self.metrics.errors.labels(path, str(status)).inc()
        payload = body.model_dump_json().encode()
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
