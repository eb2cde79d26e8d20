"""The ASGI app of ``certkv gateway``: ``certkv serve``'s routes, request schemas, errors, streams and
metrics in front of endpoints instead of a model.

What is shared, not copied: the request schemas and their refusals (:mod:`certkv.serve.schemas`),
the response shapes (:mod:`certkv.serve.responses`), the body limit and API key
(:mod:`certkv.serve.middleware`), the error handlers (:func:`certkv.serve.app.install_error_handlers`),
the stream's chunks (:mod:`certkv.serve.streaming`), the cut (:mod:`certkv.serve.answer_cut`)
and the answer and monitor metrics (:class:`certkv.serve.metrics.AnswerMetrics`). What differs:
a token limit above the certified decode length is not refused but answered by the full endpoint
(``uncovered``), and two errors are the gateway's own: 503 ``full_endpoint_unavailable`` (a request
that needs the full endpoint while it is down, one line naming the URL, why it failed and why the
request needed it; with Retry-After) and an upstream's own 4xx, passed on with its message.

Streaming and the gate. The candidate's answer is gated after it is decoded, on its
log-probabilities, so a streamed request is held until the gate decides: the candidate is asked
for its whole answer, and a kept answer is flushed at once, chunk per token; an answer the full
endpoint gives (escalated, fallback, uncovered, tripped, candidate down) streams as the full
endpoint decodes it. Streaming the candidate's tokens and escalating later requests instead would
hand clients answers the gate would have replaced, which the certificate does not cover. The cost
is the time to first token of a kept answer: the candidate's whole answer time instead of its
first token's (docs/benchmarks.md, "Gateway").
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Literal

from certkv.gateway.gateway import Ask, FullDown, Gateway, Plan, Served
from certkv.gateway.upstream import UpstreamAnswer, UpstreamDown, UpstreamRefused, UpstreamState
from certkv.serve.answer_cut import Cut, chat_logprobs, completion_logprobs
from certkv.serve.app import install_error_handlers
from certkv.serve.middleware import InFlight, Limits
from certkv.serve.responses import (
    CertkvInfo,
    ChatChoice,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    MonitoredHealth,
    PointSummary,
    ShadowCounts,
    Usage,
)
from certkv.serve.routes import add_openai_routes, json_response
from certkv.serve.schemas import ChatCompletionRequest, CompletionRequest, SplitError
from certkv.serve.streaming import Chunks, sse_events

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from certkv.runtime.decision import Decision

log = logging.getLogger("certkv.gateway")

#: Longer than any answer: the gateway refuses no token limit (one above the certified length is uncovered).
_NO_LENGTH_LIMIT = 1 << 30


class GatewayHealth(MonitoredHealth):
    """GET /health of ``certkv gateway``: ``status`` ``ok``; ``candidate_down`` (a candidate's last call
    failed: its requests are answered by the full endpoint); ``full_down`` (requests that need the
    full endpoint get 503); ``tripped`` (a monitor stream tripped). The upstreams' state (``full``,
    ``candidates`` by policy) beside :class:`~certkv.serve.responses.MonitoredHealth`'s fields."""

    status: Literal["ok", "candidate_down", "full_down", "tripped"]
    full: UpstreamState
    candidates: dict[str, UpstreamState]


