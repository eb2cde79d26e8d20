"""Calibration through OpenAI-compatible endpoints: the deployment users already run, measured end to end.

An endpoint contract (``model: {endpoint: URL, name: NAME}``, candidates ``endpoint: {url, name}``
with a ``label`` and a declared ``memory``; docs/engines.md) names servers instead of a model and
presses. :class:`EndpointExecutor` sends every request to the full endpoint and to every candidate
(temperature 0, the contract's ``max_new_tokens``, the chosen tokens' log-probabilities asked for) and turns the answers
into the store records a local run writes: the same columns, ``path`` ``endpoint``, the declared
memory as the candidate's ``kv_retained``, and the answer's confidence (``confidence_min``,
``logprob_mean``) from the log-probabilities the server returns. So certification, strata, the
pilot, validation and reports read them unchanged. Nothing here imports torch.

How a request is sent. A ``certkv serve`` upstream (its ``/v1/models`` says ``owned_by: certkv``)
is given the request's ``context``, ``question`` and ``answer_prefix`` as its extension fields, so
it answers exactly as its runtime answers that request in-process; any other server gets one user
message (chat) or one prompt (completions) holding the context followed by the question, which is
the text certkv's own encoding puts in the user turn.

Integrity. Up to ``concurrency`` requests are in flight (each sends its endpoints one after the
other); a connection error, a 429 or a 5xx is retried with exponential backoff, and the run stops
with one line after the last retry. Each endpoint's identity (its ``/v1/models`` answer, without
the creation times that change at every restart) is bound to the store, so a resumed run against
other servers is refused. A probe (the contract's first request) is sent to the full endpoint at
the start and after every ``probe_every`` answered requests; its first answer is bound to the store,
and an answer that differs stops the run: the reference moved. Requests are written only after a
probe that follows their answers still matched, each in one transaction, so a store never holds
records that a moved reference may have answered; a killed run loses only those unwritten answers.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from certkv.calibration.driver import Recorder, labelled, record_head
from certkv.calibration.progress import progress_bar
from certkv.calibration.utility import score
from certkv.contract.schema import Contract
from certkv.contract.spec import candidates
from certkv.core.gate_features import answer_confidence
from certkv.core.policy_names import ENDPOINT_PRESS, REFERENCE_POLICY
from certkv.errors import CertkvError

if TYPE_CHECKING:
    from rich.console import Console

    from certkv.calibration.store import CalibrationStore
    from certkv.requests.request_set import Request

#: HTTP statuses worth another try: rate limited, or the server's own trouble.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class EndpointOptions:
    """How endpoints are called. ``concurrency``: requests in flight; ``retries``: further tries of a
    call after a connection error, a 429 or a 5xx, waiting ``backoff`` seconds doubled each time (at
    most ``max_backoff``); ``timeout``: seconds one call may take; ``probe_every``: answered requests
    between two probes of the full endpoint."""

    concurrency: int = 4
    retries: int = 8
    backoff: float = 0.5
    max_backoff: float = 8.0
    timeout: float = 300.0
    probe_every: int = 50

    def check(self) -> None:
        for name, low in (("concurrency", 1), ("retries", 0), ("probe_every", 1)):
            if getattr(self, name) < low:
                raise CertkvError(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(self, name)}")


#: Told of every retry: (the endpoint's URL, why, the try that failed, the tries in all, seconds to wait).
OnRetry = Callable[[str, str, int, int, float], None]


class Endpoint:
    """One OpenAI-compatible server: its base URL, the model name it serves, its API key (read
    from the environment variable the contract names) and the retry rule of :class:`EndpointOptions`."""

    def __init__(self, url: str, name: str, api_key_env: str | None, options: EndpointOptions,
                 on_retry: OnRetry | None = None) -> None:
        self.url, self.name, self.options, self.on_retry = url, name, options, on_retry
        self.api_key = api_key(api_key_env, url)
        self.certkv = False  # a certkv serve upstream (learned from its identity): sent the extension fields

    def call(self, path: str, body: dict | None = None) -> dict:
        """GET (no `body`) or POST `path` and return the JSON answer, retrying transient failures;
        one line naming the URL after the last try or on an answer that is not retried."""
        tries = self.options.retries + 1
        for attempt in range(1, tries + 1):
            try:
                return self._once(path, body)
            except _Transient as exc:
                if attempt == tries:
                    raise EndpointUnreachable(f"endpoint {self.url}{path}: {exc} (gave up after {tries} tries; --retries "
                                              "sets how many)") from None
                wait_s = min(self.options.backoff * 2 ** (attempt - 1), self.options.max_backoff)
                if self.on_retry is not None:
                    self.on_retry(self.url, str(exc), attempt, tries, wait_s)
                time.sleep(wait_s)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _once(self, path: str, body: dict | None) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(req, timeout=self.options.timeout) as resp:  # noqa: S310 - the contract's URL
                return json.loads(resp.read().decode())
        except urllib.error.HTTPError as exc:
            message = _error_message(exc)
            if exc.code in RETRY_STATUSES:
                raise _Transient(f"HTTP {exc.code}: {message}") from None
            raise CertkvError(f"endpoint {self.url}{path} answered HTTP {exc.code}: {message}") from None
        except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out: the server may come back
            reason = getattr(exc, "reason", exc)
            raise _Transient(f"unreachable ({reason})") from None
        except ValueError as exc:
            raise CertkvError(f"endpoint {self.url}{path} did not answer JSON: {exc}") from None

    def identity(self) -> dict[str, Any]:
        """The server's identity (:func:`models_identity` of its ``/v1/models`` answer); refused in
        one line when the server does not serve this endpoint's model."""
        models = models_identity(self.call("/models"))
        ids = [m.get("id") for m in models]
        if self.name not in ids:
            raise CertkvError(f"endpoint {self.url} serves {ids}, not {self.name!r}; fix the contract's name")
        self.certkv = serves_certkv(models, self.name)
        return {"url": self.url, "name": self.name, "models": models}


