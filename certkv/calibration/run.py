"""`certkv calibrate`: run every request under the full cache and every candidate, store the losses.

The loop is resumable by construction: each request's records (the full cache and every candidate)
are written in one store transaction, requests already in the store are skipped on restart, and a
request that cannot run is recorded as skipped with its reason, so the run goes on.

One entry point, :func:`calibrate`, with the executor behind it: :class:`LocalExecutor` here, or
:class:`certkv.calibration.ray_executor.RayExecutor`. The run opens the store with :func:`open_run`;
every executor turns a request into its records with :func:`calibrate_request` (on a model loaded once
by :func:`load_engine`) and hands them to a :class:`Recorder`, which writes them with
:func:`record_request`; on Ray the workers compute and this process alone writes.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rich.console import Console
from transformers import PreTrainedTokenizerBase

from certkv.calibration.kv_scales import placed_amax
from certkv.calibration.progress import progress_bar
from certkv.calibration.store import CalibrationStore
from certkv.calibration.task_health import failed_task_warnings
from certkv.calibration.utility import score
from certkv.contract.schema import Contract
from certkv.contract.spec import candidates
from certkv.core.policy_names import NO_PRESS, REFERENCE_POLICY
from certkv.core.signals import RECORDED, request_signals, signal
from certkv.engine.engine import (
    CandidateAnswer,
    Engine,
    PressCandidate,
    RequestNotRunnable,
    RequestResult,
    needs_attention_weights,
)
from certkv.engine.scoring import is_fast_path_press
from certkv.errors import CertkvError
from certkv.kv_formats.spec import TieredFormat, needs_pilot_scales, parse_format, with_pilot_scales
from certkv.model.generation import encode_request
from certkv.model.loading import load_model, model_fingerprint, resolve_device
from certkv.presses.registry import build_press
from certkv.requests.context_groups import group_of
from certkv.requests.request_set import Request, check_strata, stratum_of


@dataclass
class CalibrationSummary:
    """What one `calibrate` invocation did."""

    store: str
    total: int = 0
    already_done: int = 0
    calibrated: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    #: time spent writing the store (its transactions, fsync included), summed over the requests
    write_seconds: float = 0.0
    executor: str = "local"
    #: Ray workers the run started (0 on the local executor), and how often Ray restarted one
    workers: int = 0
    worker_restarts: int = 0
    #: one line per task the model fails even with the full cache (it measures no eviction), read
    #: from the store after the run (:func:`certkv.calibration.task_health.failed_task_warnings`)
    warnings: list[str] = field(default_factory=list)


def build_candidates(contract: Contract, kv_amax: list[list[float]] | None = None) -> list[PressCandidate]:
    """Engine candidates (press objects, KV formats) for every contract candidate, in contract order;
    fp8 pilot scales placed from `kv_amax` (:mod:`certkv.calibration.kv_scales`)."""
    out = []
    for c in candidates(contract):
        press = None if c.press == NO_PRESS else build_press(c.press, c.kv_retained, c.press_kwargs)
        kv_format = None if c.kv_format is None else parse_format(dict(c.kv_format))
        if kv_format is not None and kv_amax is not None and needs_pilot_scales(kv_format):
            kv_format = with_pilot_scales(kv_format, kv_amax)
        if isinstance(kv_format, TieredFormat) and not is_fast_path_press(press):
            raise CertkvError(f"policy {c.policy}: a tiered cache ranks tokens by a plain scorer press's top-k (snapkv, "
                              f"knorm, tova, criticalkv, ...), and {c.press} is not one: choose a scorer press")
        out.append(PressCandidate(policy=c.policy, press=press, press_name=c.press, kv_retained=c.kv_retained,
                                  kv_format=kv_format))
    return out


def agreement_settings(contract: Contract) -> dict | None:
    """The agreement-drop settings of a contract whose gate reads the drop (drop thresholds, or a
    learned gate with that feature; the defaults of :mod:`certkv.core.spec` unless it sets them),
    or None: when nothing reads the signal, calibration does not compute it."""
    gate = contract.gate
    if gate is None or not gate.needs_agreement:
        return None
    return {"window": gate.agreement_window, "top_k": gate.agreement_top_k, "split_divisor": gate.agreement_split}


def lookahead_tokens(contract: Contract) -> int | None:
    """The lookahead probe's answer tokens A when the contract's gate reads the lookahead mass
    (a lookahead gate, or a learned gate with that feature), else None: no probe is run."""
    gate = contract.gate
    if gate is None or not gate.needs_lookahead:
        return None
    return gate.lookahead_tokens


def requests_digest(requests: Iterable[Request]) -> str:
    """sha256 of the request set's content, in order."""
    digest = hashlib.sha256()
    for r in requests:
        digest.update(json.dumps(r.as_record(), sort_keys=True, ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def skip_reason(request: Request, n_context: int, n_question: int, contract: Contract, max_positions: int | None) -> str | None:
    """Why a request cannot be calibrated, or None when it can."""
    if not request.context.strip():
        return "empty context"
    if contract.utility != "agreement" and not any(a.strip() for a in request.answers):
        return "answer missing (the contract's utility needs reference answers)"
    if contract.protocol.query_aware and n_question == 0:
        return "the question encodes to no tokens (the query-aware protocol prefills it with the context)"
    needed = n_context + n_question + contract.protocol.max_new_tokens
    if max_positions is not None and needed > max_positions:
        return f"needs {needed} positions, longer than the model's {max_positions}"
    return None


def request_records(request: Request, result: RequestResult, contract: Contract, computed: dict) -> list[dict]:
    """Store records for one request: the full cache first, then every candidate.

    The gate signals come from the declarations of :mod:`certkv.core.signals`: a request signal
    (the engine's ``result`` attribute, or one `computed` from the encoded request by
    :func:`certkv.core.signals.request_signals`) goes on the full record, and on every record when it
    has a store column of its own; a candidate signal goes on its answer's record (the full answer's
    on the full record), a column always, an ``extra`` key when it was measured.
    """
    answers = request.answers
    full = result.full
    utility_full = score(contract.utility, full.answer, answers, full.answer)
    seconds = result.seconds
    per_request = {s.name: getattr(result, s.name, None) for s in RECORDED if s.per == "request"}
    per_request.update(computed)
    on_every_record = {k: v for k, v in per_request.items() if signal(k).store == "column"}
    records = [
        {
            **_record_head(request, REFERENCE_POLICY, REFERENCE_POLICY, 1.0, 1.0, utility_full, utility_full, full.answer),
            "path": None,
            "seconds": seconds.get("prefill", 0.0) + seconds.get("full_decode", 0.0),
            "seconds_breakdown": seconds,
            **per_request,
            **_answer_signals(full, full_record=True),
        }
    ]
    n_fast = sum(1 for c in result.candidates if c.path == "fast" and not c.own_seconds) or 1
    fast_share = seconds.get("candidates_fast", 0.0) / n_fast
    for cand in result.candidates:
        utility = score(contract.utility, cand.answer, answers, full.answer)
        records.append(
            {
                **_record_head(
                    request,
                    cand.policy,
                    cand.press,
                    cand.kv_retained,
                    cand.kv_retained_actual,
                    utility,
                    utility_full,
                    cand.answer,
                ),
                "path": cand.path,
                **_generation_cost(cand, contract.cost_measure),
                # A fast candidate: its share of the batched decodes (already in its seconds when it
                # decoded as a lane), plus its own scoring when it is response-aware (chosen after the
                # prefill; CandidateAnswer.seconds, 0 otherwise).
                "seconds": cand.seconds if cand.path == "pipeline" or cand.own_seconds else fast_share + cand.seconds,
                **on_every_record,
                **_answer_signals(cand),
            }
        )
    by = contract.strata.by if contract.strata is not None else "task"
    if by != "task":  # strata by a metadata key: the records carry its value (a `stratum` column)
        for record in records:
            record["stratum"] = stratum_of(request, by)
    if contract.requests.group_by == "context":  # the certificate's unit of sampling (certkv.core.grouped)
        for record in records:
            record["group"] = group_of(request)
    return records


def _generation_cost(answer: CandidateAnswer, measure: str) -> dict:
    """The answer's KV cost (peak and KV-time relative to the full cache's, an ``extra`` key each;
    under ``kv_cost: bytes`` their bytes over a 16-bit full cache's too) and, when the contract
    compares candidates by one of them, that one as the record's ``memory``."""
    out: dict[str, Any] = {"kv_peak": answer.kv_peak, "kv_time": answer.kv_time}
    if measure == "bytes":
        out.update(kv_peak_bytes=answer.kv_peak_bytes, kv_time_bytes=answer.kv_time_bytes)
    if measure != "kv_retained":
        out["memory"] = {"peak": answer.kv_peak, "time": answer.kv_time, "bytes": answer.kv_peak_bytes}[measure]
    return out


def _record_head(
    request: Request, policy: str, press: str, kv: float, kv_actual: float, utility: float, utility_full: float, answer: str
) -> dict:
    """The columns every store record starts with (loss = utility_full − utility)."""
    return {
        "request_id": request.id,
        "task": request.task,
        "policy": policy,
        "press": press,
        "kv_retained": kv,
        "kv_retained_actual": kv_actual,
        "utility": utility,
        "utility_full": utility_full,
        "loss": utility_full - utility,
        "answer": answer,
    }


def _answer_signals(answer: CandidateAnswer, *, full_record: bool = False) -> dict:
    """The candidate signals an answer measured: a store column always (None: not measured),
    an ``extra`` key only when measured; the full record leaves out the columns (they describe an
    evicted answer)."""
    out: dict[str, Any] = {}
    for s in RECORDED:
        if s.per != "candidate":
            continue
        value = getattr(answer, s.name, None)
        if s.store == "column" and not full_record:
            out[s.name] = value
        elif s.store == "extra" and value is not None:
            out[s.name] = value
    return out


#: Called after each request is written: (the run's summary so far, the request's id). For a caller
#: that watches the run (a benchmark's timestamps, a test that injects a fault at a known write).
OnWritten = Callable[[CalibrationSummary, str], None]


@dataclass
class Recorder:
    """Writes each request's outcome to the run's store (:func:`record_request`), then tells `on_written`.

    Every executor hands its outcomes to one of these, in the process that owns the store: the
    store has one writer, and the watcher sees every write whichever executor computed it.
    """

    store: CalibrationStore
    summary: CalibrationSummary
    on_written: OnWritten | None = None

    def __call__(self, request_id: str, records: list[dict] | None, reason: str | None) -> None:
        record_request(self.store, self.summary, request_id, records, reason)
        if self.on_written is not None:
            self.on_written(self.summary, request_id)


class Executor(Protocol):
    """Where a calibration's requests run: this process (:class:`LocalExecutor`) or Ray actors
    (:class:`certkv.calibration.ray_executor.RayExecutor`). Both turn a request into its records with
    :func:`calibrate_request` and hand them to the :class:`Recorder`, so the store they leave is the same."""

    #: "local" or "ray": the store binds the model's facts here (local) or from the workers' reports.
    name: str

    def check(self) -> None:
        """Fail fast, before the store is opened: a missing extra, an impossible option (one line)."""

    def run(self, contract: Contract, todo: Sequence[Request], record: Recorder, *, device: str | None,
            dtype: str | None, quiet: bool, console: Console | None, kv_amax: list[list[float]] | None = None) -> None:
        """Calibrate `todo`, handing each outcome to `record`; set ``record.summary.seconds``;
        `kv_amax`: the pilot's magnitudes that place fp8 pilot scales (:mod:`certkv.calibration.kv_scales`).

        `device` is resolved on the local executor, the user's override (or None) on Ray."""


class LocalExecutor:
    """Every request in this process, one after the other, on a model loaded once."""

    name = "local"

    def check(self) -> None:
        return None

    def run(self, contract: Contract, todo: Sequence[Request], record: Recorder, *, device: str | None,
            dtype: str | None, quiet: bool, console: Console | None, kv_amax: list[list[float]] | None = None) -> None:
        assert device is not None  # open_run resolves the device on the local executor
        engine, tokenizer, max_positions = load_engine(contract, device, dtype, kv_amax)
        t0 = time.perf_counter()
        with progress_bar(quiet, console) as progress:
            task = progress.add_task("calibrating", total=len(todo)) if progress else None
            for request in todo:
                record(request.id, *calibrate_request(request, engine, tokenizer, contract, max_positions))
                if progress and task is not None:
                    progress.advance(task)
        record.summary.seconds = time.perf_counter() - t0


def calibrate(
    contract: Contract,
    *,
    executor: Executor | None = None,
    new_store: bool = False,
    limit: int | None = None,
    quiet: bool = False,
    device: str | None = None,
    dtype: str | None = None,
    console: Console | None = None,
    on_written: OnWritten | None = None,
) -> CalibrationSummary:
    """Calibrate `contract` into its store; returns a summary, with a warning per task that
    measures nothing. Safe to interrupt and rerun. Also :func:`certkv.workflow.calibrate`: the
    workflow's first step is this function.

    Parameters
    ----------
    contract : certkv.contract.schema.Contract
        A validated contract; its store is opened (created, or resumed) here.
    executor : Executor, optional
        Where the requests run: :class:`LocalExecutor` (the default) or
        :class:`certkv.calibration.ray_executor.RayExecutor`. The records do not depend on it.
    new_store : bool
        Move an existing store of another contract aside and start anew.
    limit : int, optional
        Calibrate at most this many requests of the contract's set (a preview).
    quiet : bool
        No progress bar.
    device, dtype : str, optional
        Override the contract's device and dtype.
    console : rich.console.Console, optional
        Where the progress bar goes.
    on_written : callable, optional
        Called after each request is written, with the summary and the request's id.
    """
    executor = executor if executor is not None else LocalExecutor()
    executor.check()  # before the store: a missing extra leaves nothing created
    store, summary, todo, run_device = open_run(
        contract, new_store=new_store, limit=limit, device=device, dtype=dtype, executor=executor.name
    )
    try:
        kv_amax = placed_amax(contract, store, contract.load_requests(), run_device, dtype, executor.name)
        if todo:
            executor.run(contract, todo, Recorder(store, summary, on_written), device=run_device or device,
                         dtype=dtype, quiet=quiet, console=console, kv_amax=kv_amax)
    finally:
        store.close()
    summary.warnings = failed_task_warnings(summary.store, contract.model)
    return summary


def open_run(
    contract: Contract,
    *,
    new_store: bool = False,
    limit: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
    executor: str = "local",
) -> tuple[CalibrationStore, CalibrationSummary, list[Request], str | None]:
    """(store, summary, todo, device): the contract's store opened and bound to this run's facts,
    the requests still missing from it, in order, and the resolved device; the caller closes the store.

    On the local executor the device is resolved and the model fingerprinted here; on Ray (device
    None returned) the workers that load the model report both, and the driver binds and checks them.
    """
    if limit is not None and limit < 1:
        raise CertkvError(f"--limit must be at least 1, got {limit}")
    requests = contract.load_requests()
    if contract.strata is not None:  # before the model and the store: a missing stratum fails fast
        check_strata(requests, contract.strata.by)
    run_device = resolve_device(device or contract.protocol.device) if executor == "local" else None
    facts: dict[str, Any] = {
        # The population the certificate is about: its size lets certify refuse a partial store.
        "planned_requests": len(requests),
        "requests_sha256": requests_digest(requests),
    }
    if run_device is not None:
        facts.update(model_fingerprint=model_fingerprint(contract.model), device_type=run_device.split(":")[0])
    facts["dtype"] = dtype or contract.protocol.dtype
    if limit is not None:
        requests = requests[:limit]
    store = CalibrationStore.open(contract.resolved_store_path(), contract, new=new_store)
    summary = CalibrationSummary(store=str(store.path), total=len(requests), executor=executor)
    try:
        store.bind(facts)
        done = store.done_request_ids()
    except BaseException:
        store.close()
        raise
    todo = [r for r in requests if r.id not in done]
    summary.already_done = len(requests) - len(todo)
    return store, summary, todo, run_device


def load_engine(contract: Contract, device: str, dtype: str | None = None,
                kv_amax: list[list[float]] | None = None) -> tuple[Engine, PreTrainedTokenizerBase, int | None]:
    """(engine, tokenizer, max_positions): the model loaded once on `device` (resolved) with every
    contract candidate (fp8 pilot scales from `kv_amax`), as a local run and each Ray worker use it."""
    candidates = build_candidates(contract, kv_amax)  # before the model: a press_kwargs typo fails fast
    attn = "eager" if any(needs_attention_weights(c.press) for c in candidates) else "sdpa"
    model, tokenizer = load_model(
        contract.model,
        device=device,
        dtype=dtype or contract.protocol.dtype,
        attn_implementation=attn,
    )
    engine = Engine(
        model,
        tokenizer,
        candidates,
        max_new_tokens=contract.protocol.max_new_tokens,
        agreement=agreement_settings(contract),
        lookahead_tokens=lookahead_tokens(contract),
        query_aware=contract.protocol.query_aware,
    )
    return engine, tokenizer, getattr(model.config, "max_position_embeddings", None)


def calibrate_request(
    request: Request, engine: Engine, tokenizer: PreTrainedTokenizerBase, contract: Contract, max_positions: int | None
) -> tuple[list[dict] | None, str | None]:
    """Request → records: ``(records, None)``, the store records of :func:`request_records`, or ``(None, reason)``
    when the request cannot run. The one per-request step of every executor; raises
    :class:`CertkvError` on a systematic press failure (a run must stop, not skip every request)."""
    enc = encode_request(tokenizer, request.context, request.question, request.answer_prefix)
    reason = skip_reason(request, len(enc.context_ids), len(enc.question_ids), contract, max_positions)
    if reason is not None:
        return None, reason
    try:
        result = engine.run(request.context, request.question, request.answer_prefix)
    except RequestNotRunnable as exc:
        return None, str(exc)
    except AssertionError as exc:
        # kvpress states its presses' requirements as asserts. One that is not a known property
        # of the request (above) is systematic: recording it as a skip would silently skip
        # every request, so stop instead; everything stored so far is kept.
        message = " ".join(str(exc).split()) or "assertion failed"
        raise CertkvError(
            f"a press failed on request {request.id!r}: {message}; fix the contract's presses "
            "(the requests stored so far are kept; rerun to resume)"
        ) from None
    return request_records(request, result, contract, request_signals(enc.context_ids, enc.question_ids)), None


def record_request(
    store: CalibrationStore, summary: CalibrationSummary, request_id: str, records: list[dict] | None, reason: str | None
) -> None:
    """Write one request's outcome in one transaction (its records, or its skip reason) and count it."""
    t0 = time.perf_counter()
    if reason is not None:
        store.write_skipped(request_id, reason)
        summary.skipped[request_id] = reason
    else:
        assert records is not None  # calibrate_request returns records or a skip reason
        store.write_request(request_id, records)
        summary.calibrated += 1
    summary.write_seconds += time.perf_counter() - t0
