"""One upstream of ``certkv gateway``: an OpenAI-compatible server, called without blocking, its health tracked.

Calls go through one pooled :class:`httpx.AsyncClient` per upstream (keep-alive connections: a
new TCP connection per request would cost the gateway more than its own work), each under a
timeout, so no request waits on an upstream for longer than it allows. Every failure (refused,
reset, timed out, a 5xx or 429, an answer that is not a completion) is an :class:`UpstreamDown`
with one line saying why; the upstream is then marked down with that reason and the time, and
:meth:`Upstream.usable` says no until ``retry_after`` seconds have passed, so a dead candidate
costs the requests after it nothing (its requests go straight to the full endpoint); the first
request after that tries it again, and a success marks it up. /health reports the state
(:meth:`Upstream.state`).

Identity. The gateway checks at its start that each server answering then is the one calibration
measured (:func:`certkv.gateway.setup.check_identities`). A server that was down may come back as
another deployment on the same port, so an upstream given its bound identity (the ``/v1/models``
answer without creation times) asks again after every failure, before its next call: a server
that answers otherwise stays down, its error saying so, and is asked again ``retry_after`` later.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from certkv.calibration.endpoints import models_identity, serves_certkv

#: Statuses that say the server, not the request, is in trouble: the upstream counts as down.
DOWN_STATUSES = frozenset({429, 500, 502, 503, 504})


class UpstreamDown(Exception):
    """An upstream could not answer; the message is one line naming the URL and why."""


class UpstreamRefused(Exception):
    """An upstream refused the request itself (a 4xx other than 429): its status and one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class UpstreamState(BaseModel):
    """An upstream as /health reports it: ``state`` ``up`` (its last call answered), ``down`` (its
    last call failed: ``error`` says why, ``since`` when) or ``unknown`` (not called yet)."""

    url: str
    name: str
    state: str
    since: float | None
    error: str | None
    failures: int
    answered: int


@dataclass
class UpstreamAnswer:
    """A (chat) completion from an upstream: the text, the finish reason, each token's text and log p
    (None when the server returned none), the prompt's tokens as it counted them and the seconds."""

    text: str
    finish_reason: str
    token_texts: list[str] | None
    logprobs: list[float] | None
    prompt_tokens: int
    completion_tokens: int
    seconds: float