def models_identity(answer: dict) -> list[dict[str, Any]]:
    """A server's identity from its ``/v1/models`` `answer`: the model cards without their creation
    times (a restart changes them, not the deployment). What calibration binds to a store and what
    ``certkv gateway`` compares with it, at its start and after a server failed."""
    return [{k: v for k, v in m.items() if k != "created"} for m in answer.get("data", []) if isinstance(m, dict)]


def serves_certkv(models: list[dict[str, Any]], name: str) -> bool:
    """Whether the card of model `name` among `models` (:func:`models_identity`) is a ``certkv serve``'s
    (``owned_by: certkv``): such a server is sent a request's context and question as fields."""
    return any(m.get("id") == name and m.get("owned_by") == "certkv" for m in models)


class _Transient(Exception):
    """A failure worth another try (:data:`RETRY_STATUSES`, a connection that failed)."""


class EndpointUnreachable(CertkvError):
    """A server that still failed in a transient way after the last try (down, overloaded): a
    caller that can live without it (the gateway at start) tells it from a wrong answer."""


def _error_message(exc: urllib.error.HTTPError) -> str:
    """The server's error message (OpenAI's ``{"error": {"message"}}``, else its text), on one line."""
    try:
        text = exc.read().decode(errors="replace")
    except OSError:
        text = ""
    try:
        error = json.loads(text).get("error")
        text = error.get("message", text) if isinstance(error, dict) else str(error or text)
    except (ValueError, AttributeError):
        pass
    return " ".join(text.split())[:300] or str(exc.reason)


def api_key(env: str | None, url: str) -> str | None:
    """The API key from environment variable `env` (None: the endpoint needs none); one line when unset."""
    if env is None:
        return None
    value = os.environ.get(env)
    if not value:
        raise CertkvError(f"environment variable {env} is not set; it holds the API key of endpoint {url} "
                          "(the contract names it as api_key_env)")
    return value


