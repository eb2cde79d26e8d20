"""kvpress's decoding-time compression for one lane of a ragged batch, applied once tokens are confirmed.

kvpress's decoding presses (``DecodingPress`` and ``CompressionRatioDecodingPress``, alone or as
the decoding half of ``PrefillDecodingPress``) work from a forward hook: each decoding forward is
one *step*; the hook buffers the layer's input hidden states of every step and, at every
``compression_interval``-th step (or a step feeding at least the target size), hands the buffer
and the layer's cache to the wrapped scorer press, which keeps its target. The pipeline feeds one
token per step, so a step is a token.

A ragged batch (:mod:`certkv.engine.ragged_decode`) feeds a lane several tokens in one forward: its
pending token and proposals (prompt lookup, or a draft during calibration) of which only the first
ones the greedy choice confirms stay. Running kvpress's hook there would count the forward as one
step and compress a cache that may hold rejected tokens. :class:`DecodingCompression` keeps the
same books per lane and per layer instead, but after the forward, over the confirmed tokens only:

* :meth:`DecodingCompression.room` caps what a lane may feed so that a forward never runs past the
  next event (the tokens up to the event are exactly the pipeline's steps up to it);
* :meth:`DecodingCompression.capture` keeps a forward's layer inputs, (1, fed, hidden) per layer;
* :meth:`DecodingCompression.confirm` moves the confirmed tokens' inputs into the step buffer,
  one step per token (the question's forward is one step, as in the pipeline), and at an event
  compresses each layer with the press's own ``compress`` — kvpress's target size, its scorer,
  its ratio search — on the buffer, the layer's keys and values, and the event step's position
  ids and rotary embeddings.

The result is the pipeline's cache up to float noise: a chunk forward computes its tokens' keys
and hidden states in one matmul rather than one per step (the tests compare answers with kvpress's
pipeline token for token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from kvpress import DecodingPress, PrefillDecodingPress

from certkv.model.layers import attention_modules, decoder

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class CompressibleLayer(Protocol):
    """One layer of one lane's cache: keys and values (1, H_kv, n, d), replaced by :meth:`keep`."""

    @property
    def keys(self) -> torch.Tensor: ...

    @property
    def values(self) -> torch.Tensor: ...

    def keep(self, keys: torch.Tensor, values: torch.Tensor) -> None: ...


def decoding_press_of(press: Any) -> DecodingPress | None:
    """The kvpress decoding press `press` compresses with while decoding (itself, or the decoding
    half of a ``PrefillDecodingPress``); None for a press that does not compress while decoding."""
    if isinstance(press, DecodingPress):
        return press
    if isinstance(press, PrefillDecodingPress):
        return press.decoding_press
    return None