class Upstream:
    """One OpenAI-compatible server: `url` up to ``/v1``, the model `name` it serves, its API key,
    the seconds a call may take and how long a failure keeps it out of use (module docstring)."""

    def __init__(self, url: str, name: str, api_key: str | None, *, timeout: float, retry_after: float,
                 certkv: bool | None = None, bound_models: list[dict[str, Any]] | None = None) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits)
        self.url, self.name, self.timeout, self.retry_after = url, name, timeout, retry_after
        self.certkv = certkv  # a certkv serve (sent context and question as fields); None: not asked yet
        self.bound_models = bound_models  # the /v1/models answer calibration bound (None: none bound)
        self._recheck = False  # the start checked it; set by every failure (module docstring)
        self.down_since: float | None = None
        self.error: str | None = None
        self.failures = self.answered = 0
        self._retry_at = 0.0

    def usable(self) -> bool:
        """Up, never called, or down for at least ``retry_after`` seconds (worth another try)."""
        return self.down_since is None or time.monotonic() >= self._retry_at

    def state(self) -> UpstreamState:
        state = "down" if self.down_since is not None else ("up" if self.answered else "unknown")
        return UpstreamState(url=self.url, name=self.name, state=state, since=self.down_since, error=self.error,
                             failures=self.failures, answered=self.answered)

    def _failed(self, why: str) -> UpstreamDown:
        self.failures += 1
        self.error = why
        if self.down_since is None:
            self.down_since = time.time()
        self._retry_at = time.monotonic() + self.retry_after
        self._recheck = self.bound_models is not None
        return UpstreamDown(f"{self.url}: {why}")

    def _answered(self) -> None:
        self.answered += 1
        self.down_since = self.error = None

    async def identify(self) -> bool:
        """Whether the server is a ``certkv serve`` (its ``/v1/models`` card of `name` is owned by
        certkv), asked once and again after a failure when an identity is bound (module docstring);
        raises :class:`UpstreamDown` when it cannot tell, or when the server is not the bound one."""
        if self.certkv is None or self._recheck:
            models = models_identity(await self._send("GET", "/models", None))
            if self.bound_models is not None and models != self.bound_models:
                raise self._failed(f"its /v1/models answer {json.dumps(models)} is not the one calibration bound "
                                   f"({json.dumps(self.bound_models)}): another deployment on this port")
            self._recheck = False
            self.certkv = serves_certkv(models, self.name)
        return self.certkv

    async def complete(self, path: str, body: dict) -> UpstreamAnswer:
        """POST `body` to `path` (``/chat/completions`` or ``/completions``) and read the answer."""
        t0 = time.perf_counter()
        answer = await self._send("POST", path, body)
        try:
            parsed = read_completion(answer, chat=path == "/chat/completions", seconds=time.perf_counter() - t0)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise self._failed(f"answered without a completion's choices[0] ({type(exc).__name__})") from None
        self._answered()
        return parsed

    async def _send(self, method: str, path: str, body: dict | None) -> dict:
        import httpx

        try:
            resp = await self.client.request(method, path, json=body)
        except httpx.TimeoutException:
            raise self._failed(f"no answer within {self.timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise self._failed(f"unreachable ({type(exc).__name__}: {' '.join(str(exc).split()) or 'no detail'})") from None
        if resp.status_code in DOWN_STATUSES:
            raise self._failed(f"HTTP {resp.status_code}: {error_message(resp.text)}")
        if resp.status_code >= 400:
            raise UpstreamRefused(resp.status_code, f"{self.url} answered HTTP {resp.status_code}: {error_message(resp.text)}")
        try:
            return resp.json()
        except ValueError:
            raise self._failed("did not answer JSON") from None

    async def stream(self, path: str, body: dict) -> AsyncIterator[dict]:
        """POST `body` with ``stream: true`` and yield each event's JSON; a failure before the first
        event raises :class:`UpstreamDown` (or :class:`UpstreamRefused`), a later one ends the
        iteration with an ``{"error": ...}`` event."""
        import httpx

        started = False
        try:
            async with self.client.stream("POST", path, json={**body, "stream": True}) as resp:
                if resp.status_code >= 400:
                    text = (await resp.aread()).decode(errors="replace")
                    if resp.status_code in DOWN_STATUSES:
                        raise self._failed(f"HTTP {resp.status_code}: {error_message(text)}")
                    raise UpstreamRefused(resp.status_code, f"{self.url} answered HTTP {resp.status_code}: "
                                          f"{error_message(text)}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    started = True
                    yield json.loads(line[5:])
        except (httpx.HTTPError, ValueError) as exc:
            failure = self._failed(f"stream broke ({type(exc).__name__})")
            if not started:
                raise failure from None
            yield {"error": {"message": str(failure), "type": "server_error", "code": "upstream_failed"}}
            return
        self._answered()

    async def close(self) -> None:
        await self.client.aclose()


def error_message(text: str) -> str:
    """An error body's message (OpenAI's ``{"error": {"message"}}``, else its text), on one line."""
    try:
        error = json.loads(text).get("error")
        text = error.get("message", text) if isinstance(error, dict) else str(error or text)
    except (ValueError, AttributeError):
        pass
    return " ".join(text.split())[:300] or "no message"


def read_completion(answer: dict[str, Any], *, chat: bool, seconds: float) -> UpstreamAnswer:
    """The :class:`UpstreamAnswer` of a chat completion (`chat`) or a completion: token texts and
    log p from ``logprobs.content`` (chat) or ``logprobs.tokens``/``token_logprobs``, None when
    absent or not all finite (a server that leaves some out gives no usable confidence)."""
    choice = answer["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    lp = choice.get("logprobs")
    texts: list[str] | None = None
    values: list[Any] | None = None
    if isinstance(lp, dict) and chat and isinstance(lp.get("content"), list):
        texts, values = [str(t.get("token", "")) for t in lp["content"]], [t.get("logprob") for t in lp["content"]]
    elif isinstance(lp, dict) and not chat and isinstance(lp.get("token_logprobs"), list):
        texts, values = [str(t) for t in lp.get("tokens") or []], lp["token_logprobs"]
    if values is None or len(values) != len(texts or []) or not all(
            isinstance(v, int | float) and math.isfinite(v) for v in values):
        texts = values = None
    usage = answer.get("usage") or {}
    return UpstreamAnswer(str(text or ""), str(choice.get("finish_reason") or "stop"), texts,
                          None if values is None else [float(v) for v in values], int(usage.get("prompt_tokens") or 0),
                          int(usage.get("completion_tokens") or len(texts or ())), seconds)
