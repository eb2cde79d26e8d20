"""The routes of `certkv serve`: OpenAI's completions and chat completions, the model list, the
operating point, /health and /metrics.

An answer route validates what the schemas cannot (the model name, the prompt split, the fields that
would ask for an answer the certificate does not cover:
:meth:`~certkv.serve.schemas._Request.refusal`), logs a warning naming the fields it ignores,
submits the request to the :class:`~certkv.serve.service.Service` and waits for it without blocking
the event loop; the certified answer is then cut as the request asks
(:mod:`certkv.serve.answer_cut`). Its failures map to OpenAI-shaped errors
(:class:`~certkv.serve.responses.ErrorResponse`): 404 (another model), 422 (a text that does not
split, a field outside the certificate), 503 + Retry-After (queue full, shutting down), 504 (over
``--timeout``), 413 ``kv_budget_exceeded`` (a request larger than the whole KV budget), 400 (the
runtime refused the request, e.g. an empty context) and 500 (that request failed; the server stays
up). A streamed request's response starts with its first decoded tokens
(:mod:`certkv.serve.streaming`); a failure after that ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from certkv.errors import CertkvError
from certkv.serve.answer_cut import (
    Cut,
    chat_logprobs,
    completion_logprobs,
    cut_answer,
    logprob_tokens,
    token_texts,
)
from certkv.serve.responses import (
    CertkvInfo,
    ChatChoice,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    KVState,
    ModelCard,
    ModelList,
    PointSummary,
    QueueState,
    ShadowCounts,
    Usage,
)
from certkv.serve.schemas import ChatCompletionRequest, CompletionRequest, SplitError
from certkv.serve.streaming import Chunks, Item, PieceStream, StopHold, TokenFeed, sse_events, token_pieces

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable
    from concurrent.futures import Future

    from fastapi import APIRouter
    from pydantic import BaseModel

    from certkv.serve.middleware import InFlight
    from certkv.serve.service import Served, Service

log = logging.getLogger("certkv.serve")


def json_response(status: int, body: BaseModel, headers: dict | None = None):
    """`body` (a response model) as JSON with `status`, serialised by pydantic-core in one pass (a
    NaN or an infinity becomes null: JSON has neither)."""
    from fastapi.responses import Response

    return Response(body.model_dump_json(), status_code=status, headers=headers, media_type="application/json")


async def _outcome(future: Future[Served]) -> Served:
    """Wait on the event loop for the scheduler thread's `future`, without cancelling it when the
    wait is cancelled (a timeout cancels it on purpose, a queued request then never runs). One
    hand-over from the scheduler's thread to the loop, where ``asyncio.wrap_future`` inside
    ``shield`` and ``wait_for`` takes three."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not done.done():
            done.set_result(None)

    def wake(_: Future[Served]) -> None:
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass  # the loop has closed: nobody waits any more

    future.add_done_callback(wake)
    await done
    return future.result()


