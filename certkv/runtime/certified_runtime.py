"""Serve a certified operating point: the press at its certified retention, behind its gate.

:class:`CertifiedRuntime` answers one request at a time the way calibration measured it, so that
what is deployed is exactly what was certified:

1. Operating points that fell back, requests outside the certificate's coverage envelope
   (:mod:`certkv.core.coverage`: a stratum that was not calibrated, or none given to a stratified
   operating point; a context outside the calibrated length range) and requests the candidate
   cannot run (a context no longer than the press's window) are answered from the full cache. A
   stratified operating point routes each request to its stratum's own certified policy.
2. Fast-path presses (:func:`certkv.engine.scoring.is_fast_path_press`) and certkv's probabilistic
   press run on the engine's single-prefill path (:mod:`certkv.runtime.single_prefill`): one full
   prefill records the press's kept entries and the gate's signals; a pre-decode gate (agreement
   drop, lookahead, a learned score without confidence features) answers from that full cache,
   no second prefill; otherwise the kept entries are gathered and decoded, and a post-decode gate
   (certificate, confidence, a learned score with confidence features) escalates: the full answer
   is decoded from the full cache, which still exists.
3. Any other press runs through kvpress's own hooks, as calibration ran it
   (:mod:`certkv.runtime.pipeline`); its full-cache answers need a prefill of their own, and gates
   that read the lookahead probe are refused for it when the runtime is built. A decoding-time
   press decodes under its own hooks (:mod:`certkv.runtime.decoding_path`).

Every path answers behind its gate through the same flow (:mod:`certkv.runtime.gate_flow`); a
path supplies only how its press's answer is decoded and where its full answer comes from.

The gate's comparisons are those certification derived the gated records with
(:class:`certkv.core.spec.GateSettings`, applied by :mod:`certkv.runtime.gating`); the learned score is
:func:`certkv.core.gate_features.learned_score`.
Every answer comes with a :class:`Decision` record saying which cache answered, why, and the
signals it was decided on; ``seconds`` gives the time of each phase (prefill, probe, decode,
escalation) and the total.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from certkv.core.operating_point import OperatingPoint, load_operating_point
from certkv.core.policy_names import NO_PRESS
from certkv.core.signals import empty_signals, request_signals
from certkv.core.spec import DEFAULT_MAX_NEW_TOKENS, GateSettings
from certkv.engine.decoding_run import is_decoding_press
from certkv.engine.engine import is_probabilistic_press, press_precondition_failure
from certkv.engine.scoring import is_fast_path_press
from certkv.errors import CertkvError, format_validation_error
from certkv.kv_formats.spec import Fp8Format, key_value_formats, needs_pilot_scales, parse_format
from certkv.model.generation import EncodedRequest, encode_request, for_protocol, stop_token_ids
from certkv.presses.hajek_state import clear_states
from certkv.presses.probabilistic_decoding import ProbabilisticDecodingPress
from certkv.presses.registry import build_press, compression_ratio_for, is_known_press, resolve_press_class
from certkv.presses.response_aware import is_response_aware_press
from certkv.runtime.decision import Decision
from certkv.runtime.decoding_path import DecodingPath
from certkv.runtime.format_path import FormatPath
from certkv.runtime.full_path import full_answer_steps
from certkv.runtime.gate_flow import AnsweringPath
from certkv.runtime.gating import deployable
from certkv.runtime.pipeline import PipelinePath
from certkv.runtime.prefix_cache import PrefixScope, bypass_reason
from certkv.runtime.single_prefill import SinglePrefillPath
from certkv.runtime.steps import PathAnswer, run_alone

if TYPE_CHECKING:
    from collections.abc import Generator

    from kvpress import BasePress
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from certkv.kv_formats.spec import KvFormat
    from certkv.runtime.prefix_cache import PrefixCache
    from certkv.runtime.steps import Step


def _check_request_types(context: object, question: object, stratum: object, answer_prefix: object) -> None:
    """One line (CertkvError) for a request field of the wrong type, before anything is encoded."""
    for name, value in (("context", context), ("question", question), ("answer_prefix", answer_prefix)):
        if not isinstance(value, str):
            raise CertkvError(f"{name} must be a string, got {type(value).__name__}")
    if stratum is not None and not isinstance(stratum, str):
        raise CertkvError(f"stratum must be a string or None, got {type(stratum).__name__}")


@dataclass
class RuntimeAnswer:
    """What :meth:`CertifiedRuntime.generate` returns: the answer and the decision behind it."""

    answer: str
    token_ids: list[int]
    decision: Decision
    seconds: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: ``prefill``, ``probe`` (lookahead), ``decode`` (the first answer decoded;
    a full answer with a prefill of its own includes that prefill), ``escalation`` (recomputing the
    full answer after the evicted path was taken), ``recompute`` (finishing an answer a recompute
    gate restarted) and ``total``; a phase that did not run is absent."""
    context_tokens: int = 0
    """Tokens of the encoded context (what the coverage envelope and ``context_tokens`` count)."""
    question_tokens: int = 0
    """Tokens of the encoded question fed after it."""
    prefix_cache: str | None = None
    """``hit``: decoded from the context's kept compressed cache, no prefill; ``miss``: prefilled, and
    its compressed cache kept for later questions; None: no prefix cache used
    (:mod:`certkv.runtime.prefix_cache`)."""