def request_body(request: Request, route: str, name: str, max_new_tokens: int, certkv_upstream: bool,
                 logprobs: bool = True) -> dict:
    """The body sent for `request`: greedy, at most `max_new_tokens`, log-probabilities asked for
    unless `logprobs` is false; a certkv serve upstream gets the request's fields as they are (see
    the module docstring)."""
    return upstream_body(request.context, request.question, request.answer_prefix, route, name, max_new_tokens,
                         certkv_upstream, logprobs)


def upstream_body(context: str, question: str, answer_prefix: str, route: str, name: str, max_new_tokens: int,
                  certkv_upstream: bool, logprobs: bool = True) -> dict:
    """:func:`request_body` from the texts themselves: what calibration sends for a request, and
    what ``certkv gateway`` sends for a live one, so the deployment is asked as it was measured."""
    # Chat asks for the chosen tokens' log-probabilities with no alternatives (``top_logprobs: 0``):
    # llama-cpp-python's server returns none for ``logprobs: true`` alone.
    # ``protocol.logprobs: false`` asks for none: a server that refuses them, or pays for them (llama-cpp-python
    # keeps every position's logits to give them, 53 % more prefill time measured on SmolLM2-135M).
    body: dict[str, Any] = {"model": name, "temperature": 0, "max_tokens": max_new_tokens}
    if logprobs:
        body.update({"logprobs": True, "top_logprobs": 0} if route == "chat" else {"logprobs": 0})
    if certkv_upstream:
        body.update(context=context, question=question)
        if answer_prefix:
            body["answer_prefix"] = answer_prefix
        text = ""
    else:
        text = context + question
    if route == "chat":
        body["messages"] = [{"role": "user", "content": text}] if text else []
    else:
        body["prompt"] = text
    return body


@dataclass(frozen=True)
class Answer:
    """One endpoint's answer: its text, the chosen tokens' log-probabilities (None: the server
    gave none), the seconds the call took and the prompt's tokens as the server counted them
    (``usage.prompt_tokens``; None: it did not say)."""

    text: str
    logprobs: list[float] | None
    seconds: float
    prompt_tokens: int | None = None

    def signals(self) -> dict[str, float]:
        """``confidence_min`` and ``logprob_mean`` (:func:`certkv.core.gate_features.answer_confidence`)
        when the server returned log-probabilities, else nothing."""
        if not self.logprobs:
            return {}
        low, mean = answer_confidence(self.logprobs)
        return {"confidence_min": low, "logprob_mean": mean}


def read_answer(answer: dict, route: str, url: str) -> tuple[str, list[float] | None]:
    """(text, log-probabilities or None) of an OpenAI (chat) completion; one line when it has none."""
    try:
        choice = answer["choices"][0]
        text = choice["message"]["content"] if route == "chat" else choice["text"]
    except (KeyError, IndexError, TypeError):
        raise CertkvError(f"endpoint {url} answered without a {route} completion's choices[0]") from None
    lp = choice.get("logprobs")
    values: list[Any] | None = None
    if isinstance(lp, dict) and route == "chat" and isinstance(lp.get("content"), list):
        values = [t.get("logprob") for t in lp["content"]]
    elif isinstance(lp, dict) and route == "completions" and isinstance(lp.get("token_logprobs"), list):
        values = lp["token_logprobs"]
    if values is not None and not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
        values = None  # a server that leaves some out gives no usable confidence
    return str(text or ""), None if values is None else [float(v) for v in values]


def ask(endpoint: Endpoint, request: Request, route: str, max_new_tokens: int, with_logprobs: bool = True) -> Answer:
    """`request` answered by `endpoint` (`with_logprobs`: ask for the answer's log-probabilities)."""
    t0 = time.perf_counter()
    path = "/chat/completions" if route == "chat" else "/completions"
    body = request_body(request, route, endpoint.name, max_new_tokens, endpoint.certkv, with_logprobs)
    got = endpoint.call(path, body)
    text, logprobs = read_answer(got, route, endpoint.url)
    return Answer(text, logprobs, time.perf_counter() - t0, prompt_tokens(got))