@dataclass
class DecodingCompression:
    """The decoding-time books of one lane under a kvpress decoding press (module docstring).

    `press` is the decoding press (:func:`decoding_press_of`); its ``compress`` is called, never
    its hook, so its own state stays untouched and one press may serve many lanes. `steps` counts
    the steps since the last event (every layer compresses at the same steps); `buffer` holds per
    layer the buffered steps' inputs, a list of (1, tokens, hidden) tensors, at most the press's
    ``hidden_states_buffer_size`` of them; `pending` a forward's inputs until :meth:`confirm`.
    `events` counts the compressions so far; `every_step`: the press's target at the next token's
    position is a single token, so kvpress compresses at that step whatever its count.
    """

    press: DecodingPress
    steps: int = 0
    every_step: bool = False
    events: int = 0
    buffer: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    pending: dict[int, torch.Tensor] = field(default_factory=dict)

    def room(self) -> int:
        """How many tokens the lane's next forward may feed: up to and including the next event's."""
        if self.every_step:
            return 1
        return max(1, self.press.compression_interval - self.steps)

    def capture(self, layer_idx: int, hidden_states: torch.Tensor) -> None:
        """Keep a forward's `hidden_states` (1, fed, hidden) at the input of layer `layer_idx`'s
        attention (what kvpress's hook buffers) until :meth:`confirm` says how many stay."""
        self.pending[layer_idx] = hidden_states.detach().clone()

    def confirm(self, model: PreTrainedModel, layers: Sequence[CompressibleLayer], confirmed: int,
                first_position: int, question: bool) -> bool:
        """Book the first `confirmed` fed tokens as steps; compress `layers` at an event.

        `first_position` is the position of the first fed token; `question`: the forward fed the
        question (one step, however many tokens, as the pipeline's question forward). The caller
        has cropped rejected tokens from `layers` already. Returns whether the layers were
        compressed (an event).
        """
        pending, self.pending = self.pending, {}
        if question:
            steps = {i: [h[:, :confirmed]] for i, h in pending.items()}
            last = first_position + confirmed - 1
            # kvpress's second trigger, a step feeding at least the target: a token step does while
            # the target at its position is one token (re-read after every step: it grows with them)
            self.every_step = self._target(last + 1) <= 1
            event = self.steps + 1 >= self.press.compression_interval or confirmed >= self._target(last)
            event_positions = list(range(first_position, first_position + confirmed))
        else:
            steps = {i: list(h[:, :confirmed].split(1, dim=1)) for i, h in pending.items()}
            if confirmed > self.room():
                raise RuntimeError("a forward ran past its lane's compression event; feed at most room() tokens")
            event = self.every_step or self.steps + confirmed >= self.press.compression_interval
            event_positions = [first_position + confirmed - 1]
            self.every_step = self._target(first_position + confirmed) <= 1
        n_steps = len(next(iter(steps.values()), [None]))
        if not event:
            for i, layer_steps in steps.items():
                self.buffer[i] = self._trimmed(self.buffer.get(i, []) + layer_steps)
            self.steps += n_steps
            return False
        # kvpress trims the buffer after each step, then compresses on it plus the event step's inputs
        for i, layer_steps in steps.items():
            self.buffer[i] = self._trimmed(self.buffer.get(i, []) + layer_steps[:-1]) + layer_steps[-1:]
        self._compress(model, layers, event_positions)
        return True

    def most_held(self, length: int, to_feed: int, last_position: int, to_event: int | None = None,
                  interval: int | None = None) -> int:
        """The most entries a layer holding `length` now may hold from here to the answer's end.

        `to_feed`: the most tokens the lane may still feed (each token step one; a forward's
        rejected proposals are fed before they are cropped, so count one more than the answer's
        tokens left); `last_position`: the position of the last token it could feed; `to_event`:
        tokens fed before the next event (default :meth:`room`); `interval`: the most steps between
        two events (default the press's). Until that event the layer grows by what is fed; an event
        cuts it to the press's target (kvpress keeps exactly the target, or all when fewer), after
        which it grows by at most one interval before the next. Targets never shrink as positions grow, so the bound is

            min(length + to_feed, max(length + min(to_event, to_feed), target(last_position) + interval))

        — for ``CompressionRatioDecodingPress`` the target at the longest answer plus one interval,
        for ``DecodingPress`` its ``target_size`` plus one interval, unless the answer ends first.
        """
        if interval is None:  # a one-token target compresses every step only until it grows: not one
            interval = self.press.compression_interval
        to_event = self.room() if to_event is None else to_event
        grown = length + min(to_event, to_feed)
        return min(length + to_feed, max(grown, self._target(last_position) + interval))

    def first_peak(self, prefill_kept: int, question: int, max_new_tokens: int, position: int) -> int:
        """:meth:`most_held` before the question is fed: a layer holding `prefill_kept` entries,
        a question of `question` tokens fed from `position` (one step, an event when it reaches the
        target or the interval is one step), then up to `max_new_tokens` answer tokens (books as
        :meth:`confirm` keeps them)."""
        last_question, every = position + question - 1, self.press.compression_interval
        at_question = every <= 1 or question >= self._target(last_question)
        to_event = question if at_question else question + every - 1
        interval = max(1, every)
        last = position + question + max_new_tokens - 1
        return self.most_held(prefill_kept, question + max_new_tokens, last, to_event=to_event, interval=interval)

    def _target(self, last_position: int) -> int:
        """The press's target size when the last token seen sits at `last_position`."""
        return int(self.press._resolve_target_size({"position_ids": torch.tensor([[last_position]])}))

    def _trimmed(self, steps: list[torch.Tensor]) -> list[torch.Tensor]:
        """The last ``hidden_states_buffer_size`` of `steps` (none when it is 0), as kvpress trims
        its buffer after every step; each step's inputs are (1, tokens, hidden)."""
        size = self.press.hidden_states_buffer_size
        return steps[-size:] if size > 0 else []

    def _compress(self, model: PreTrainedModel, layers: Sequence[CompressibleLayer], positions: list[int]) -> None:
        """Every layer through the press's ``compress``, then a fresh buffer.

        Each layer's scorer gets the buffered steps' inputs concatenated, (1, tokens, hidden), the
        layer's keys and values (1, H_kv, n, d), and the event step's `positions` as kvpress's hook
        sees them: ``position_ids`` (1, steps) and their rotary embeddings, each (1, steps, head_dim).
        """
        position_ids = torch.tensor([positions], device=model.device)
        modules = attention_modules(model)
        probe = next(iter(self.buffer.values()))[0] if self.buffer else None
        rotary = decoder(model).rotary_emb
        x = probe if probe is not None else torch.zeros((1, 1, 1), device=model.device)
        embeddings = rotary(x, position_ids)
        kwargs = {"position_ids": position_ids, "position_embeddings": embeddings,
                  "cache_position": position_ids[0]}
        for layer_idx, layer in enumerate(layers):
            steps = self.buffer.get(layer_idx, [])
            hidden = torch.cat(steps, dim=1) if steps else x[:, :0]
            keys, values = self.press.compress(modules[layer_idx], hidden, layer.keys, layer.values, None, kwargs)
            layer.keep(keys, values)
        self.buffer, self.steps = {}, 0
        self.events += 1


__all__ = ["CompressibleLayer", "DecodingCompression", "decoding_press_of"]