class CertifiedRuntime:
    """Answer requests with a certified operating point: what is deployed is what was calibrated.

    Parameters
    ----------
    model, tokenizer
        The calibrated model (:func:`certkv.load_model`).
    operating_point : OperatingPoint, dict or path
        An :class:`~certkv.core.operating_point.OperatingPoint`, its dict, or the path of its JSON
        (``certkv certify`` writes ``<store>/operating_point.json``).
    press : object, optional
        By default the press is built from the operating point (its registry name or import path,
        its press_kwargs and its kv_retained). Any press object may be passed instead, e.g. one
        that cannot be named; it must be configured at the certified retention (its
        ``compression_ratio`` is checked when it has one).
    max_new_tokens : int, optional
        The calibrated decode length by default; another length is refused, since the
        certificate covers answers of the calibrated length only.
    prefix_cache : PrefixCache, optional
        Keep each context's compressed cache for later questions on it
        (:class:`~certkv.runtime.prefix_cache.PrefixCache`): a question-agnostic point on the
        engine's single-prefill path then prefills and compresses a context once, with the same
        answers. A point that cannot use it (:attr:`prefix_bypass` says why) answers as without it;
        :meth:`prefix_cache_refusal` says when no part of the point can.

    A stratified operating point deploys one runtime per stratum (:attr:`strata`), each its
    stratum's certified policy; `press` cannot be passed for it. A fallback operating point
    answers every request from the full cache; a gated one sends a
    request to the full cache when its gate says so (:class:`Decision` records which and why).
    Fast-path and probabilistic presses prefill each request once (module docstring); a press on
    kvpress's pipeline path whose gate needs the lookahead probe is refused (CertkvError).

    Raises
    ------
    CertkvError
        An invalid operating point, a press that does not match it, a decode length other than
        the calibrated one, or a gate this press cannot run (one line each).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        operating_point: OperatingPoint | dict[str, Any] | str | Path,
        press: BasePress | None = None,
        max_new_tokens: int | None = None,
        query_aware: bool | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if isinstance(operating_point, dict):
            try:
                operating_point = OperatingPoint.model_validate(operating_point)
            except ValidationError as exc:
                raise CertkvError(format_validation_error(exc, "operating point")) from None
        elif not isinstance(operating_point, OperatingPoint):
            operating_point = load_operating_point(operating_point)
        self.model = model
        self.tokenizer = tokenizer
        self.operating_point = operating_point
        self.max_new_tokens = self._decode_length(max_new_tokens)
        self.query_aware = self._protocol(query_aware)
        """The calibrated protocol: whether the question is prefilled with the context."""
        self.stop_ids = stop_token_ids(model)
        self.strata: dict[str, CertifiedRuntime] = {}
        """Per stratum, the runtime of its certified policy (empty unless stratified)."""
        if operating_point.strata is not None:  # is_stratified, in a form the type checker narrows
            if press is not None:
                raise CertkvError("a stratified operating point deploys each stratum's own press; pass no press object")
            self.strata = {
                name: CertifiedRuntime(model, tokenizer, entry, max_new_tokens=max_new_tokens, query_aware=query_aware,
                                       prefix_cache=prefix_cache)
                for name, entry in operating_point.strata.entries.items()
            }
            for name, runtime in self.strata.items():  # each stratum's compressed contexts are its own
                if runtime.prefix is not None:
                    runtime.prefix.namespace = name
        self.gate = deployable(operating_point.gate or GateSettings())
        self.threshold = self.gate.agreement_drop
        self.bound = self.gate.certificate
        self.press: BasePress | None = None
        self.kv_format: KvFormat | None = None
        """The KV format the point stores its cache in (None: the model's dtype)."""
        self.single_prefill = False
        if not operating_point.fallback and not operating_point.is_stratified:
            self.kv_format = None if operating_point.kv_format is None else self._format(operating_point.kv_format)
            self.press = self._build_press() if press is None else self._checked(press)
            self.single_prefill = self.kv_format is None and self._on_single_prefill(self.press)
        self.prefix_cache = prefix_cache
        """The compressed contexts kept across questions (:mod:`certkv.runtime.prefix_cache`; None: off)."""
        self.prefix_bypass = None if operating_point.is_stratified else bypass_reason(
            self.query_aware, self.press, self.single_prefill, self.gate, self.kv_format is not None)
        """Why this point's requests never use the prefix cache (None: they do; a stratified point: per stratum)."""
        self.prefix: PrefixScope | None = None
        if prefix_cache is not None and self.prefix_bypass is None and not operating_point.is_stratified:
            self.prefix = PrefixScope(prefix_cache)
        deployed = self.press is not None or self.kv_format is not None
        self.path: AnsweringPath | None = self._answering_path(model) if deployed else None
        """The answering path of the certified press or format (None: fallback or stratified)."""

    # -- construction -------------------------------------------------------------------------

    def _answering_path(self, model: PreTrainedModel) -> AnsweringPath:
        """The path the certified press answers through: its single prefill (with the point's prefix
        cache, if any), kvpress's hooks, or a decode under a decoding-time press; a gate a path cannot
        apply is a one-line error."""
        if self.kv_format is not None:
            return self._format_path(model, self.kv_format)
        assert self.press is not None  # only called for a point with a press or a format
        if self.gate.restarts and not is_decoding_press(self.press):
            raise CertkvError(
                f"the operating point's recompute gate restarts a generation mid-decode, which only a "
                f"decoding-time press's path does; {self.policy!r} is not one"
            )
        if self.gate.certificate_recompute is not None and not isinstance(self.press, ProbabilisticDecodingPress):
            raise CertkvError(
                f"the operating point's certificate recompute gate reads each decoding step's certificate, which "
                f"only certkv's probabilistic_decoding press records; {self.policy!r} does not use it"
            )
        if self.single_prefill:
            return SinglePrefillPath(model, self.press, self.gate, self.policy, self.stop_ids, prefix=self.prefix)
        if is_decoding_press(self.press):
            if self.gate.pre_decode:
                raise CertkvError(
                    f"the operating point's {self.gate.kind} gate decides before the decode from the full "
                    "prefill, which a decoding-time press never holds; certify a recompute or confidence gate"
                )
            return DecodingPath(model, self.press, self.gate, self.stop_ids)
        return PipelinePath(model, self.press, self.gate, self.stop_ids)

    def _format_path(self, model: PreTrainedModel, kv_format: KvFormat) -> FormatPath:
        """The path of a point whose KV is stored in a format; gates that decide from a full prefill
        (this path never holds one) are a one-line error."""
        gate = self.gate
        if gate.pre_decode or gate.certificate_recompute is not None or gate.certificate is not None or gate.learned is not None:
            raise CertkvError(
                f"the operating point's {self.gate.kind} gate reads a full prefill or a press's certificates, which "
                f"{self.policy!r} (its KV stored as {kv_format.name}) never holds; certify a recompute or confidence gate"
            )
        return FormatPath(model, self.press, self.gate, self.stop_ids, kv_format)

    def _format(self, data: dict) -> KvFormat:
        """The operating point's KV format, checked (an edited point gets one line)."""
        try:
            fmt = parse_format(data)
        except ValidationError as exc:
            raise CertkvError(format_validation_error(exc, "operating point kv_format")) from None
        if needs_pilot_scales(fmt):
            raise CertkvError(f"the operating point's {fmt.name} format has no fp8 scales: they are placed on the pilot "
                              "when the contract is calibrated and written by `certkv certify` from its store")
        layers = self.model.config.get_text_config(decoder=True).num_hidden_layers
        scales = [p.layer_scales for p in key_value_formats(fmt) if isinstance(p, Fp8Format) and p.layer_scales is not None]
        if any(len(s) != layers for s in scales):
            raise CertkvError(f"the operating point's {fmt.name} format has fp8 scales for another model's layers "
                              f"(this one has {layers}); certify the point for this model")
        return fmt

    def _decode_length(self, requested: object) -> int:
        """The calibrated decode length: what was certified is an answer of at most that many tokens."""
        calibrated = self.operating_point.max_new_tokens
        if requested is None:
            return calibrated or DEFAULT_MAX_NEW_TOKENS
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise CertkvError(f"max_new_tokens must be a positive integer, got {requested!r}")
        if calibrated is not None and requested != calibrated:
            raise CertkvError(
                f"max_new_tokens {requested} differs from the {calibrated} the operating point was "
                "calibrated with; its guarantee covers those answers only (omit max_new_tokens)"
            )
        return requested

    def _protocol(self, requested: object) -> bool:
        """The calibrated protocol (``query_aware``): answers under the other one were never certified."""
        calibrated = self.operating_point.query_aware
        if requested is None:
            return calibrated
        if not isinstance(requested, bool):
            raise CertkvError(f"query_aware must be true or false, got {requested!r}")
        if requested != calibrated:
            raise CertkvError(
                f"the operating point was calibrated with protocol query_aware: {str(calibrated).lower()}, not "
                f"{str(requested).lower()}; its guarantee covers that protocol only (omit query_aware)"
            )
        return requested

    def _build_press(self) -> BasePress | None:
        op = self.operating_point
        if op.press == NO_PRESS:  # a KV format alone: every token kept
            return None
        return build_press(op.press, op.kv_retained, op.press_kwargs or {})

    def _checked(self, press: BasePress) -> BasePress:
        """A press object passed in: it must be callable as a kvpress press, of the certified
        press's type when that is known, at the certified retention, and produce certificates if
        the operating point escalates on them."""
        if not callable(press) or not hasattr(press, "compression_ratio"):
            raise CertkvError(f"press must be a kvpress press object, got {type(press).__name__}")
        op = self.operating_point
        if is_known_press(op.press):
            expected_class = resolve_press_class(op.press)
            if not isinstance(press, expected_class):
                raise CertkvError(
                    f"the operating point certifies press {op.press!r} ({expected_class.__name__}), "
                    f"but a {type(press).__name__} was passed"
                )
        ratio = press.compression_ratio
        expected = compression_ratio_for(op.kv_retained)
        if isinstance(ratio, (int, float)) and abs(ratio - expected) > 1e-9:
            raise CertkvError(
                f"the press's compression_ratio is {ratio}, but the operating point certifies "
                f"kv_retained {op.kv_retained} (compression_ratio {expected}); "
                "configure the press at the certified retention"
            )
        if self.bound is not None and not (is_probabilistic_press(press) or isinstance(press, ProbabilisticDecodingPress)):
            raise CertkvError(
                f"the operating point escalates on the certificate (bound {self.bound}), which only "
                f"certkv's probabilistic press computes; a {type(press).__name__} cannot be gated by it"
            )
        return press

    def _on_single_prefill(self, press: BasePress) -> bool:
        """Whether `press` runs on the engine's single-prefill path; a gate that needs the full
        cache after the prefill (the lookahead probe) is refused for any other press."""
        single = is_fast_path_press(press) or is_probabilistic_press(press) or is_response_aware_press(press)
        if not single and self.gate.needs_lookahead:
            raise CertkvError(
                f"the operating point's {self.gate.kind} gate reads the lookahead probe, which needs the "
                f"full cache that a {type(press).__name__} (kvpress's pipeline path) never keeps; certify a "
                "score-based or probabilistic press for this gate"
            )
        return single

    @property
    def policy(self) -> str:
        return self.operating_point.policy

    # -- answering ----------------------------------------------------------------------------

    def generate(
        self,
        context: str,
        question: str,
        stratum: str | None = None,
        *,
        max_new_tokens: int | None = None,
        answer_prefix: str = "",
    ) -> RuntimeAnswer:
        """Answer one request greedily; the decision record says which cache answered and why.

        Parameters
        ----------
        context, question : str
            Run under the calibrated protocol: the context is prefilled (and compressed) and the
            question fed after it, as kvpress does; or, query-aware, both are prefilled and only
            the prompt's last token is fed after compression.
        stratum : str, optional
            The request's stratum (its task, or its value of the contract's ``strata.by``). A
            stratified operating point answers a request without one, or with one it does not
            know, from the full cache (reason ``uncovered``); a pooled one only checks that a
            given stratum was calibrated.
        max_new_tokens : int, optional
            Must equal the calibrated decode length when given.
        answer_prefix : str, optional
            Text the answer starts with, after the question (after a chat template's assistant
            header), as the calibration request's ``answer_prefix``; the answer is what follows it.

        Returns
        -------
        RuntimeAnswer
            ``answer`` (text), ``token_ids``, ``decision`` (:class:`Decision`: ``mode`` "evicted"
            or "full", ``reason``, the gate signals, realised KV) and ``seconds`` per phase.
        """
        if max_new_tokens is not None:
            self._decode_length(max_new_tokens)
        return run_alone(self.answer_steps(context, question, stratum, answer_prefix=answer_prefix))

    def answer_from_full_cache(
        self,
        context: str,
        question: str,
        stratum: str | None = None,
        *,
        reason: str,
        detail: str | None = None,
        answer_prefix: str = "",
    ) -> RuntimeAnswer:
        """Answer from the full cache whatever the operating point says, with `reason` (and
        `detail`) in the decision: what a caller that overrides the certificate needs (``certkv
        serve``'s monitor, its shadows), through :meth:`generate`'s checks, stratum routing and
        decoding."""
        return run_alone(self.answer_steps(context, question, stratum, answer_prefix=answer_prefix, forced=(reason, detail)))

    def answer_steps(
        self,
        context: str,
        question: str,
        stratum: str | None = None,
        *,
        answer_prefix: str = "",
        forced: tuple[str, str | None] | None = None,
        lean: bool = False,
    ) -> Generator[Step, None, RuntimeAnswer]:
        """:meth:`generate` as steps (:mod:`certkv.runtime.steps`), what ``certkv serve``'s scheduler
        runs; with `forced` = (reason, detail) the full cache answers for that reason
        (:meth:`answer_from_full_cache`). `lean` frees each full cache as soon as the path no longer
        needs it (the scheduler's budget), with the same answers and decisions.

        The request is checked when the generator starts (CertkvError, one line)."""
        _check_request_types(context, question, stratum, answer_prefix)
        if stratum in self.strata:
            return (yield from self.strata[stratum].answer_steps(
                context, question, stratum, answer_prefix=answer_prefix, forced=forced, lean=lean))
        enc = encode_request(self.tokenizer, context, question, answer_prefix)
        if not enc.context_ids:
            raise CertkvError("the context is empty; certkv answers questions about a context")
        if self.query_aware and not enc.question_ids:
            raise CertkvError("the question is empty; the query-aware operating point prefills the question with the context")
        t0 = time.perf_counter()
        signals = empty_signals()
        signals.update(request_signals(enc.context_ids, enc.question_ids))
        # What the protocol prefills and feeds after compression; the signals and the coverage
        # read the request itself, as calibration records them.
        run = for_protocol(enc, self.query_aware)
        reason, detail = forced if forced is not None else self._full_cache_reason(len(enc.context_ids), run, stratum)
        if reason is not None or self.path is None:
            seconds: dict[str, float] = {}
            ids = yield from full_answer_steps(self.model, run, self.max_new_tokens, self.stop_ids, seconds)
            answered = PathAnswer(ids, reason, signals, seconds)
        else:
            clear_states(self.model)
            try:
                answered = yield from self.path.steps(run, self.max_new_tokens, signals, lean=lean)
            finally:
                clear_states(self.model)
        seconds = dict(answered.seconds, total=time.perf_counter() - t0)
        return RuntimeAnswer(
            self.tokenizer.decode(answered.ids, skip_special_tokens=True),
            answered.ids,
            self._decision(answered, stratum, detail),
            seconds,
            len(enc.context_ids),
            len(enc.question_ids),
            answered.prefix,
        )

    def prefix_cache_refusal(self) -> str | None:
        """Why no request of this point can use a prefix cache (None: some can); one line naming the
        point. A stratified point is refused only when none of its strata can use one."""
        if self.strata:
            reasons = {name: rt.prefix_bypass for name, rt in self.strata.items()}
            if all(reasons.values()):
                return "no stratum of the operating point can reuse a compressed context: " + "; ".join(
                    f"{name}: {why}" for name, why in reasons.items())
            return None
        return None if self.prefix_bypass is None else f"{self.policy} cannot reuse a compressed context: {self.prefix_bypass}"

    def prefix_bypassed(self) -> dict[str, str]:
        """Per stratum (a pooled point: its policy) whose requests bypass the prefix cache, why."""
        if self.strata:
            return {name: rt.prefix_bypass for name, rt in self.strata.items() if rt.prefix_bypass is not None}
        return {} if self.prefix_bypass is None else {self.policy: self.prefix_bypass}

    def _full_cache_reason(self, context_tokens: int, run: EncodedRequest, stratum: str | None) -> tuple[str | None, str | None]:
        """(reason, detail) for which the full cache must answer a request whose context has
        `context_tokens` tokens (and whose protocol prefills `run`), or (None, None) when the
        point's press may: outside the coverage envelope, a fallback point, a press precondition."""
        coverage = self.operating_point.coverage
        outside = None if coverage is None else coverage.uncovered(stratum, context_tokens)
        if outside is not None and not self.operating_point.fallback:
            return "uncovered", outside
        if self.path is None:
            return "fallback", None
        failure = press_precondition_failure(self.press, len(run.context_ids))
        return ("precondition", failure) if failure else (None, None)

    def _decision(self, answered: PathAnswer, stratum: str | None, detail: str | None) -> Decision:
        """The :class:`Decision` of an answering path's `answered`, as this point served it."""
        return Decision(
            mode=answered.mode,
            reason=answered.reason,
            policy=self.policy,
            stratum=stratum,
            gate_kind=self.gate.kind or None,
            gate_threshold=self.threshold,
            certificate_bound=self.bound,
            **answered.signals,
            escalated=answered.escalated,
            recomputed_at=answered.recomputed_at,
            kv_retained=self.operating_point.kv_retained if answered.reason is None else 1.0,
            kv_retained_actual=answered.kept if answered.reason is None and answered.kept is not None else 1.0,
            detail=detail,
        )
