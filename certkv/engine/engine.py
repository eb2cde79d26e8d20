"""Answers one request with the full cache and with every candidate press, from one prefill.

Score-based presses (plain kvpress ScorerPress subclasses) take the fast path: their top-k indices
are recorded during the single full prefill (:mod:`certkv.engine.scoring`) and their answers are
decoded together (:mod:`certkv.engine.batched_decode`). Decoding-time presses whose choices survive
a batched forward decode together as lanes drafted by the full answer (:mod:`certkv.engine.decoding_lanes`);
any other press (wrappers, threshold presses, the rest of the decoding-time ones) runs through
kvpress's own context manager with a prefill of its own. Both are labelled ``path="pipeline"`` in
the records: each answer is its own generation (a drafted lane's seconds are its batch's, shared
evenly). A request that has such decoding-time presses decodes its gathered candidates (fast-path
and response-aware) as lanes of the same batch, still labelled ``path="fast"``, each with its share
of the batch's time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from kvpress import DecodingPress, FastKVzipPress, ObservedAttentionPress
from transformers import DynamicCache

from certkv.core.gate_features import answer_confidence
from certkv.core.kv_cost import kv_cost, prefill_press_held
from certkv.core.policy_names import REFERENCE_POLICY
from certkv.core.spec import DEFAULT_MAX_NEW_TOKENS
from certkv.engine.batched_decode import decode_candidates, kept_count, padded_cache
from certkv.engine.decode_reserve import decode_reserve
from certkv.engine.decoding_lanes import batchable_decoding_press, decode_lanes, prefilled_lane, run_of
from certkv.engine.decoding_run import is_decoding_press, run_decoding
from certkv.engine.format_lanes import format_lane, lane_format, lane_run
from certkv.engine.format_run import head_dim, run_in_format
from certkv.engine.full_cache import context_tensor, decode_full, prefill_full
from certkv.engine.positions import continues_from_compressed_length
from certkv.engine.probabilistic_decode import decode_probabilistic
from certkv.engine.ragged_decode import Lane, LaneCache, gather_layer
from certkv.engine.scoring import is_fast_path_press
from certkv.model.generation import encode_request, for_protocol, greedy_decode, stop_token_ids
from certkv.model.layers import attention_modules
from certkv.model.window_queries import capturing_window_queries
from certkv.presses.probabilistic import ProbabilisticPress
from certkv.presses.registry import press_tree
from certkv.presses.response_aware import is_response_aware_press, prefill_observers
from certkv.signals.agreement import AgreementRecorder
from certkv.signals.lookahead import evicted_mass, lookahead_probe

if TYPE_CHECKING:
    from kvpress import BasePress
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from certkv.kv_formats.spec import KvFormat
    from certkv.model.generation import EncodedRequest


class RequestNotRunnable(Exception):
    """A request some candidate press cannot run on (e.g. shorter than SnapKV's window)."""


@dataclass
class PressCandidate:
    """A built press ready to run: the engine's view of a contract candidate.

    ``policy`` is the candidate's name (``snapkv@0.50``), ``press`` the press object at that
    retention (None: every token kept), ``press_name`` its registry name, ``kv_retained`` the
    nominal KV fraction, ``kv_format`` the format its KV is stored in (None: the model's dtype).
    """

    policy: str
    press: Any
    press_name: str
    kv_retained: float
    kv_format: KvFormat | None = None


@dataclass
class CandidateAnswer:
    """One answer of a request and its recorded signals.

    ``confidence_min`` / ``logprob_mean``: the lowest token probability and the mean log p of the
    answer's own greedy tokens (:func:`certkv.core.gate_features.answer_confidence`).
    ``lookahead_heads``: per (layer, KV head), layer-major, the lookahead probe's attention mass
    on the context entries this candidate evicts (:func:`certkv.signals.lookahead.evicted_mass`),
    ``lookahead_mass`` its maximum; None when the engine runs no probe, for the full cache, and on
    the pipeline path (kvpress prunes there, the kept indices are not known).
    ``seconds``: on the pipeline path the candidate's whole run (a decoding-time lane: its share of
    its batch's); on the fast path its share of the scoring a response-aware press does after the
    prefill (0 for the others, whose cost is their share of the batched decodes,
    ``Result.seconds["candidates_fast"]``), plus, when it decoded as a lane (``own_seconds``), its
    share of the lanes' batch.
    ``kv_peak`` / ``kv_time``: the generation's KV relative to the full cache's
    (:mod:`certkv.core.kv_cost`), ``kv_peak_bytes`` / ``kv_time_bytes`` the same in bytes relative
    to a 16-bit full cache's (equal to the token shares unless a KV format stores it);
    ``logprobs``: each generated token's log p (None: not known).
    ``confidence_min_agreeing``: the lowest token probability up to and including the first token
    where the answer departs from the full-KV answer (over all of it when it never does): a
    recompute gate that fires there restarts on the full cache before anything wrong was produced.
    ``certificate_max_agreeing``: the same for the largest step certificate (``certificates``: per
    token, certkv's probabilistic decoding press only).
    ``own_seconds``: ``seconds`` already holds a fast candidate's share of the decode it took part
    in (a gathered candidate decoded as a lane beside decoding-time ones); otherwise its share of the
    request's batched fast decodes (``candidates_fast``) is added when it is recorded.
    """

    policy: str
    press: str
    kv_retained: float
    kv_retained_actual: float
    answer: str
    token_ids: list[int]
    path: str
    seconds: float = 0.0
    certificate_max: float | None = None
    confidence_min: float | None = None
    logprob_mean: float | None = None
    lookahead_heads: list[float] | None = None
    lookahead_mass: float | None = None
    kv_peak: float | None = None
    kv_time: float | None = None
    kv_peak_bytes: float | None = None
    kv_time_bytes: float | None = None
    logprobs: list[float] | None = None
    confidence_min_agreeing: float | None = None
    certificates: list[float] | None = None
    certificate_max_agreeing: float | None = None
    own_seconds: bool = False

    def set_confidence(self, logprobs: Sequence[float] | None) -> None:
        """Record the answer's confidence signals from its per-token log p (None: not known)."""
        if logprobs is not None:
            self.logprobs = list(logprobs)
            self.confidence_min, self.logprob_mean = answer_confidence(logprobs)

    def set_agreement_with(self, full_ids: Sequence[int]) -> None:
        """``confidence_min_agreeing`` against the full-KV answer's token ids (needs `logprobs`)."""
        if self.logprobs is None:
            return
        diverged = next((t for t, (a, b) in enumerate(zip(self.token_ids, full_ids)) if a != b), None)
        if diverged is None:
            diverged = min(len(self.token_ids), len(full_ids))  # a prefix of the other: the next token
        upto = self.logprobs[: diverged + 1]
        self.confidence_min_agreeing = answer_confidence(upto)[0] if upto else None
        if self.certificates is not None:
            self.certificate_max_agreeing = max(self.certificates[: diverged + 1], default=0.0)

    def set_lookahead(self, heads: list[float] | None) -> None:
        self.lookahead_heads = heads
        self.lookahead_mass = None if heads is None else max(heads)


@dataclass
class RequestResult:
    """Full-KV answer and every candidate's answer for one request."""

    full: CandidateAnswer
    candidates: list[CandidateAnswer] = field(default_factory=list)
    context_length: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    agreement_drop: float | None = None


@dataclass
class _Prefilled:
    """One request in :meth:`Engine.run` after its single full prefill: the full cache, what each
    fast candidate keeps of it (`by_candidate`; also, under ``<policy>#prefilling``, what a decoding
    lane's prefilling scorer keeps) and each probabilistic candidate's sample
    (`sampled`); the lookahead probe (None: no probe) and the KV heads per layer; the time the
    candidates' evicted mass has taken so far (counted as lookahead); and per response-aware
    candidate its share of the scoring it shares with the retentions of its press
    (`select_seconds`, policy -> seconds)."""

    enc: Any
    n_ctx: int
    cache: Any
    by_candidate: dict
    sampled: dict
    probe: Any = None
    n_kv_heads: int = 0
    mass_seconds: float = 0.0
    select_seconds: dict = field(default_factory=dict)

    def set_lookahead(self, answer: CandidateAnswer, kept) -> None:
        """`answer`'s lookahead signal: the probe's mass on the entries `kept` evicts (timed into mass_seconds)."""
        tm = time.perf_counter()
        answer.set_lookahead(None if self.probe is None else evicted_mass(self.probe.weights, kept, self.n_kv_heads))
        self.mass_seconds += time.perf_counter() - tm


def _prefilling_key(policy: str) -> str:
    """Where a decoding-time lane's prefilling scorer records its kept entries in the full prefill's
    selections (beside the fast candidates', keyed by policy: ``#`` is in no policy name)."""
    return f"{policy}#prefilling"


class Engine:
    """Evaluates a fixed list of candidates on requests, one full prefill per request."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        candidates: list[PressCandidate],
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        max_batch_bytes: int = 4 << 30,
        max_padding_bytes: int = 1 << 30,
        agreement: dict | None = None,
        lookahead_tokens: int | None = None,
        query_aware: bool = False,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.candidates = list(candidates)
        self.max_new_tokens = max_new_tokens
        self.max_batch_bytes = max_batch_bytes  # padded candidate caches decoded at once
        self.max_padding_bytes = max_padding_bytes
        self._pool: dict = {}  # batch cache buffers reused from request to request
        self.stop_ids = stop_token_ids(model)
        # The gate signal of every request, from the same prefill (settings: the contract's gate;
        # None: not recorded).
        self.recorder = None if agreement is None else AgreementRecorder(**agreement)
        # The lookahead probe's answer tokens A (None: no probe, no lookahead signal).
        if lookahead_tokens is not None and lookahead_tokens < 0:
            raise ValueError(f"lookahead_tokens must be at least 0, got {lookahead_tokens}")
        self.lookahead_tokens = lookahead_tokens
        # The contract's protocol: whether the question is prefilled with the context (for_protocol).
        self.query_aware = query_aware
        # Stored in a KV format: each its own generation (certkv.engine.format_run), a format alone
        # primed from the request's full prefill.
        self.formatted = [c for c in self.candidates if c.kv_format is not None]
        # ... of which certkv's per-token formats, alone or beside a plain scorer (its kept entries
        # chosen in the full prefill), decode as lanes of one batch drafted by the full answer
        # (certkv.engine.format_lanes); the others each alone.
        self.format_lanes = [c for c in self.formatted if lane_format(c.kv_format, c.press)]
        pressed = [c for c in self.candidates if c.kv_format is None]
        self.probabilistic = [c for c in pressed if is_probabilistic_press(c.press)]
        self.fast = [c for c in pressed if is_fast_path_press(c.press)]
        self.response_aware = [c for c in pressed if is_response_aware_press(c.press)]
        # Decoded from kept entries gathered out of the full cache: kvpress's scorers, chosen in the
        # prefill, and the response-aware presses, chosen right after it.
        self.gathered = self.fast + self.response_aware
        # Compress while decoding: lanes of one batch drafted by the full answer where the press's
        # choices survive it (decoding_lanes), else each on its own as kvpress's pipeline does (decoding_run).
        self.decoding = [c for c in pressed if is_decoding_press(c.press)]
        self.decoding_lanes = [c for c in self.decoding if batchable_decoding_press(c.press, model)]
        # A lane whose press also compresses prefills (a batchable one's prefilling half is a plain
        # kvpress scorer) takes that scorer's kept entries from the request's one full prefill,
        # recorded there beside the fast candidates' (prefilled_lane).
        self.prefilling_scorers = {_prefilling_key(c.policy): c.press.prefilling_press for c in self.decoding_lanes
                                   if getattr(c.press, "prefilling_press", None) is not None}
        self.slow = [
            c for c in pressed
            if c not in self.gathered and c not in self.decoding and not is_probabilistic_press(c.press)
        ]

    @property
    def lane_candidates(self) -> list[PressCandidate]:
        """The candidates a request decodes as lanes of one ragged batch (:meth:`_decoding_lanes_answers`):
        the batchable decoding-time ones and, beside them, the gathered ones; none without the former."""
        return [*self.decoding_lanes, *self.gathered] if self.decoding_lanes else []

    def _chunks(self, cache, kept: dict[str, int], reserve: int) -> list[list[PressCandidate]]:
        """Fast candidates grouped into padded batches, longest kept caches first.

        Lanes are padded to the longest cache of their batch, but attention skips the padding (lanes
        are right-aligned and attended in groups of equal length), so padding costs only memory
        and the gather: one batch is best (each forward reads every weight once). A batch closes
        once its padding would exceed `max_padding_bytes`, or its size `max_batch_bytes`.
        """
        per_token = _bytes_per_token(cache)
        chunks: list[list[PressCandidate]] = []
        current: list[PressCandidate] = []
        for c in sorted(self.gathered, key=lambda c: -kept[c.policy]):
            longest = kept[current[0].policy] if current else kept[c.policy]
            size = (len(current) + 1) * (longest + reserve) * per_token
            padding = sum(longest - kept[x.policy] for x in current + [c]) * per_token
            if current and (size > self.max_batch_bytes or padding > self.max_padding_bytes):
                chunks.append(current)
                current = []
            current.append(c)
        if current:
            chunks.append(current)
        return chunks

    def _probabilistic_chunks(self, cache, width: int) -> list[list[PressCandidate]]:
        """Probabilistic candidates in batches of at most `max_batch_bytes` (a lane holds up to the
        whole context: sampled lanes are padded to the widest)."""
        per_lane = _bytes_per_token(cache) * width
        size = max(1, self.max_batch_bytes // max(1, per_lane))
        return [self.probabilistic[i : i + size] for i in range(0, len(self.probabilistic), size)]

    def precondition_failure(self, context_length: int) -> str | None:
        """Why a press cannot run on a context this short (kvpress states these as asserts)."""
        for c in self.candidates:
            failure = press_precondition_failure(c.press, context_length)
            if failure:
                return f"{c.policy}: {failure}"
        return None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def run(self, context: str, question: str, answer_prefix: str = "") -> RequestResult:
        """Every answer of one request under the engine's protocol (`answer_prefix` after the
        question, see :func:`encode_request`); ``context_length`` in the result is the prefill's
        length (the context, and in the query-aware protocol the question but its last token),
        which the kept fractions are shares of."""
        enc = for_protocol(encode_request(self.tokenizer, context, question, answer_prefix), self.query_aware)
        n_ctx = len(enc.context_ids)
        reason = self.precondition_failure(n_ctx)
        if reason:
            raise RequestNotRunnable(reason)
        seconds: dict[str, float] = {}
        t0 = time.perf_counter()
        prefilled, agreement_drop = self._prefill(enc)
        t1 = time.perf_counter()
        seconds["prefill"] = t1 - t0
        self._probe(prefilled)
        t1a = time.perf_counter()
        seconds["lookahead"] = t1a - t1
        self._select(prefilled)
        t1b = time.perf_counter()
        seconds["response_select"] = t1b - t1a

        # The full-KV answer, decoded speculatively (prompt lookup); it drafts for every candidate.
        # With decoding lanes it is the first lane of their batch, drafting them as it grows.
        answers: dict[str, CandidateAnswer] = {}
        if self.decoding_lanes:
            draft, full_logprobs, seconds["full_decode"] = self._decoding_lanes_answers(prefilled, answers)
        else:
            logprobs_out: list = [None]
            draft = decode_full(self.model, prefilled.cache, enc, self.max_new_tokens, self.stop_ids, logprobs=logprobs_out)
            full_logprobs, seconds["full_decode"] = logprobs_out[0], time.perf_counter() - t1b
        full = CandidateAnswer(REFERENCE_POLICY, REFERENCE_POLICY, 1.0, 1.0, self._decode(draft), draft, "full")
        full.set_confidence(full_logprobs)
        t2a = time.perf_counter()
        lanes_mass = prefilled.mass_seconds  # the evicted mass of gathered candidates decoded as lanes
        seconds["candidates_decoding"] = t2a - t1b - seconds["full_decode"] - lanes_mass
        verify: dict[str, float] = {}
        reserve = decode_reserve(len(enc.question_ids), self.max_new_tokens)
        self._fast_answers(prefilled, draft, reserve, answers, verify)
        self._probabilistic_answers(prefilled, reserve, answers)
        t3 = time.perf_counter()
        seconds["candidates_fast"] = t3 - t2a - (prefilled.mass_seconds - lanes_mass)
        seconds["lookahead"] += prefilled.mass_seconds  # the probe and every candidate's evicted mass
        seconds["candidates_verify"] = verify.get("verify", 0.0)  # part of candidates_fast
        for c in self.slow:
            answers[c.policy] = self._run_pipeline(c, enc, context_tensor(self.model, enc.context_ids))
        for c in self.decoding:
            if c not in self.decoding_lanes:
                answers[c.policy] = self._run_decoding(c, enc)
        self._format_lanes_answers(prefilled, draft, answers)
        for c in self.formatted:
            if c not in self.format_lanes:
                answers[c.policy] = self._run_in_format(c, enc, prefilled.cache)
        seconds["candidates_pipeline"] = time.perf_counter() - t3
        _set_generation_costs(full, answers.values(), n_ctx, len(enc.question_ids))
        return RequestResult(full, [answers[c.policy] for c in self.candidates], n_ctx, seconds, agreement_drop)

    def _prefill(self, enc: EncodedRequest) -> tuple[_Prefilled, float | None]:
        """The request's one full prefill, recording every fast candidate's kept indices, every
        probabilistic candidate's sample and (with a recorder) the agreement drop."""
        cache, by_candidate, sampled = prefill_full(
            self.model,
            enc.context_ids,
            {**{c.policy: c.press for c in self.fast}, **self.prefilling_scorers,
             **{c.policy: c.press for c in self.format_lanes if c.press is not None}},
            {c.policy: c.press for c in self.probabilistic},
            self.recorder,
            prefill_observers(c.press for c in self.response_aware),
        )
        agreement_drop = None
        if self.recorder:
            agreement_drop = self.recorder.drop()
            self.recorder.reset()
        return _Prefilled(enc, len(enc.context_ids), cache, by_candidate, sampled), agreement_drop

    def _probe(self, prefilled: _Prefilled) -> None:
        """Where the full-cache answer's first queries look, while the full cache exists (the probe
        leaves it cropped to the context); each candidate's evicted share follows from it."""
        if self.lookahead_tokens is not None:
            prefilled.probe = lookahead_probe(
                self.model,
                prefilled.cache,
                prefilled.enc.question_ids,
                prefilled.n_ctx,
                self.lookahead_tokens,
                self.stop_ids,
            )
        prefilled.n_kv_heads = prefilled.cache.layers[0].keys.shape[1]

    def _select(self, prefilled: _Prefilled) -> None:
        """Every response-aware candidate's kept entries, chosen over the full cache after the
        prefill; candidates that differ only in retention share one scoring (``score_key``), whose
        time is split evenly among them."""
        scored: dict[tuple, list[torch.Tensor]] = {}
        sharing: dict[tuple, list[str]] = {}
        seconds: dict[tuple, float] = {}
        for c in self.response_aware:
            if c.press.compression_ratio == 0:
                prefilled.by_candidate[c.policy] = [None] * len(prefilled.cache.layers)
                continue
            key = c.press.score_key()
            t = time.perf_counter()
            if key not in scored:
                scored[key] = c.press.checked_scores(self.model, prefilled.cache, prefilled.enc, self.stop_ids)
            prefilled.by_candidate[c.policy] = c.press.top_k(scored[key])
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t
            sharing.setdefault(key, []).append(c.policy)
        for key, policies in sharing.items():
            for policy in policies:
                prefilled.select_seconds[policy] = seconds[key] / len(policies)

    def _fast_answers(self, prefilled: _Prefilled, draft: list[int], reserve: int, answers: dict, verify: dict) -> None:
        """The fast candidates' answers into `answers`, decoded in padded batches from the full
        answer's draft (none left to do when they decoded as lanes: :meth:`_decoding_lanes_answers`)."""
        if self.decoding_lanes:
            return
        enc, n_ctx, by_candidate = prefilled.enc, prefilled.n_ctx, prefilled.by_candidate
        kept = {c.policy: kept_count(by_candidate[c.policy], n_ctx) for c in self.gathered}
        for chunk in self._chunks(prefilled.cache, kept, reserve):
            batch, mask, lengths = padded_cache(
                prefilled.cache, [by_candidate[c.policy] for c in chunk], n_ctx, reserve=reserve, pool=self._pool
            )
            chunk_logprobs: list = [None] * len(chunk)
            token_lists = decode_candidates(
                self.model,
                batch,
                mask,
                enc.question_ids,
                draft,
                n_ctx,
                self.max_new_tokens,
                self.stop_ids,
                context_ids=enc.context_ids,
                timings=verify,
                logprobs=chunk_logprobs,
            )
            del batch
            for c, length, ids, lp in zip(chunk, lengths, token_lists, chunk_logprobs):
                answers[c.policy] = self._gathered_answer(c, prefilled, ids, lp, length)

    def _probabilistic_answers(self, prefilled: _Prefilled, reserve: int, answers: dict) -> None:
        """The probabilistic candidates' answers into `answers`, each decoded from its sample of the full cache."""
        results = []
        for chunk in self._probabilistic_chunks(prefilled.cache, prefilled.n_ctx + reserve):
            results += decode_probabilistic(
                self.model,
                prefilled.cache,
                [prefilled.sampled[c.policy] for c in chunk],
                prefilled.enc.question_ids,
                prefilled.n_ctx,
                self.max_new_tokens,
                self.stop_ids,
            )
        for c, result in zip(self.probabilistic, results):
            answer = answers[c.policy] = CandidateAnswer(
                c.policy,
                c.press_name,
                c.kv_retained,
                result.kept_fraction,
                self._decode(result.token_ids),
                result.token_ids,
                "fast",
                certificate_max=result.certificate_max,
            )
            answer.set_confidence(result.logprobs)
            prefilled.set_lookahead(answer, prefilled.sampled[c.policy])

    def _run_pipeline(self, c: PressCandidate, enc: EncodedRequest, context_ids: torch.Tensor) -> CandidateAnswer:
        """kvpress's own path: prefill under the press's context manager, then decode.

        `context_ids` is the encoded context as a (1, n_ctx) long tensor on the model's device."""
        t0 = time.perf_counter()
        n_ctx = context_ids.shape[1]
        cache = DynamicCache()
        with torch.no_grad(), c.press(self.model), capturing_window_queries(self.model):  # as the runtime
            self.model.model(input_ids=context_ids, past_key_values=cache)
        kept = kept_entries(cache, self.model)
        # As kvpress's pipeline: presses that re-rotate or restore keys continue positions from the
        # compressed length instead of the original one.
        if continues_from_compressed_length(c.press):
            n_ctx = cache.get_seq_length()
        logprobs: list[float] = []
        ids = greedy_decode(self.model, cache, enc.question_ids, n_ctx, self.max_new_tokens, logprobs=logprobs)
        answer = CandidateAnswer(
            c.policy,
            c.press_name,
            c.kv_retained,
            kept / n_ctx,
            self._decode(ids),
            ids,
            "pipeline",
            time.perf_counter() - t0,
        )
        answer.set_confidence(logprobs)
        return answer


    def _run_in_format(self, c: PressCandidate, enc: EncodedRequest, full) -> CandidateAnswer:
        """A candidate stored in a KV format: its own generation (:func:`run_in_format`), a format
        alone primed from the request's full prefill `full` (its context entries)."""
        assert c.kv_format is not None  # only formatted candidates come here
        t0 = time.perf_counter()
        run = run_in_format(self.model, c.kv_format, enc, self.max_new_tokens, c.press, full=full if c.press is None else None)
        answer = self._decoding_answer(c, enc, run, time.perf_counter() - t0)
        cost = kv_cost(run.held_units, len(enc.context_ids), len(enc.question_ids))
        answer.kv_peak_bytes, answer.kv_time_bytes = cost.peak, cost.time
        return answer

    def _format_lanes_answers(self, prefilled: _Prefilled, draft: list[int], answers: dict) -> None:
        """The lane-decoded formats' answers into `answers` (:mod:`certkv.engine.format_lanes`): lanes
        over the full prefill's context entries, stored in each format, drafted by the full answer,
        decoded together in batches of at most `max_batch_bytes`; each lane's time is its batch's
        shared evenly."""
        enc = prefilled.enc
        n_ctx, n_q = len(enc.context_ids), len(enc.question_ids)
        per_lane = _bytes_per_token(prefilled.cache) * (n_ctx + n_q + self.max_new_tokens + 1)
        size = max(1, self.max_batch_bytes // max(1, per_lane))
        size_of_head = head_dim(self.model)
        for i in range(0, len(self.format_lanes), size):
            group = self.format_lanes[i : i + size]
            t0 = time.perf_counter()
            selections = [prefilled.by_candidate.get(c.policy) for c in group]
            formats = [c.kv_format for c in group]
            assert all(formats)  # format lanes have one
            lanes = [format_lane(fmt, prefilled.cache.layers, enc, self.max_new_tokens, self.stop_ids, draft, kept)
                     for fmt, kept in zip(formats, selections) if fmt is not None]
            decode_lanes(self.model, lanes)
            share = (time.perf_counter() - t0) / len(lanes)
            for c, lane, kept in zip(group, lanes, selections):
                assert c.kv_format is not None  # format lanes have one
                run = lane_run(lane, c.kv_format, size_of_head, kept_count(kept or [None], n_ctx))
                answer = answers[c.policy] = self._decoding_answer(c, enc, run, share)
                cost = kv_cost(run.held_units, n_ctx, n_q)
                answer.kv_peak_bytes, answer.kv_time_bytes = cost.peak, cost.time

    def _decoding_answer(self, c: PressCandidate, enc: EncodedRequest, run, seconds: float) -> CandidateAnswer:
        """A decoding-time candidate's answer from its run: kept fraction of the prefill, confidence, KV cost."""
        n_ctx, n_q = len(enc.context_ids), len(enc.question_ids)
        answer = CandidateAnswer(
            c.policy, c.press_name, c.kv_retained, run.prefill_kept / n_ctx, self._decode(run.token_ids),
            run.token_ids, "pipeline", seconds,
        )
        answer.set_confidence(run.logprobs)
        answer.certificate_max = run.certificate_max  # certkv's probabilistic decoding press only
        answer.certificates = run.certificates if run.certificate_max is not None else None
        cost = kv_cost(run.held, n_ctx, n_q)
        answer.kv_peak, answer.kv_time = cost.peak, cost.time
        return answer

    def _decoding_lanes_answers(self, prefilled: _Prefilled, answers: dict) -> tuple[list[int], list[float], float]:
        """The full answer, and the batchable decoding-time candidates' answers into `answers`,
        decoded together as lanes of one ragged batch (:mod:`certkv.engine.decoding_lanes`) from the
        request's intact full prefill (whose context entries the candidates that do not compress
        prefills start from). Returns the full answer's ids, their log p and its share of the time.

        The full answer is the first lane (prompt lookup, as :func:`decode_full` decodes it) and
        drafts the others as it grows: a candidate proposes its next tokens while it follows it,
        prompt lookup otherwise. A long answer the lookup cannot draft takes a forward a token, and
        a forward of few tokens costs about as much as its weights take to read, so the full answer's
        forwards are shared with the candidates' instead of coming before them.

        The gathered (prefill-time) candidates of such a request join the same lanes, each from its
        kept entries of the full prefill: a long answer that leaves the draft decodes for many
        forwards, and in one batch each forward reads the weights once for every candidate.

        A lane is allocated at most its whole prompt and answer, so the lanes decoded at once are
        capped by `max_batch_bytes` as the fast path's batches are; each lane's time is its batch's
        shared evenly (a lane is not timed on its own)."""
        enc, full = prefilled.enc, prefilled.cache
        per_lane = _bytes_per_token(full) * (len(enc.context_ids) + len(enc.question_ids) + self.max_new_tokens + 1)
        size = max(1, self.max_batch_bytes // max(1, per_lane))
        t0 = time.perf_counter()
        lead, members = self._full_lane(prefilled), self.lane_candidates
        lead_seconds = time.perf_counter() - t0  # its copy of the context, then its share of the first batch
        # the first batch holds the full answer and size − 1 candidates (none: it decodes alone)
        groups = [members[: size - 1], *(members[i : i + size] for i in range(size - 1, len(members), size))]
        for i, group in enumerate(groups):
            t0 = time.perf_counter()
            lanes = [self._lane(c, prefilled, lead.answer) for c in group]
            t1 = time.perf_counter()
            batch = [lead] * (i == 0) + [lane for lane, _ in lanes]
            decode_lanes(self.model, batch)
            share = (time.perf_counter() - t1) / len(batch)
            if i == 0:
                lead_seconds += share
                lead.cache.layers.clear()  # its answer is all the later batches need
            for c, (lane, kept) in zip(group, lanes):
                seconds = (t1 - t0) / len(lanes) + share  # its share of the gathers, and of the decode
                if c in self.gathered:
                    answers[c.policy] = self._gathered_answer(c, prefilled, lane.answer, lane.logprobs, kept, seconds)
                else:
                    answers[c.policy] = self._decoding_answer(c, enc, run_of(lane, kept), seconds)
            del lanes, batch  # the next batch's caches are gathered after these are gone
        return lead.answer, lead.logprobs, lead_seconds

    def _full_lane(self, prefilled: _Prefilled) -> Lane:
        """The full-cache answer as a ragged lane over a copy of the full prefill's context entries,
        with prompt-lookup proposals (:func:`decode_full`'s answer, token for token)."""
        return self._gathered_lane(prefilled, [None] * len(prefilled.cache.layers), None)

    def _lane(self, c: PressCandidate, prefilled: _Prefilled, draft: list[int]) -> tuple[Lane, float]:
        """Candidate `c` of a request as a ragged lane drafted by the full answer, and the entries
        its prefill left: a decoding-time press's own prefill, or a gathered candidate's kept entries."""
        if c not in self.gathered:
            return prefilled_lane(self.model, c.press, prefilled.enc, self.max_new_tokens, self.stop_ids,
                                  full=prefilled.cache, draft=draft,
                                  selection=prefilled.by_candidate.get(_prefilling_key(c.policy)))
        selection = prefilled.by_candidate[c.policy]
        return self._gathered_lane(prefilled, selection, draft), float(kept_count(selection, prefilled.n_ctx))

    def _gathered_lane(self, prefilled: _Prefilled, selection: list, draft: list[int] | None) -> Lane:
        """A lane over the full prefill's context entries that `selection` keeps per layer (None: the
        whole layer), room for the question and answer, prompt lookup after `draft` (None: none)."""
        enc, n_ctx = prefilled.enc, prefilled.n_ctx
        room = len(enc.question_ids) + self.max_new_tokens + 1
        cache = LaneCache([gather_layer(layer.keys, layer.values, kept, n_ctx, room)
                           for layer, kept in zip(prefilled.cache.layers, selection)])
        return Lane(cache, list(enc.question_ids), n_ctx, self.max_new_tokens, self.stop_ids,
                    lookup_ids=list(enc.context_ids), want_logprobs=True, draft=draft)

    def _gathered_answer(self, c: PressCandidate, prefilled: _Prefilled, ids: list[int], logprobs: list[float],
                         kept: float, decode_seconds: float | None = None) -> CandidateAnswer:
        """A gathered candidate's answer: `ids` with their `logprobs`, from `kept` entries of the
        context; `decode_seconds`, its share of the lanes' decode when it decoded as a lane (else its
        share of the padded fast decodes is added when recorded: ``CandidateAnswer.own_seconds``)."""
        select = prefilled.select_seconds.get(c.policy, 0.0)
        answer = CandidateAnswer(c.policy, c.press_name, c.kv_retained, kept / prefilled.n_ctx, self._decode(ids), ids,
                                 "fast", seconds=select + (decode_seconds or 0.0), own_seconds=decode_seconds is not None)
        answer.set_confidence(logprobs)
        prefilled.set_lookahead(answer, prefilled.by_candidate[c.policy])
        return answer

    def _run_decoding(self, c: PressCandidate, enc: EncodedRequest) -> CandidateAnswer:
        """A decoding-time press's own generation (:func:`certkv.engine.decoding_run.run_decoding`);
        its kept fraction is the mean, over decoding steps, of the entries held over the tokens seen."""
        t0 = time.perf_counter()
        run = run_decoding(self.model, c.press, enc, self.max_new_tokens)
        return self._decoding_answer(c, enc, run, time.perf_counter() - t0)


def _set_generation_costs(full: CandidateAnswer, answers, n_ctx: int, n_question: int) -> None:
    """Every answer's KV cost (peak and KV-time) and its confidence up to its first departure from
    the full answer. A decoding-time candidate measured its own cost; any other one compressed
    the prefill only (to ``kv_retained_actual`` of the context) and then grew by a token a step."""
    full.kv_peak = full.kv_time = full.kv_peak_bytes = full.kv_time_bytes = 1.0
    for answer in answers:
        if answer.kv_peak is None:
            steps = max(1, len(answer.token_ids))
            cost = kv_cost(prefill_press_held(answer.kv_retained_actual * n_ctx, n_question, steps), n_ctx, n_question)
            answer.kv_peak, answer.kv_time = cost.peak, cost.time
        if answer.kv_peak_bytes is None:  # 16 bits a value: its bytes' shares are its tokens'
            answer.kv_peak_bytes, answer.kv_time_bytes = answer.kv_peak, answer.kv_time
        answer.set_agreement_with(full.token_ids)


def _bytes_per_token(cache) -> int:
    """Bytes one token takes in `cache`: keys and values of every layer and KV head."""
    layer = cache.layers[0]
    return len(cache.layers) * 2 * layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.element_size()


def press_precondition_failure(press: BasePress | None, context_length: int) -> str | None:
    """Why `press` (or a press inside it) cannot run on a context of `context_length` tokens, or None."""
    if getattr(press, "compression_ratio", None) == 0:
        return None  # kvpress leaves the cache untouched and never scores
    window_failure = decoding_window_failure(press)
    if window_failure:
        return window_failure
    for inner in press_tree(press):
        # FastKVzip's window_size chunks the prefill of long contexts; a short one simply fits in it.
        window = None if isinstance(inner, FastKVzipPress) else getattr(inner, "window_size", None)
        if isinstance(window, int) and context_length <= window:
            return f"context of {context_length} tokens does not exceed the press window {window}"
        n_sink = getattr(inner, "n_sink", None)
        if isinstance(n_sink, int) and context_length <= n_sink:
            return f"context of {context_length} tokens does not exceed its {n_sink} sink tokens"
    return None


def decoding_window_failure(press: BasePress | None) -> str | None:
    """Why a decoding-time press inside `press` cannot score: its scorer reads a window of queries
    longer than the hidden states it buffers between compressions (kvpress asserts it mid-decode)."""
    for inner in press_tree(press):
        if not isinstance(inner, DecodingPress):
            continue
        window = getattr(inner.base_press, "window_size", None)
        buffered = min(inner.compression_interval, inner.hidden_states_buffer_size or inner.compression_interval)
        if isinstance(window, int) and buffered <= window:
            return (
                f"its decoding press scores with the {buffered} hidden states it buffers between compressions, "
                f"no more than its scorer's window {window}; raise compression_interval (and "
                f"hidden_states_buffer_size) above {window}"
            )
    return None


def is_probabilistic_press(press: object) -> bool:
    """certkv's Poisson-sampled press: decoded under the Hájek attention, with certificates."""
    return isinstance(press, ProbabilisticPress)


def needs_attention_weights(press: BasePress | None) -> bool:
    """Whether `press` or a press inside it scores from the attention weights themselves, which
    only eager attention returns."""
    return any(isinstance(inner, ObservedAttentionPress) for inner in press_tree(press))


def kept_entries(cache: DynamicCache, model: PreTrainedModel) -> float:
    """Mean number of context entries kept per layer and KV head (head-wise masks counted out).

    `cache` is the pruned cache, keys (1, H_kv, n_kept, d) per layer; an attention module's
    head-wise mask (kvpress's ``masked_key_indices``, when its press set one) is the (batch, head,
    position) index tensors of its masked entries."""
    total = 0.0
    modules = attention_modules(model)
    for layer_idx, module in enumerate(modules):
        length = cache.layers[layer_idx].keys.shape[2]
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:
            n_heads = cache.layers[layer_idx].keys.shape[1]
            total += length - masked[0].numel() / n_heads
        else:
            total += length
    return total / len(modules)