def prompt_tokens(answer: dict) -> int | None:
    """The prompt's tokens an OpenAI (chat) completion reports in ``usage`` (None when it does not)."""
    usage = answer.get("usage")
    value = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def skip_reason(request: Request, contract: Contract) -> str | None:
    """Why a request cannot be calibrated through endpoints (what can be told without a tokenizer)."""
    if not request.context.strip():
        return "empty context"
    if contract.utility != "agreement" and not any(a.strip() for a in request.answers):  # as a local run skips
        return "answer missing (the contract's utility needs reference answers)"
    return None


def endpoint_records(request: Request, full: Answer, answers: Sequence[tuple[str, float, Answer]],
                     contract: Contract) -> list[dict]:
    """Store records for one request, as a local run writes them: the full endpoint's first, then
    each candidate's (policy, declared memory, answer), ``path`` ``endpoint``, its seconds and the
    confidence its log-probabilities give. The full row's ``context_tokens`` is the prompt's length
    as the full endpoint counts it (its ``usage.prompt_tokens``: a chat server counts its template
    too, ``certkv serve`` the context and question): the certificate's context range, which
    ``certkv gateway`` checks against the candidate's count."""
    utility_full = score(contract.utility, full.text, request.answers, full.text)
    length = {} if full.prompt_tokens is None else {"context_tokens": full.prompt_tokens}
    records = [{**record_head(request, REFERENCE_POLICY, REFERENCE_POLICY, 1.0, 1.0, utility_full, utility_full, full.text),
                "path": None, "seconds": full.seconds, **length, **full.signals()}]
    for policy, memory, answer in answers:
        utility = score(contract.utility, answer.text, request.answers, full.text)
        records.append({**record_head(request, policy, ENDPOINT_PRESS, memory, memory, utility, utility_full, answer.text),
                        "path": "endpoint", "seconds": answer.seconds, **answer.signals()})
    return labelled(records, request, contract)


class EndpointExecutor:
    """Calibrates an endpoint contract: its requests sent to the full endpoint and every candidate's,
    at most ``options.concurrency`` in flight, bracketed by probes (module docstring). Torch-free."""

    name = "endpoint"

    def __init__(self, contract: Contract, options: EndpointOptions | None = None, on_retry: OnRetry | None = None) -> None:
        self.options = options or EndpointOptions()
        self.contract = contract
        self.on_retry = on_retry

    def check(self) -> None:
        """Options and API keys, before the store is opened (an unset key creates nothing)."""
        self.options.check()
        self.endpoints()

    def endpoints(self) -> tuple[Endpoint, list[tuple[str, float, Endpoint]]]:
        """The full endpoint and (policy, memory, endpoint) per candidate, in contract order."""
        full = self.contract.endpoint
        if full is None:
            raise CertkvError(f"contract {self.contract.name} runs its model in-process; calibrate it without endpoints")
        entries = {str(p.label): p.endpoint for p in self.contract.policies}
        out = []
        for c in candidates(self.contract):
            spec = entries[str(c.label)]
            assert spec is not None  # an endpoint contract's entries are all endpoints (schema)
            out.append((c.policy, c.kv_retained, Endpoint(spec.url, spec.name, spec.api_key_env, self.options, self.on_retry)))
        return Endpoint(full.url, full.name, full.api_key_env, self.options, self.on_retry), out

    def run(self, contract: Contract, todo: Sequence[Request], record: Recorder, *, device: str | None,
            dtype: str | None, quiet: bool, console: Console | None, kv_amax: list[list[float]] | None = None) -> None:
        """Bind the endpoints' identities and the probe's answer, then calibrate `todo` (module docstring)."""
        full, cands = self.endpoints()
        found = {REFERENCE_POLICY: full.identity(), **{policy: e.identity() for policy, _, e in cands}}
        probe = Probe(full, contract, record.store)
        probe.check()  # first: a full endpoint restarted as another deployment is said to be a moved reference
        bind_identities(record.store, found)
        t0 = time.perf_counter()
        with progress_bar(quiet, console) as progress, ThreadPoolExecutor(self.options.concurrency) as pool:
            task = progress.add_task("calibrating", total=len(todo)) if progress else None
            try:
                self._drive(pool, full, cands, todo, record, probe,
                            lambda: progress.advance(task) if progress and task is not None else None)
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
        record.summary.seconds = time.perf_counter() - t0

    def _drive(self, pool: ThreadPoolExecutor, full: Endpoint, cands: list[tuple[str, float, Endpoint]],
               todo: Sequence[Request], record: Recorder, probe: Probe, advance: Callable[[], None]) -> None:
        """Keep `concurrency` requests in flight; hold each outcome until the next probe matches, then write it."""
        queue = list(reversed(todo))
        running: set[Future[tuple[str, list[dict] | None, str | None]]] = set()
        held: list[tuple[str, list[dict] | None, str | None]] = []
        while queue or running:
            while queue and len(running) < self.options.concurrency:
                running.add(pool.submit(self._one, queue.pop(), full, cands))
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                held.append(future.result())
                advance()
            if len(held) >= self.options.probe_every or not (queue or running):
                probe.check()
                for outcome in held:
                    record(*outcome)
                held.clear()

    def _one(self, request: Request, full: Endpoint, cands: list[tuple[str, float, Endpoint]]
             ) -> tuple[str, list[dict] | None, str | None]:
        """(request id, records, skip reason) of one request: every endpoint asked in turn."""
        reason = skip_reason(request, self.contract)
        if reason is not None:
            return request.id, None, reason
        tokens, route = self.contract.protocol.max_new_tokens, self.contract.route
        logprobs = self.contract.asks_logprobs
        answer = ask(full, request, route, tokens, logprobs)
        answers = [(policy, memory, ask(e, request, route, tokens, logprobs)) for policy, memory, e in cands]
        return request.id, endpoint_records(request, answer, answers, self.contract), None


