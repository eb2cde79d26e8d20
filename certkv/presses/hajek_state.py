"""The per-layer state the Hájek attention reads: log π and validity of every kept cache slot.

The state lives on the attention module itself, as kvpress does with ``masked_key_indices``:
``module.certkv_hajek`` holds a :class:`HajekState` for the cache's first ``N`` slots and
``module.certkv_certificates`` the list each decoding step's certificates are appended to. A
probabilistic press sets both after pruning a layer; the attention function clears them at the
next full prefill, and :func:`clear_states` does it explicitly. :func:`equalise_widths` pads every
layer to one common width (a cache layer is one rectangular tensor, and transformers builds one
mask for all layers); :func:`kept_fraction` counts valid entries only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import QuantizedCache

from certkv.model.layers import attention_modules
from certkv.presses.poisson_selection import Selection

if TYPE_CHECKING:
    from transformers import Cache, PreTrainedModel

#: Attribute of an attention module holding its layer's :class:`HajekState` (or None).
STATE_ATTR = "certkv_hajek"
#: Attribute of an attention module holding the list of per-step certificate tensors.
CERT_ATTR = "certkv_certificates"


@dataclass
class HajekState:
    """What the Hájek attention needs about one layer's kept entries (the cache's first N slots).

    Built once per layer by the press, so that each decoding step only slices precomputed tensors.
    """

    log_pi: torch.Tensor
    """(B, H_kv, N) float32: log π per slot, 0 for π = 1 and for padding."""
    valid: torch.Tensor
    """(B, H_kv, N) bool: False for padding slots."""
    counts: torch.Tensor
    """(B, H_kv) long: entries kept per batch row and KV head."""
    n_head: int
    """Slots [:n_head] are the deterministic head (π = 1)."""
    context_length: int
    """K, the uncompressed context length of the prefill."""
    bias: torch.Tensor = field(init=False, repr=False)
    """(B, H_kv, N) float32 logit correction: −log π for kept entries, −inf for padding."""
    tail_weight: torch.Tensor = field(init=False, repr=False)
    """(B, H_kv, N − n_head) float32: 1 − π for kept tail entries, 0 for padding."""
    trivial: bool = field(init=False)
    """Every slot is a real entry with π = 1: attention is plain attention over the kept cache."""

    def __post_init__(self) -> None:
        neg_inf = torch.full_like(self.log_pi, float("-inf"))
        self.bias = torch.where(self.valid, -self.log_pi, neg_inf)
        tail_log_pi = self.log_pi[..., self.n_head :]
        self.tail_weight = torch.where(
            self.valid[..., self.n_head :], -torch.expm1(tail_log_pi), torch.zeros_like(tail_log_pi)
        )
        self.trivial = bool(self.valid.all()) and bool((self.log_pi == 0).all())

    @property
    def n_slots(self) -> int:
        return self.log_pi.shape[-1]

    @property
    def n_tail(self) -> int:
        return self.n_slots - self.n_head

    @property
    def tail_weight_rows(self) -> torch.Tensor:
        """`tail_weight` as (B·H_kv, 1, T), the layout of the attention's per-KV-head batches."""
        rows = self.__dict__.get("_tail_weight_rows")
        if rows is None:
            rows = self.__dict__["_tail_weight_rows"] = self.tail_weight.reshape(-1, 1, self.n_tail)
        return rows

    def logit_bias(self, k_len: int) -> torch.Tensor:
        """(B·H_kv, 1, k_len) float32: `bias` for the first N keys, 0 for the tokens decoded after.

        A view of one buffer with room to spare, so a decoding step adds the correction inside its
        logits product instead of building a bias per step.
        """
        buffer = self.__dict__.get("_logit_bias")
        if buffer is None or buffer.shape[-1] < k_len:
            width = max(k_len, self.n_slots) + 64
            buffer = torch.zeros(
                self.bias.shape[0] * self.bias.shape[1], 1, width, dtype=torch.float32, device=self.bias.device
            )
            buffer[:, 0, : self.n_slots] = self.bias.reshape(-1, self.n_slots)
            self.__dict__["_logit_bias"] = buffer
        return buffer[..., :k_len]

    def tail_moments(self, value: torch.Tensor) -> torch.Tensor:
        """(B·H_kv, T, 2) float32 [‖v_i‖², 1] of the kept tail slots, built at the first decoding step
        from the layer's values and kept: the kept entries never change while the answer is decoded."""
        moments = self.__dict__.get("_tail_moments")
        if moments is None:
            tail = value[:, :, self.n_head : self.n_slots].float()
            norms = tail.square().sum(-1).reshape(-1, self.n_tail, 1)
            moments = self.__dict__["_tail_moments"] = torch.cat([norms, torch.ones_like(norms)], dim=-1)
        return moments

    @classmethod
    def from_selection(cls, selection: Selection, context_length: int) -> HajekState:
        return cls(selection.log_pi, selection.valid, selection.counts, selection.n_head, context_length)

    def widened(self, width: int) -> HajekState:
        """The same state with invalid slots appended up to `width`."""
        extra = width - self.n_slots
        if extra <= 0:
            return self
        pad = torch.zeros(*self.log_pi.shape[:-1], extra, dtype=self.log_pi.dtype, device=self.log_pi.device)
        return HajekState(
            torch.cat([self.log_pi, pad], dim=-1), torch.cat([self.valid, pad.bool()], dim=-1),
            self.counts, self.n_head, self.context_length,
        )


