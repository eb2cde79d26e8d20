"""`certkv calibrate`: run every request under the full cache and every candidate, store the losses.

The loop is resumable by construction: each request's records (the full cache and every candidate)
are written in one store transaction, requests already in the store are skipped on restart, and a
request that cannot run is recorded as skipped with its reason, so the run goes on.

The run itself (the store opened and bound, each outcome written by a :class:`Recorder`) is
:mod:`certkv.calibration.driver`'s, torch-free; this module is the model's side of it:
:class:`LocalExecutor` runs the requests here, and every executor that loads the model (this one,
:class:`certkv.calibration.ray_executor.RayExecutor`) turns a request into its records with
:func:`calibrate_request` on a model loaded once by :func:`load_engine`. :func:`calibrate` is the
driver's run on the local executor unless another is given.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from transformers import PreTrainedTokenizerBase

from certkv.calibration.driver import (  # noqa: F401  (re-exported: the run's names, as they were here)
    CalibrationSummary,
    Executor,
    OnWritten,
    Recorder,
    labelled,
    open_run,
    record_head,
    record_request,
    requests_digest,
    run_calibration,
)
from certkv.calibration.progress import progress_bar
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
from certkv.model.loading import load_model
from certkv.presses.registry import build_press
from certkv.requests.request_set import Request


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
            **record_head(request, REFERENCE_POLICY, REFERENCE_POLICY, 1.0, 1.0, utility_full, utility_full, full.answer),
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
                **record_head(
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
    return labelled(records, request, contract)


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


def calibrate(contract: Contract, *, executor: Executor | None = None, **options: Any) -> CalibrationSummary:
    """:func:`certkv.calibration.driver.run_calibration` on `executor`, by default a :class:`LocalExecutor`
    (the model in this process); `options` are that function's (new_store, limit, quiet, device, dtype,
    console, on_written)."""
    return run_calibration(contract, executor=executor if executor is not None else LocalExecutor(), **options)


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


def load_engine(contract: Contract, device: str, dtype: str | None = None,
                kv_amax: list[list[float]] | None = None) -> tuple[Engine, PreTrainedTokenizerBase, int | None]:
    """(engine, tokenizer, max_positions): the model loaded once on `device` (resolved) with every
    contract candidate (fp8 pilot scales from `kv_amax`), as a local run and each Ray worker use it."""
    candidates = build_candidates(contract, kv_amax)  # before the model: a press_kwargs typo fails fast
    attn = "eager" if any(needs_attention_weights(c.press) for c in candidates) else "sdpa"
    model, tokenizer = load_model(
        contract.local_model,
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