class GatewayRoutes:
    """What the routes share: the :class:`Gateway`, the model id they answer as, the point's path,
    the shadow store's path and the in-flight count."""

    def __init__(self, gateway: Gateway, model_id: str, operating_point_path: str, shadow_store_path: str | None,
                 in_flight: InFlight) -> None:
        self.gateway, self.model_id, self.in_flight = gateway, model_id, in_flight
        self.operating_point_path, self.shadow_store_path = operating_point_path, shadow_store_path
        self.metrics = gateway.metrics
        self.started_at = time.time()

    def fail(self, route: str, status: int, message: str, type_: str, param=None, code=None, headers=None):
        self.metrics.errors.labels(route, str(status)).inc()
        return json_response(status, ErrorResponse.of(message, type_, param, code), headers)

    def ask_of(self, route: str, req: CompletionRequest | ChatCompletionRequest):
        """The :class:`Ask` of `req`, or the error for what the schemas cannot check (as ``certkv serve``)."""
        if req.model is not None and req.model != self.model_id:
            return self.fail(route, 404, f"model {req.model!r} is not served here; this server serves "
                             f"{self.model_id!r}", "invalid_request_error", "model", "model_not_found")
        try:
            context, question = req.split()
        except SplitError as exc:
            return self.fail(route, 422, str(exc), "invalid_request_error", exc.param, "unsplittable_prompt")
        refused = req.refusal(_NO_LENGTH_LIMIT)
        if refused is not None:
            return self.fail(route, 422, str(refused), "invalid_request_error", refused.param, "invalid_value")
        return Ask(context, question, req.answer_prefix, req.stratum, req.token_limit(), req.stop_strings(),
                   req.wants_logprobs(), req.reference_answers())

    def upstream_error(self, route: str, exc: Exception):
        if isinstance(exc, UpstreamRefused):
            return self.fail(route, exc.status, str(exc), "invalid_request_error", None, "upstream_refused")
        return self.fail(route, 503, str(exc), "server_error", None, "full_endpoint_unavailable", {"Retry-After": "1"})

    async def answer(self, route: str, req: CompletionRequest | ChatCompletionRequest, chat: bool):
        """Validate `req`, answer it through the gateway, and respond whole or streamed (module docstring)."""
        ask = self.ask_of(route, req)
        if not isinstance(ask, Ask):
            return ask
        t0 = asyncio.get_running_loop().time()
        try:
            if req.stream:
                return await self.streamed(route, req, chat, ask, t0)
            served = await self.gateway.answer(ask)
        except (FullDown, UpstreamRefused) as exc:
            return self.upstream_error(route, exc)
        self.observe(route, served)
        usage, info = self.usage_and_info(served)
        chunks = Chunks.new(self.model_id, chat)
        texts, lps, n = self.returned_logprobs(served, ask)
        if chat:
            return json_response(200, ChatCompletionResponse(
                id=chunks.answer_id, created=chunks.created, model=self.model_id, usage=usage, certkv=info,
                choices=[ChatChoice(message=ChatMessage(content=served.cut.text), finish_reason=served.cut.finish_reason,
                                    logprobs=None if lps is None else chat_logprobs(texts, lps, n, served.cut.text))]))
        return json_response(200, CompletionResponse(
            id=chunks.answer_id, created=chunks.created, model=self.model_id, usage=usage, certkv=info,
            choices=[CompletionChoice(text=served.cut.text, finish_reason=served.cut.finish_reason,
                                      logprobs=None if lps is None else completion_logprobs(texts, lps, n, served.cut.text))]))

    @staticmethod
    def returned_logprobs(served: Served, ask: Ask) -> tuple[list[str], list[float] | None, int]:
        """(token texts, log p, tokens returned) when asked and the upstream gave them, else log p None."""
        got = served.answer
        if not ask.logprobs or got.logprobs is None or got.token_texts is None:
            return [], None, 0
        return got.token_texts, got.logprobs, min(served.cut.tokens, len(got.logprobs))

    def observe(self, route: str, served: Served) -> None:
        self.metrics.observe_answer(route, served.decision, served.seconds["total"], 0.0)

    def usage_and_info(self, served: Served) -> tuple[Usage, CertkvInfo]:
        usage = Usage(prompt_tokens=served.answer.prompt_tokens, completion_tokens=served.cut.tokens,
                      total_tokens=served.answer.prompt_tokens + served.cut.tokens)
        info = CertkvInfo(request_id=served.request_id, decision=served.decision.to_dict(), stream=served.stream,
                          monitor=served.monitor, shadowed=served.shadowed, seconds=served.seconds, cut=served.cut.info)
        return usage, info

    def first_token(self, route: str, t0: float) -> None:
        self.metrics.first_token.labels(route).observe(asyncio.get_running_loop().time() - t0)

    async def streamed(self, route: str, req: CompletionRequest | ChatCompletionRequest, chat: bool, ask: Ask, t0: float):
        """A streamed request: the candidate's answer held until the gate decides and then flushed,
        or the full endpoint's answer relayed as it decodes (module docstring)."""
        from fastapi.responses import StreamingResponse

        gw = self.gateway
        plan = gw.plan(ask.stratum, ask.limit)
        decision = gw.decision(plan, ask.stratum)
        got = await gw.from_candidate(plan, ask, decision) if plan.reason is None else None
        chunks = Chunks.new(self.model_id, chat)
        headers = {"Cache-Control": "no-cache"}
        if got is not None:
            cut = gw.cut(got, ask)
            served = gw.settle(ask, plan, decision, got, cut, asyncio.get_running_loop().time() - t0)
            self.observe(route, served)
            self.first_token(route, t0)
            usage, info = self.usage_and_info(served)
            events = sse_events(chunks, _pieces(got.token_texts or [got.text], cut.text), finish_reason=cut.finish_reason,
                                usage=usage, certkv=info, include_usage=req.include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        source = gw.full.stream(gw.path, gw.full_body(ask))
        try:
            await gw.full.identify()
            first = await anext(source, None)
        except UpstreamDown as exc:
            raise FullDown(gw.full_down(exc, decision)) from None
        relay = self.relay(route, req, chunks, first, source, ask, plan, decision, t0)
        return StreamingResponse(relay, media_type="text/event-stream", headers=headers)

    async def relay(self, route: str, req: CompletionRequest | ChatCompletionRequest, chunks: Chunks,
                    event: dict | None, source: AsyncIterator[dict], ask: Ask, plan: Plan, decision: Decision,
                    t0: float) -> AsyncIterator[str]:
        """The full endpoint's stream as this server's chunks, then the last chunk with the usage
        and the ``certkv`` object; an upstream failure mid-stream ends it with an error event."""
        gw, text, finish, started = self.gateway, "", "stop", False
        usage: dict[str, Any] = {}
        try:
            while event is not None:
                if "error" in event:
                    self.metrics.errors.labels(route, "503").inc()
                    error = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
                    yield chunks.error(ErrorResponse.of(str(error.get("message")), "server_error", None, "upstream_failed"))
                    return
                piece, finish, usage = _event_piece(event, gw.route == "chat", finish, usage)
                if piece and not text:
                    self.first_token(route, t0)
                if piece or not started:  # the first event starts the response, text or not
                    started = True
                    yield chunks.piece(piece)
                text += piece
                event = await anext(source, None)
        finally:
            await source.aclose()  # type: ignore[attr-defined]  # an async generator: the upstream call ends with it
        tokens = int(usage.get("completion_tokens") or 0)
        got = UpstreamAnswer(text, finish, None, None, int(usage.get("prompt_tokens") or 0), tokens,
                             asyncio.get_running_loop().time() - t0)
        served = gw.settle(ask, plan, decision, got, Cut(text, tokens, finish), got.seconds)
        self.observe(route, served)
        usage_out, info = self.usage_and_info(served)
        for line in chunks.ending(finish, usage_out, info, req.include_usage):
            yield line

    def health(self) -> GatewayHealth:
        gw, op = self.gateway, self.gateway.op
        snap = {} if gw.monitor is None else gw.monitor.snapshot()
        tripped = [s for s, v in snap.items() if v["tripped"]]
        full, cands = gw.full.state(), {policy: u.state() for policy, u in gw.candidates.items()}
        status: Literal["ok", "candidate_down", "full_down", "tripped"] = (
            "tripped" if tripped else "full_down" if full.state == "down" else
                  "candidate_down" if any(c.state == "down" for c in cands.values()) else "ok")
        return GatewayHealth(
            status=status, model=self.model_id,
            operating_point=PointSummary(
                path=self.operating_point_path, policy=op.policy, press=op.press, kv_retained=op.kv_retained,
                fallback=op.fallback, stratified=op.is_stratified, risk=op.contract.risk,
                confidence=op.contract.confidence, tolerance=op.contract.tolerance, utility=op.contract.utility,
                query_aware=op.query_aware),
            full=full, candidates=cands, in_flight=self.in_flight.count,
            monitoring="off" if gw.monitor is None else "on",
            shadow_rate=0.0 if gw.monitor is None else gw.monitor.shadow_rate, shadow_store=self.shadow_store_path,
            shadows=ShadowCounts(scored=gw.shadows_done, abandoned=gw.abandoned), monitor=snap, tripped=tripped,
            uptime_s=round(time.time() - self.started_at, 3))


def _pieces(texts: list[str], text: str) -> list[str]:
    """`text` (a cut answer) in the pieces its tokens add (`texts`), clipped where it ends."""
    out, length = [], 0
    for piece in texts:
        if length >= len(text):
            break
        if piece:
            out.append(piece[: len(text) - length])
            length += len(out[-1])
    return out if "".join(out) == text else [text]


def _event_piece(event: dict, chat: bool, finish: str, usage: dict) -> tuple[str, str, dict]:
    """(text, finish reason so far, usage so far) of one upstream stream event."""
    choices = event.get("choices") or []
    piece = ""
    if choices:
        choice = choices[0]
        piece = str(((choice.get("delta") or {}).get("content") if chat else choice.get("text")) or "")
        finish = choice.get("finish_reason") or finish
    return piece, finish, event.get("usage") or usage


def create_gateway_app(gateway: Gateway, *, model_id: str, operating_point_path: str, api_key: str | None,
                       max_body_bytes: int, drain_seconds: float, shadow_store_path: str | None) -> Limits:
    """The gateway's FastAPI app behind ``certkv serve``'s body-limit and API-key middleware."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    in_flight = InFlight()
    routes = GatewayRoutes(gateway, model_id, operating_point_path, shadow_store_path, in_flight)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await gateway.close(drain_seconds)

    app = FastAPI(title="certkv gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app, gateway.metrics, "certkv gateway")

    def metrics() -> tuple[bytes, str]:
        gateway.metrics.refresh_monitor(gateway.monitor, {} if gateway.monitor is None else gateway.monitor.snapshot())
        return generate_latest(gateway.metrics.registry), CONTENT_TYPE_LATEST

    add_openai_routes(app, routes.answer, model_card=lambda: ModelCard(
        id=model_id, created=int(routes.started_at), certkv={"policy": gateway.op.policy, "kind": "gateway"}),
        operating_point=gateway.op.to_dict, health=routes.health, metrics=metrics)
    return Limits(app, api_key, max_body_bytes, gateway.metrics, in_flight)