def set_state(module: torch.nn.Module, state: HajekState | None) -> None:
    """Attach `state` to an attention module and start a fresh certificate list."""
    setattr(module, STATE_ATTR, state)
    setattr(module, CERT_ATTR, [])


def clear_state(module: torch.nn.Module) -> None:
    """Detach `module`'s state and start a fresh certificate list."""
    set_state(module, None)


def clear_states(model: PreTrainedModel) -> None:
    """Forget every layer's state and certificates (before running a request without this press)."""
    for module in attention_modules(model):
        clear_state(module)


def equalise_widths(cache: Cache, modules: Iterable[torch.nn.Module]) -> int:
    """Pad every layer of `cache` (and its module's state) to the widest layer; returns the width.

    transformers builds one attention mask from layer 0's length, so all layers must have the same
    number of slots. Layers whose module has no state (not compressed) are left alone; they are
    then all the same length already (a press either compresses every layer or none).
    """
    if isinstance(cache, QuantizedCache):
        raise ValueError("ProbabilisticPress does not support quantized caches")
    attached = [(m, getattr(m, STATE_ATTR, None)) for m in modules]
    pairs = [(m, state) for m, state in attached if state is not None]
    if not pairs:
        return 0
    width = max(state.n_slots for _, state in pairs)
    for module, state in pairs:
        extra = width - state.n_slots
        if extra == 0:
            continue
        layer = cache.layers[module.layer_idx]
        if layer.keys.shape[2] != state.n_slots:
            raise RuntimeError(f"layer {module.layer_idx}: cache length {layer.keys.shape[2]} ≠ {state.n_slots} slots")
        layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(*layer.keys.shape[:2], extra, layer.keys.shape[3])], dim=2)
        layer.values = torch.cat(
            [layer.values, layer.values.new_zeros(*layer.values.shape[:2], extra, layer.values.shape[3])], dim=2
        )
        setattr(module, STATE_ATTR, state.widened(width))
    return width


def kept_fraction(model: PreTrainedModel) -> float:
    """Realised kv_retained of the last prefill: kept entries / context length, averaged over
    layers, batch rows and KV heads. Layers without a state (press off, ratio 0) count as 1."""
    fractions = []
    for module in attention_modules(model):
        state = getattr(module, STATE_ATTR, None)
        if state is None:
            fractions.append(1.0)
        else:
            fractions.append(float(state.counts.float().mean()) / state.context_length)
    return sum(fractions) / len(fractions)
