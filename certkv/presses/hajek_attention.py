"""Hájek-corrected attention with a per-step survey-variance certificate (docs/design.md,
"Gate signals").

After :class:`~certkv.presses.probabilistic.ProbabilisticPress` has pruned a layer, the layer's
attention module carries a :class:`~certkv.presses.hajek_state.HajekState` describing the
cache's first N slots. This attention function, registered with transformers'
``AttentionInterface`` under :data:`NAME` (with the stock sdpa mask builder), then

* adds −log π_i to the logits of kept tail entries (0 for π = 1 entries, −inf for padding slots):
  inside the softmax this weights entry i by 1/π_i, so the output is the Hájek estimator of the
  full-cache output;
* computes, per query position and KV head, the certificate
  ``ĉ = sqrt(Σ_{i ∈ kept tail} (1 − π_i) ŵ_i² ‖v_i − ô‖²)``, the linearised survey standard error
  of that estimator, with ŵ the corrected weights and ô the output. It is computed per *query*
  head (each has its own ŵ and ô) and the KV head's certificate is the **max** over its group's
  query heads: conservative, and it bounds every head that reads the sampled entries (a mean
  could hide one badly estimated head);
* appends the certificates of the call to ``module.certkv_certificates``, kept on the model's
  device (no host sync per step). One call is one step: the question feed (Q > 1 positions) and
  then each decoded token. A step keeps only its tail weights (a view) and a copy of its output
  (:class:`CertificateTerms`); reading them (:func:`layer_certificates`, :func:`certificate_steps`,
  :func:`certificate_max`) computes every pending step at once — two matmuls per layer with the
  cache's tail values for all of them, and one batch of elementwise operations for all layers —
  to tensors of shape (B, H_kv, Q): the same numbers to float rounding (tested), and a decoding
  step pays one small copy. Question feeds (Q > 1) are reduced at once; at most
  :data:`PENDING_STEPS` decoded tokens wait, and fewer when their weights would keep more than
  :data:`PENDING_BYTES` alive per layer (a large model reduces every step).

Everything else is plain attention: a full prefill (query length == key length) clears the
module's state (it belongs to a previous request) and runs transformers' sdpa; a module without
state, or whose state is *trivial* (every slot real with π = 1), runs transformers' sdpa too (the
certificate of a trivial state is recorded as 0), so with every π = 1 the outputs are exactly
those of the stock sdpa attention over the same kept cache. The corrected path computes the
logits in the model's dtype, adds the bias and takes the softmax in float32, like transformers'
eager attention.

Nothing is registered at import: call :func:`register` (idempotent) or use
:func:`use_hajek_attention`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from certkv.model.attention import use_attention
from certkv.presses.hajek_state import CERT_ATTR, STATE_ATTR, HajekState, clear_state
from certkv.presses.probabilistic import attention_modules

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NAME = "certkv_hajek"
#: At most this many decoded steps wait unreduced per layer ...
PENDING_STEPS = 64
#: ... and at most this much memory their weights keep alive (a large model reduces every step).
PENDING_BYTES = 8 * 2**20


def _sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, is_causal: bool | None,
          kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def hajek_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    is_causal: bool | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers attention-interface function; see the module docstring."""
    q_len, k_len = query.shape[2], key.shape[2]
    if q_len == k_len:  # a fresh prefill: any state belongs to an earlier request
        if getattr(module, STATE_ATTR, None) is not None:
            clear_state(module)
        return _sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    state = getattr(module, STATE_ATTR, None)
    if state is None:
        return _sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    certificates = getattr(module, CERT_ATTR, None)
    if certificates is None:
        certificates = []
        setattr(module, CERT_ATTR, certificates)
    batch, kv_heads = key.shape[:2]
    if tuple(state.bias.shape[:2]) != (batch, kv_heads) or state.n_slots > k_len:
        raise RuntimeError(
            f"layer {getattr(module, 'layer_idx', '?')}: the Hájek state covers {tuple(state.bias.shape)} slots "
            f"but the cache holds {tuple(key.shape[:3])}; clear_states(model) before reusing a model"
        )
    if state.trivial:
        certificates.append(torch.zeros(batch, kv_heads, q_len, dtype=torch.float32, device=query.device))
        return _sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)

    output, weights = corrected_attention(query, key, value, attention_mask, scaling, state)
    if state.n_tail == 0:
        certificates.append(torch.zeros(batch, kv_heads, q_len, dtype=torch.float32, device=query.device))
    else:  # decoded tokens are reduced when read (settle_certificates), many steps at once
        terms = certificate_terms(weights, output, value, state, (batch, kv_heads, query.shape[1] // kv_heads, q_len))
        certificates.append(terms)
        # A multi-position step (the question feed) gains nothing from waiting; a long answer that
        # nobody reads yet must not keep every step's weights alive (pending steps are a suffix).
        allowed = max(1, min(PENDING_STEPS, PENDING_BYTES // max(1, terms.held_bytes)))
        if q_len > 1 or (len(certificates) >= allowed and isinstance(certificates[-allowed], CertificateTerms)):
            settle_certificates(certificates)
    heads, head_dim = query.shape[1], value.shape[-1]
    output = output.view(batch, heads, q_len, head_dim).transpose(1, 2).contiguous()
    return output, None


def corrected_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                        scaling: float | None, state: HajekState) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with the state's bias (−log π, −inf for padding) added to the logits of the
    cache's first N keys.

    Works on (B·H_kv) batches of the G query heads of each KV head, which share their keys:
    returns the output (B·H_kv, G·Q, d_v) in the value dtype and the float32 weights
    (B·H_kv, G·Q, K). `attention_mask` is transformers' 4D mask (boolean: True = attend, or
    additive float) or None (causal over the last Q keys). For a float32 model the scaling, the
    product and the bias are one ``baddbmm``: a decoding step is a handful of kernel calls, which
    is what it costs on a CPU at these sizes.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    if scaling is None:
        scaling = head_dim**-0.5
    q = query.reshape(batch * kv_heads, groups * q_len, head_dim)
    k = key.reshape(batch * kv_heads, k_len, head_dim)
    bias = state.logit_bias(k_len)  # (B·H_kv, 1, K) float32
    if q.dtype == torch.float32:
        logits = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scaling)
    else:  # the logits in the model's dtype, the bias and the softmax in float32 (like eager attention)
        logits = torch.bmm(q * scaling, k.transpose(1, 2)).float().add_(bias)
    if attention_mask is not None:
        if attention_mask.shape[-1] < k_len:
            raise RuntimeError(
                f"the attention mask covers {attention_mask.shape[-1]} keys but the layer holds {k_len}: "
                "cache layers of different lengths (see probabilistic.equalise_widths)"
            )
        mask = attention_mask[..., :k_len]
        mask = mask.unsqueeze(2) if mask.shape[1] == 1 else mask.view(mask.shape[0], kv_heads, groups, q_len, k_len)
        view = logits.view(batch, kv_heads, groups, q_len, k_len)
        if mask.dtype == torch.bool:
            view.masked_fill_(~mask, float("-inf"))
        else:
            view.add_(mask.float())
    elif q_len > 1:
        positions = torch.arange(k_len, device=logits.device)
        future = positions.unsqueeze(0) > (k_len - q_len + torch.arange(q_len, device=logits.device)).unsqueeze(1)
        logits.view(batch * kv_heads, groups, q_len, k_len).masked_fill_(future, float("-inf"))
    weights = torch.softmax(logits, dim=-1)
    if attention_mask is not None:  # only a mask can hide every key of a row (its own is never padding)
        weights = torch.nan_to_num_(weights, nan=0.0)
    v = value.reshape(batch * kv_heads, k_len, value.shape[-1])
    output = torch.bmm(weights if v.dtype == torch.float32 else weights.to(v.dtype), v)
    return output, weights


@dataclass
class CertificateTerms:
    """One step's certificate, not yet computed: what it is made of.

    With a_i = (1 − π_i) ŵ_i² over the kept tail, ĉ² = Σ a_i ‖v_i‖² − 2 ô·Σ a_i v_i + ‖ô‖² Σ a_i.
    A decoding step keeps only its tail weights ŵ (a view of the weights its attention computed
    anyway) and a copy of its output ô; the two matmuls with the cache's tail values and the
    elementwise rest run for many steps at once when the certificates are read
    (:func:`_run_sums`), so a step pays for one small copy, not for a dozen kernel calls. The
    kept tail never changes while an answer is decoded (new tokens are appended after it), so the
    values the sums need are read from the layer's latest cache tensor, remembered on the
    :class:`~certkv.presses.hajek_state.HajekState` (``latest_values``) only while some step is
    pending, never copied.
    """

    weights: torch.Tensor
    """ŵ over the kept tail slots, (B·H_kv, G·Q, T) float32."""
    output: torch.Tensor
    """ô, (B·H_kv, G·Q, d_v) float32."""
    state: HajekState
    """The layer's :class:`~certkv.presses.hajek_state.HajekState`."""
    shape: tuple[int, ...]
    """(B, H_kv, G, Q): how the rows and positions split into batch, heads and query positions."""

    @property
    def held_bytes(self) -> int:
        """Memory this pending step keeps alive: its whole weights tensor (ŵ is a view of it)."""
        base = self.weights._base if self.weights._base is not None else self.weights
        return base.numel() * base.element_size() + self.output.numel() * self.output.element_size()


def certificate_terms(weights: torch.Tensor, output: torch.Tensor, value: torch.Tensor, state: HajekState,
                      shape: tuple[int, ...]) -> CertificateTerms:
    """One step's pending certificate (see :class:`CertificateTerms`).

    `weights` (B·H_kv, G·Q, K) float32 and `output` (B·H_kv, G·Q, d_v) from
    :func:`corrected_attention`, `value` the layer's (B, H_kv, K, d_v) cache values, remembered
    on the state as its latest values.
    """
    state.__dict__["latest_values"] = value
    w = weights[..., state.n_head : state.n_head + state.n_tail]
    # kept until read; the attention hands the same storage to the model
    output = output.clone() if output.dtype == torch.float32 else output.float()
    return CertificateTerms(w, output, state, shape)


def _run_sums(run: Sequence[CertificateTerms],
              value: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σ a v, [Σ a‖v‖², Σ a] and ô of a run of one layer's pending steps, (B·H_kv, S, G·Q, ·) each:
    two matmuls for the whole run. `value`: the layer's cache values (default: the latest seen)."""
    state = run[0].state
    if value is None:
        value = state.__dict__.get("latest_values")
    if value is None:
        raise RuntimeError("a pending certificate step outlived its layer's cache values (reduce before clear_state)")
    w = torch.stack([t.weights for t in run], dim=1)  # (rows, S, G·Q, T)
    rows, n_steps, positions, n_tail = w.shape
    a = (w * state.tail_weight_rows.unsqueeze(1)).mul_(w).view(rows, n_steps * positions, n_tail)
    k_len = value.shape[2]
    tail_values = value.reshape(rows, k_len, value.shape[-1])[:, state.n_head : state.n_head + n_tail]
    if tail_values.dtype == torch.float32:
        weighted = torch.bmm(a, tail_values)
    else:
        weighted = torch.bmm(a.to(tail_values.dtype), tail_values).float()
    moments = torch.bmm(a, state.tail_moments(value))
    # kept in the (rows, S, G·Q, ·) layout of the matmuls: no transposed copies
    return (weighted.view(rows, n_steps, positions, -1), moments.view(rows, n_steps, positions, 2),
            torch.stack([t.output for t in run], dim=1))


def _reduce(weighted: torch.Tensor, moments: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """sqrt(Σ a‖v‖² − 2 ô·(Σ a v − ½ ô Σ a)), clamped at 0 against rounding; any leading dims."""
    centred = torch.addcmul(weighted, output, moments[..., 1:], value=-0.5)
    variance = torch.add(moments[..., 0], torch.linalg.vecdot(output, centred), alpha=-2)
    return variance.clamp_min_(0).sqrt_()


def certificate(weights: torch.Tensor, output: torch.Tensor, value: torch.Tensor, state: HajekState) -> torch.Tensor:
    """ĉ = sqrt(Σ_tail (1 − π_i) ŵ_i² ‖v_i − ô‖²) per query position and head, computed at once.

    Arguments as in :func:`certificate_terms`. Returns float32 (B·H_kv, G·Q); the attention takes
    the max over each KV head's group.
    """
    if state.n_tail == 0:
        return torch.zeros(weights.shape[:2], dtype=torch.float32, device=weights.device)
    # built here rather than by certificate_terms, which would remember `value` on the state
    terms = CertificateTerms(weights[..., state.n_head : state.n_head + state.n_tail], output.float(), state, ())
    return _reduce(*_run_sums([terms], value))[:, 0]


def settle_certificates(steps: list[Any]) -> list[Any]:
    """Replace, in place, every :class:`CertificateTerms` of a layer's step list by its certificate
    tensor (B, H_kv, Q) (the max over each KV head's query heads); returns the list.

    Consecutive steps of the same shape (the decoded tokens) are reduced together, one batch of
    elementwise operations for all of them.
    """
    first = _first_pending(steps)
    if first is None:
        return steps
    states = {id(t.state): t.state for t in steps[first:] if isinstance(t, CertificateTerms)}
    for i, j, shape in list(_same_shape_runs(steps[first:], _pending_shape)):
        if shape is not None:
            steps[first + i : first + j] = list(_reduce_runs([steps[first + i : first + j]], shape)[0].unbind(0))
    _release(states.values())
    return steps


def _release(states: Iterable[HajekState]) -> None:
    """Forget the cache values remembered for pending steps once none is left: a state must not
    keep a layer's value tensor alive after its certificates are read."""
    for state in states:
        state.__dict__.pop("latest_values", None)


def _pending_shape(step: object) -> tuple[int, ...] | None:
    return step.shape if isinstance(step, CertificateTerms) else None


def _first_pending(steps: Sequence[object]) -> int | None:
    """Index of the first unreduced step, None when all are reduced (every reduction takes all
    pending steps, so the unreduced ones are the list's tail)."""
    return next((i for i, step in enumerate(steps) if isinstance(step, CertificateTerms)), None)


def _reduce_runs(runs: Sequence[Sequence[CertificateTerms]], shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Certificates of several runs of same-shape pending steps (one per layer, equal lengths),
    reduced as one batch: one (S, B, H_kv, Q) tensor per run."""
    sums = [_run_sums(run) for run in runs]  # (B·H_kv, S, G·Q, ·) each
    stacked = [torch.cat([s[i] for s in sums]) if len(sums) > 1 else sums[0][i] for i in range(3)]
    batch, kv_heads, groups, q_len = shape
    values = _reduce(*stacked).view(len(runs), batch, kv_heads, len(runs[0]), groups, q_len).amax(dim=4)
    return list(values.permute(0, 3, 1, 2, 4).unbind(0))


def _same_shape_runs(items: Sequence[Any], shape_of: Callable[[Any], Any]) -> Iterator[tuple[int, int, Any]]:
    """(start, end, shape) of each maximal run of consecutive items whose ``shape_of`` is equal;
    items whose shape_of is None form runs of one."""
    i = 0
    while i < len(items):
        shape = shape_of(items[i])
        j = i + 1
        while shape is not None and j < len(items) and shape_of(items[j]) == shape:
            j += 1
        yield i, j, shape
        i = j


def layer_certificates(module: torch.nn.Module) -> list[torch.Tensor]:
    """`module`'s per-step certificate tensors (B, H_kv, Q), oldest first (empty when none)."""
    return settle_certificates(getattr(module, CERT_ATTR, None) or [])


def register() -> None:
    """Register the attention and its mask builder (transformers' sdpa one) with transformers; idempotent."""
    AttentionInterface.register(NAME, hajek_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


@contextmanager
def use_hajek_attention(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Run `model` with the Hájek attention inside the block, restoring its attention after.

    States and certificates stay on the modules after the block so that the caller can read them;
    :func:`certkv.presses.hajek_state.clear_states` forgets them.
    """
    register()
    with use_attention(model, NAME):
        yield model


def certificate_steps(model: PreTrainedModel, start: int = 0) -> list[list[float]]:
    """Per batch row, per step (attention call after compression) from step `start` on, the max
    certificate over layers, KV heads and the step's query positions. Empty when nothing was
    recorded; empty rows when nothing was recorded since `start` (a caller that checks as the
    answer grows reads only the steps it has not seen).

    The usual read — every layer holding the same run of decoded steps not yet reduced, starting
    at or before `start` — reduces the layers together (one batch of operations for the whole
    model); anything else reduces layer by layer (:func:`layer_certificates`). The same numbers
    either way.
    """
    per_layer = [getattr(m, CERT_ATTR, None) or [] for m in attention_modules(model)]
    per_layer = [steps for steps in per_layer if steps]
    if not per_layer:
        return []
    step_counts = {len(steps) for steps in per_layer}
    if len(step_counts) != 1:
        raise ValueError(f"layers recorded different numbers of steps {sorted(step_counts)}; was the model reused mid-answer?")
    n_steps = step_counts.pop()
    if start >= n_steps:
        return [[] for _ in range(per_layer[0][0].shape[0])]  # a tensor's or pending terms' batch size
    firsts = {_first_pending(steps) for steps in per_layer}
    first = firsts.pop() if len(firsts) == 1 else None
    joint = None
    if first is not None:
        shapes = {_pending_shape(t) for steps in per_layer for t in steps[first:]}
        shape = shapes.pop() if len(shapes) == 1 else None  # pending steps are a suffix: never None here
        if shape is not None:  # one run of same-shape pending steps, the same in every layer
            joint = _reduce_runs([steps[first:] for steps in per_layer], shape)
            _release({id(steps[first].state): steps[first].state for steps in per_layer}.values())
            for steps, values in zip(per_layer, joint):
                steps[first:] = list(values.unbind(0))
    if joint is not None and first is not None and first <= start:
        maxima = torch.stack([values[start - first :].amax(dim=(2, 3)) for values in joint])  # (L, S, B)
    else:
        maxima = torch.stack([_step_maxima(settle_certificates(steps)[start:]) for steps in per_layer]).transpose(1, 2)
    return maxima.amax(dim=0).T.float().cpu().tolist()


def _step_maxima(steps: list[torch.Tensor]) -> torch.Tensor:
    """(B, S): each step's max over KV heads and query positions, one reduction per run of
    same-shape steps (the decoded tokens) rather than one per step."""
    parts = [torch.stack(steps[i:j]).amax(dim=(2, 3)) for i, j, _ in _same_shape_runs(steps, lambda c: c.shape)]
    return torch.cat(parts).T  # parts: (S_run, B) each


def certificate_max(model: PreTrainedModel) -> float:
    """The largest certificate of the last answer (0 when nothing was sampled or recorded)."""
    rows = certificate_steps(model)
    return max((max(row) for row in rows if row), default=0.0)