@dataclass
class _Routes:
    """What the routes of one server share: the service, the names and paths they report, the per-request
    `timeout` (``--timeout``) and the server's start time (for /v1/models and /health's uptime)."""

    service: Service
    model_id: str
    operating_point_path: str | None
    timeout: float
    shadow_store_path: str | None
    in_flight: InFlight
    started_at: float

    def fail(self, route: str, status: int, message: str, type_: str, param=None, code=None, headers=None):
        """An OpenAI-shaped error with `status`, counted in the error metric under `route`."""
        self.service.metrics.errors.labels(route, str(status)).inc()
        return json_response(status, ErrorResponse.of(message, type_, param, code), headers)

    def refusal(self, route: str, req: CompletionRequest | ChatCompletionRequest):
        """The error for what the schemas cannot check (another model, a prompt that does not split,
        a field asking for an answer the certificate does not cover), or ``(context, question)``
        when there is none; the fields ignored are logged (as vLLM's server does)."""
        if req.model is not None and req.model != self.model_id:
            return self.fail(route, 404, f"model {req.model!r} is not served here; this server serves "
                             f"{self.model_id!r}", "invalid_request_error", "model", "model_not_found")
        try:
            context, question = req.split()
        except SplitError as exc:
            return self.fail(route, 422, str(exc), "invalid_request_error", exc.param, "unsplittable_prompt")
        refused = req.refusal(self.service.runtime.max_new_tokens)
        if refused is not None:
            return self.fail(route, 422, str(refused), "invalid_request_error", refused.param, "invalid_value")
        unknown = req.unknown_fields()
        if unknown:
            log.warning("%s: ignored the fields this server does not know: %s", route, ", ".join(unknown))
        return context, question

    async def answer(self, route: str, req: CompletionRequest | ChatCompletionRequest, chat: bool):
        """Validate `req`, queue it, wait for it (at most `timeout` seconds) and answer it, or the
        error. Streamed, the response starts with the answer's first tokens as they are decoded
        (:mod:`certkv.serve.streaming`), or with the finished answer when none was heard before."""
        from certkv.serve.service import QueueFull, Stopping

        split = self.refusal(route, req)
        if not isinstance(split, tuple):
            return split
        context, question = split
        service, loop = self.service, asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        feed = TokenFeed(loop) if req.stream else None
        try:
            future = service.submit(context, question, req.stratum, req.reference_answers(), req.answer_prefix,
                                    logprobs=req.wants_logprobs(), on_tokens=feed)
        except QueueFull:
            return self.fail(route, 503, f"the queue is full ({service.max_queue} requests waiting); retry later",
                             "server_error", None, "queue_full", {"Retry-After": str(service.retry_after())})
        except Stopping:
            return self.fail(route, 503, "the server is shutting down", "server_error", None, "shutting_down",
                             {"Retry-After": "5"})
        try:
            async with asyncio.timeout_at(deadline):
                first = None if feed is None else await feed.first(future)
                served = None if first is not None else await _outcome(future)
        except TimeoutError:
            future.cancel()  # still queued: never run; running: its answer is discarded
            return self.fail(route, 504, *self.timed_out())
        except Exception as exc:  # noqa: BLE001 - mapped to its status by failure()
            return self.fail(route, *self.failure(exc))
        if first is not None:
            from fastapi.responses import StreamingResponse

            assert feed is not None  # tokens are heard only through a feed
            events = self.decoded_events(route, req, chat, first, feed, future, deadline)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        assert served is not None
        service.metrics.observe_answer(route, served.answer.decision, served.seconds, served.waited)
        if req.stream:  # flushed whole once decided: its first token leaves now
            self.first_token(route, deadline)
        return self.respond(served, chat, req)

    def first_token(self, route: str, deadline: float) -> None:
        """Observe a streamed request's time to first token: now less its arrival (the `deadline`,
        on the event loop's clock, less the timeout)."""
        elapsed = asyncio.get_running_loop().time() - (deadline - self.timeout)
        self.service.metrics.first_token.labels(route).observe(elapsed)

    def cut(self, served: Served, req: CompletionRequest | ChatCompletionRequest) -> tuple[Cut, list[str] | None]:
        """What is returned of `served`'s certified answer (:func:`~certkv.serve.answer_cut.cut_answer`),
        and the text each of its tokens adds (None when neither a cut nor log-probabilities need it)."""
        answer, limit, stops = served.answer, req.token_limit(), req.stop_strings()
        if not stops and not req.wants_logprobs() and (limit is None or limit >= len(answer.token_ids)):
            return Cut(answer.answer, len(answer.token_ids), served.finish_reason), None
        texts = token_texts(self.service.runtime.tokenizer, answer.token_ids)
        return cut_answer(answer.answer, texts, served.finish_reason, limit=limit, stops=stops), texts

    def timed_out(self) -> tuple[str, str, None, str]:
        """(message, type, param, code) of a request past ``--timeout``."""
        return (f"the request took longer than the {self.timeout:g} s timeout (--timeout)", "server_error", None,
                "timeout")

    def failure(self, exc: BaseException) -> tuple[int, str, str, str | None, str]:
        """(status, message, type, param, code) of a request whose answer failed with `exc`."""
        from certkv.serve.service import BudgetExceeded

        if isinstance(exc, BudgetExceeded):
            return 413, str(exc), "invalid_request_error", None, "kv_budget_exceeded"
        if isinstance(exc, CertkvError):
            return 400, str(exc), "invalid_request_error", None, "refused"
        log.error("certkv serve: request failed", exc_info=exc)
        return 500, f"the request failed: {type(exc).__name__}: {exc}", "server_error", None, "internal_error"

    async def decoded_events(self, route: str, req: CompletionRequest | ChatCompletionRequest, chat: bool,
                             first: Item, feed: TokenFeed, future: Future[Served], deadline: float) -> AsyncIterator[str]:
        """The events of an answer streamed as decoded, from its `first` tokens heard to ``[DONE]``
        (:mod:`certkv.serve.streaming`), cut as `req` asks (its token limit, its stop strings: text
        that may begin one is held back); past the `deadline`, or failed, an error event ends it. The
        deadline bounds each wait for tokens, never a ``yield`` (a timeout that fired while the
        server sends a chunk would cancel the sending, not this wait)."""
        try:
            async for event in self._decoded(route, req, chat, first, feed, future, deadline):
                yield event
        finally:  # the client went away (or the stream ended): a lane still decoding stops and frees its KV
            if not future.done():
                future.cancel()

    async def _decoded(self, route: str, req: CompletionRequest | ChatCompletionRequest, chat: bool, first: Item,
                       feed: TokenFeed, future: Future[Served], deadline: float) -> AsyncIterator[str]:
        chunks, pieces = Chunks.new(self.model_id, chat), PieceStream(self.service.runtime.tokenizer)
        hold, limit = StopHold(req.stop_strings()), req.token_limit()
        item, restarted, texted = first, False, False
        while item is not None:
            ids, restarted_at = item
            if restarted_at is not None and not restarted:
                restarted = True
                yield chunks.restart(restarted_at)
            piece = hold.add(pieces.add(ids if limit is None else ids[:limit]))
            if piece and not texted:
                texted = True
                self.first_token(route, deadline)
            if piece or item is first:  # the first tokens start the response, text or not
                yield chunks.piece(piece)
            try:
                async with asyncio.timeout_at(deadline):
                    item = await feed.next()
            except TimeoutError:
                future.cancel()
                self.service.metrics.errors.labels(route, "504").inc()
                yield chunks.error(ErrorResponse.of(*self.timed_out()))
                return
        try:
            served = future.result()
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the error is an event
            status, message, type_, param, code = self.failure(exc)
            self.service.metrics.errors.labels(route, str(status)).inc()
            yield chunks.error(ErrorResponse.of(message, type_, param, code))
            return
        self.service.metrics.observe_answer(route, served.answer.decision, served.seconds, served.waited)
        cut, _ = self.cut(served, req)
        rest = hold.rest(cut.text)
        if rest:
            yield chunks.piece(rest)
        usage, info = self.usage_and_info(served, cut)
        for event in chunks.ending(cut.finish_reason, usage, info, req.include_usage):
            yield event

    @staticmethod
    def usage_and_info(served: Served, cut: Cut) -> tuple[Usage, CertkvInfo]:
        """The usage and the ``certkv`` object of `served`'s answer as `cut`."""
        usage = Usage(prompt_tokens=served.prompt_tokens, completion_tokens=cut.tokens,
                      total_tokens=served.prompt_tokens + cut.tokens)
        info = CertkvInfo(request_id=served.request_id, decision=served.answer.decision.to_dict(),
                          stream=served.stream, monitor=served.monitor, shadowed=served.shadowed,
                          seconds=served.answer.seconds, cut=cut.info)
        return usage, info

    def respond(self, served: Served, chat: bool, req: CompletionRequest | ChatCompletionRequest):
        """`served`, finished, as a (chat) completion cut as `req` asks: one JSON body, or
        server-sent events when it streams (an answer none of which was heard as decoded: flushed
        whole)."""
        from fastapi.responses import StreamingResponse

        cut, texts = self.cut(served, req)
        usage, info = self.usage_and_info(served, cut)
        chunks = Chunks.new(self.model_id, chat)  # the answer's id and creation time, streamed or not
        if req.stream:
            pieces = token_pieces(self.service.runtime.tokenizer, served.answer.token_ids[: cut.tokens], cut.text)
            events = sse_events(chunks, pieces, finish_reason=cut.finish_reason, usage=usage, certkv=info,
                                include_usage=req.include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return json_response(200, self.whole(chunks.answer_id, chunks.created, chat, cut, texts, served, usage, info))

    def whole(self, answer_id: str, created: int, chat: bool, cut: Cut, texts: list[str] | None, served: Served,
              usage: Usage, info: CertkvInfo) -> ChatCompletionResponse | CompletionResponse:
        """The one-body answer: the cut text, with the certified decode's log-probabilities when asked
        (null when the decode that gave the answer recorded none: a recompute gate's spliced answer)."""
        lps, n = served.logprobs, logprob_tokens(cut, served.answer.token_ids, self.service.runtime.stop_ids)
        if chat:
            return ChatCompletionResponse(
                id=answer_id, created=created, model=self.model_id, usage=usage, certkv=info,
                choices=[ChatChoice(message=ChatMessage(content=cut.text), finish_reason=cut.finish_reason,
                                    logprobs=None if lps is None or texts is None else
                                    chat_logprobs(texts, lps, n, cut.text))])
        return CompletionResponse(
            id=answer_id, created=created, model=self.model_id, usage=usage, certkv=info,
            choices=[CompletionChoice(text=cut.text, finish_reason=cut.finish_reason,
                                      logprobs=None if lps is None or texts is None else
                                      completion_logprobs(texts, lps, n, cut.text))])

    def health(self) -> HealthResponse:
        """The body of /health: status, operating point, queue, KV budget, shadows and the monitor."""
        service, op = self.service, self.service.runtime.operating_point
        snap = service.monitor_snapshot()
        tripped = [s for s, v in snap.items() if v["tripped"]]
        scheduler = service.scheduler
        return HealthResponse(
            status="stopping" if service.stopping else ("tripped" if tripped else "ok"),
            model=self.model_id,
            operating_point=PointSummary(
                path=self.operating_point_path, policy=op.policy, press=op.press, kv_retained=op.kv_retained,
                fallback=op.fallback, stratified=op.is_stratified, risk=op.contract.risk,
                confidence=op.contract.confidence, tolerance=op.contract.tolerance, utility=op.contract.utility,
                query_aware=op.query_aware),
            queue=QueueState(depth=service.queue_depth(), max=service.max_queue, shadow_pending=service.shadow_depth()),
            in_flight=self.in_flight.count,
            kv=KVState(budget=service.kv_budget, in_use=scheduler.kv_in_use, peak=scheduler.peak_kv,
                       requests_in_flight=scheduler.in_flight(), admissions_waiting=scheduler.waiting(),
                       decode_steps=scheduler.steps, max_batch=scheduler.peak_lanes,
                       given_back=scheduler.given_back),
            monitoring="off" if service.monitor is None else "on",
            shadow_rate=0.0 if service.monitor is None else service.monitor.shadow_rate,
            shadow_store=self.shadow_store_path,
            shadows=ShadowCounts(scored=service.shadows_done, abandoned=service.abandoned),
            monitor=snap, tripped=tripped, uptime_s=round(time.time() - self.started_at, 3))


def build_router(service: Service, *, model_id: str, operating_point_path: str | None, timeout: float,
                 shadow_store_path: str | None, in_flight: InFlight) -> APIRouter:
    """The routes around `service` (see the module docstring); what they share is one :class:`_Routes`."""
    from fastapi import APIRouter

    routes = _Routes(service, model_id, operating_point_path, timeout, shadow_store_path, in_flight, time.time())
    router = APIRouter()
    op = service.runtime.operating_point
    add_openai_routes(router, routes.answer, model_card=lambda: ModelCard(
        id=model_id, created=int(routes.started_at), certkv={"policy": op.policy}), operating_point=op.to_dict,
        health=routes.health, metrics=lambda: service.metrics.render(service))
    return router


def add_openai_routes(router, answer: Callable[..., Awaitable[Any]], *, model_card: Callable[[], ModelCard],
                      operating_point: Callable[[], dict], health: Callable[[], BaseModel],
                      metrics: Callable[[], tuple[bytes, str]]) -> None:
    """Add the routes ``certkv serve`` and ``certkv gateway`` both answer to `router` (an
    ``APIRouter`` or the app): the two completions routes through ``answer(route, request,
    chat=...)``, ``/v1/models`` with the one `model_card`, the point, ``/health`` and the
    Prometheus text ``metrics`` gives as (body, content type)."""
    from fastapi.responses import Response

    @router.post("/v1/completions", response_model=CompletionResponse)
    async def completions(req: CompletionRequest):
        return await answer("/v1/completions", req, chat=False)

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(req: ChatCompletionRequest):
        return await answer("/v1/chat/completions", req, chat=True)

    @router.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[model_card()])

    @router.get("/v1/operating-point")
    async def operating_point_route():
        return operating_point()

    @router.get("/health")
    async def health_route():
        return health()

    @router.get("/metrics")
    async def prometheus():
        body, ctype = metrics()
        return Response(body, media_type=ctype)
