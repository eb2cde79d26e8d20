"""Serve a certified operating point: the press at its certified retention, behind its gate.

:class:`CertifiedRuntime` answers one request at a time the way calibration measured it, so that
what is deployed is exactly what was certified:

1. Requests outside what the candidate can run (a context no longer than the press's window) and
   operating points that fell back to the full cache are answered from the full cache.
2. The context is prefilled once under the press (kvpress's own hooks), with the agreement
   recorder attached first so that it sees each layer's full keys before the press prunes them.
3. If the operating point has an agreement-drop threshold and the request's drop is below it, the
   gate sends the request to the full cache (re-prefilled without the press).
4. Otherwise the answer is decoded from the pruned cache. Under certkv's probabilistic press every
   step's survey-variance certificate is checked against the operating point's bound, every
   :data:`CERTIFICATE_CHECK_EVERY` steps and at the end; a step above it escalates: the request is
   answered again from the full cache. Checking in batches changes neither the decision nor the
   answer (an escalated request is answered from the full cache from scratch; the record's
   ``certificate_max`` stops at the first step above the bound either way), only how many evicted
   steps an escalating request decodes in vain, and it lets the steps' certificates be reduced
   together instead of one by one.

Every answer comes with a :class:`Decision` record saying which cache answered and why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from certkv.core.spec import AGREEMENT_SPLIT, AGREEMENT_TOP_K, AGREEMENT_WINDOW, DEFAULT_MAX_NEW_TOKENS
from certkv.errors import CertkvError

#: Decoding steps between two checks of the certificate against the bound (and one at the end).
#: A check reads every step since the last one (a few dozen small kernel calls for all layers and
#: one host sync: 0.4–0.6 ms on the embedded model, measured inside decoding, whose steps take
#: ~1.0–1.6 ms); an escalating request decodes at most this many steps minus one in vain before it
#: is re-answered from the full cache. 16 keeps the reads near 3% of the decoding time on the
#: embedded model (8: ~6%) at the price of up to 15 wasted evicted steps per escalation; answers
#: shorter than 16 tokens are checked once, at the end.
CERTIFICATE_CHECK_EVERY = 16


@dataclass
class Decision:
    """How one request was answered."""

    mode: str
    """``"evicted"`` (the press's cache answered) or ``"full"``."""
    reason: str | None
    """Why the full cache answered: ``fallback``, ``precondition``, ``gate`` or ``certificate``."""
    policy: str
    agreement_drop: float | None = None
    gate_threshold: float | None = None
    certificate_max: float | None = None
    """Largest certificate over the evicted decode's steps (up to escalation); None without one."""
    certificate_bound: float | None = None
    escalated: bool = False
    kv_retained: float = 1.0
    """Nominal retention of the cache that answered (1.0 for the full cache)."""
    kv_retained_actual: float = 1.0
    """Realised retention of the cache that answered."""
    detail: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RuntimeAnswer:
    """What :meth:`CertifiedRuntime.generate` returns: the answer and the decision behind it."""

    answer: str
    token_ids: list[int]
    decision: Decision
    seconds: dict[str, float] = field(default_factory=dict)


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

    A fallback operating point answers every request from the full cache; a gated one sends a
    request to the full cache when its gate says so (:class:`Decision` records which and why).
    """

    def __init__(self, model, tokenizer, operating_point, press=None, max_new_tokens: int | None = None):
        from pydantic import ValidationError

        from certkv.core.operating_point import OperatingPoint, load_operating_point
        from certkv.errors import format_validation_error
        from certkv.model.generation import stop_token_ids

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
        self.stop_ids = stop_token_ids(model)
        gate = operating_point.gate.model_dump() if operating_point.gate is not None else {}
        self.threshold = gate.get("agreement_drop")
        self.bound = gate.get("certificate")
        self.agreement = {
            "window": gate.get("agreement_window") or AGREEMENT_WINDOW,
            "top_k": gate.get("agreement_top_k") or AGREEMENT_TOP_K,
            "split_divisor": gate.get("agreement_split") or AGREEMENT_SPLIT,
        }
        self.press = None
        if not operating_point.fallback:
            self.press = self._build_press() if press is None else self._checked(press)

    # -- construction -------------------------------------------------------------------------

    def _decode_length(self, requested) -> int:
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

    def _build_press(self):
        from certkv.presses.registry import build_press

        op = self.operating_point
        return build_press(op.press, op.kv_retained, op.press_kwargs or {})

    def _checked(self, press):
        """A press object passed in: it must be callable as a kvpress press, of the certified
        press's type when that is known, at the certified retention, and produce certificates if
        the operating point escalates on them."""
        from certkv.engine.engine import is_probabilistic_press
        from certkv.presses.registry import compression_ratio_for, is_known_press, resolve_press_class

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
        if self.bound is not None and not is_probabilistic_press(press):
            raise CertkvError(
                f"the operating point escalates on the certificate (bound {self.bound}), which only "
                f"certkv's probabilistic press computes; a {type(press).__name__} cannot be gated by it"
            )
        return press

    @property
    def policy(self) -> str:
        return self.operating_point.policy

    # -- answering ----------------------------------------------------------------------------

    def generate(self, context: str, question: str, max_new_tokens: int | None = None) -> RuntimeAnswer:
        """Answer one request greedily; the decision record says which cache answered and why.

        Parameters
        ----------
        context, question : str
            Fed as kvpress does: the context is prefilled (and compressed), the question after it.
        max_new_tokens : int, optional
            Must equal the calibrated decode length when given.

        Returns
        -------
        RuntimeAnswer
            ``answer`` (text), ``token_ids``, ``decision`` (:class:`Decision`: ``mode`` "evicted"
            or "full", ``reason``, the gate signals, realised KV) and ``seconds`` per phase.
        """
        import time

        from certkv.engine.engine import press_precondition_failure
        from certkv.model.generation import encode_request

        max_new = self.max_new_tokens if max_new_tokens is None else self._decode_length(max_new_tokens)
        for name, value in (("context", context), ("question", question)):
            if not isinstance(value, str):
                raise CertkvError(f"{name} must be a string, got {type(value).__name__}")
        enc = encode_request(self.tokenizer, context, question)
        if not enc.context_ids:
            raise CertkvError("the context is empty; certkv answers questions about a context")
        base = Decision(mode="full", reason=None, policy=self.policy,
                        gate_threshold=self.threshold, certificate_bound=self.bound)
        t0 = time.perf_counter()
        if self.press is None:
            base.reason = "fallback"
            return self._full(enc, max_new, base, t0)
        failure = press_precondition_failure(self.press, len(enc.context_ids))
        if failure:
            base.reason, base.detail = "precondition", failure
            return self._full(enc, max_new, base, t0)
        return self._evicted(enc, max_new, base, t0)

    def _full(self, enc, max_new: int, decision: Decision, t0: float, seconds=None) -> RuntimeAnswer:
        import time

        from certkv.model.generation import full_kv_ids
        from certkv.presses.hajek_state import clear_states

        clear_states(self.model)
        ids = full_kv_ids(self.model, enc, max_new)
        decision.mode = "full"
        decision.kv_retained = decision.kv_retained_actual = 1.0
        seconds = dict(seconds or {}, total=time.perf_counter() - t0)
        return RuntimeAnswer(self.tokenizer.decode(ids, skip_special_tokens=True), ids, decision, seconds)

    def _evicted(self, enc, max_new: int, decision: Decision, t0: float) -> RuntimeAnswer:
        import time
        from contextlib import nullcontext

        import torch
        from transformers import DynamicCache

        from certkv.engine.engine import continues_from_compressed_length, is_probabilistic_press, kept_entries
        from certkv.gate.agreement import AgreementRecorder
        from certkv.model.generation import greedy_decode
        from certkv.model.window_queries import capturing_window_queries
        from certkv.presses.hajek_attention import certificate_max, use_hajek_attention
        from certkv.presses.hajek_state import clear_states, kept_fraction

        n_ctx = len(enc.context_ids)
        probabilistic = is_probabilistic_press(self.press)
        # The gate signal is computed only when a threshold reads it (it costs a window attention
        # per layer); the decision record then leaves it empty.
        recorder = AgreementRecorder(**self.agreement) if self.threshold is not None else None
        cache = DynamicCache()
        hajek = use_hajek_attention(self.model) if probabilistic else nullcontext()
        clear_states(self.model)
        ids = None
        gated = False
        with torch.no_grad(), hajek:
            # The recorder's hooks are registered before the press's, so they run first on each
            # layer and see its keys before the press prunes them.
            with (
                recorder.attach(self.model) if recorder else nullcontext(),
                self.press(self.model),
                capturing_window_queries(self.model),  # as calibration prefills
            ):
                self.model.model(input_ids=self._ids(enc.context_ids), past_key_values=cache)
            seconds = {"prefill": time.perf_counter() - t0}
            if recorder:
                decision.agreement_drop = recorder.drop()
                gated = decision.agreement_drop < self.threshold
            if not gated:
                kept = kept_fraction(self.model) if probabilistic else kept_entries(cache, self.model) / n_ctx
                position = cache.get_seq_length() if continues_from_compressed_length(self.press) else n_ctx
                watch = _CertificateWatch(self.model, self.bound) if probabilistic and self.bound is not None else None
                ids = greedy_decode(
                    self.model, cache, enc.question_ids, position, max_new, after_step=watch.after_step if watch else None
                )
                if watch and ids is not None and watch.exceeded():  # the steps since the last check
                    ids = None
                if probabilistic:
                    decision.certificate_max = watch.peak if watch else certificate_max(self.model)
        clear_states(self.model)
        if gated:
            decision.reason = "gate"
            return self._full(enc, max_new, decision, t0, seconds)
        if ids is None:
            decision.escalated = True
            decision.reason = "certificate"
            return self._full(enc, max_new, decision, t0, seconds)
        decision.mode = "evicted"
        decision.kv_retained = self.operating_point.kv_retained
        decision.kv_retained_actual = kept
        seconds["total"] = time.perf_counter() - t0
        return RuntimeAnswer(self.tokenizer.decode(ids, skip_special_tokens=True), ids, decision, seconds)

    def _ids(self, ids):
        import torch

        return torch.as_tensor(ids, device=self.model.device).view(1, -1)


class _CertificateWatch:
    """Checks an evicted decode's certificates against the operating point's bound.

    Called after every model call (:meth:`after_step`), it reads the certificates every
    :data:`CERTIFICATE_CHECK_EVERY` calls; :meth:`exceeded` also covers the calls since the last
    check. :attr:`peak` is the largest certificate up to the first step above the bound (or over
    every step when none is), what the decision records.
    """

    def __init__(self, model, bound: float):
        self.model, self.bound = model, bound
        self.peak = 0.0
        self.seen = 0  # steps already compared with the bound
        self.calls = 0

    def exceeded(self) -> bool:
        from certkv.presses.hajek_attention import certificate_steps

        rows = certificate_steps(self.model, self.seen)
        for value in rows[0] if rows else []:
            self.peak = max(self.peak, value)
            self.seen += 1
            if self.peak > self.bound:
                return True
        return False

    def after_step(self) -> bool:
        self.calls += 1
        return self.calls % CERTIFICATE_CHECK_EVERY == 0 and self.exceeded()