def bind_identities(store: CalibrationStore, found: dict[str, dict]) -> None:
    """Each endpoint's identity (:meth:`Endpoint.identity`, by policy) bound to the store under
    ``endpoints``; a resumed run against a server whose identity changed is refused, naming it."""
    stored = store.meta().get("endpoints")
    if stored is not None:
        for policy, identity in json.loads(stored).items():
            if found.get(policy) != identity:
                raise CertkvError(f"endpoint {identity['url']} ({policy}) is not the server this store was calibrated "
                                  f"against: its /v1/models answer changed from {json.dumps(identity['models'])} to "
                                  f"{json.dumps((found.get(policy) or {}).get('models'))}; pass --new-store to start anew")
    store.bind({"endpoints": json.dumps(found, sort_keys=True)})


class Probe:
    """The contract's first request, sent to the full endpoint; its first answer is bound to the
    store (meta ``endpoint_probe``) and every later one must equal it."""

    def __init__(self, full: Endpoint, contract: Contract, store: CalibrationStore) -> None:
        self.full, self.contract, self.store = full, contract, store
        self.request = contract.load_requests()[0]
        stored = store.meta().get("endpoint_probe")
        self.expected: dict | None = None if stored is None else json.loads(stored)

    def check(self) -> None:
        """Ask the probe again; stop with one line when the answer moved."""
        answer = ask(self.full, self.request, self.contract.route, self.contract.protocol.max_new_tokens,
                     self.contract.asks_logprobs)
        seen = {"request_id": self.request.id, "answer": answer.text}
        if self.expected is None:
            self.store.bind({"endpoint_probe": json.dumps(seen, sort_keys=True)})
            self.expected = seen
        elif seen != self.expected:
            raise CertkvError(
                f"the reference moved: full endpoint {self.full.url} answers probe request {self.request.id!r} with "
                f"{answer.text!r}, not {self.expected['answer']!r} as when this store began; the records since the "
                "last matching probe were not written; restore that server, or pass --new-store to start anew")
