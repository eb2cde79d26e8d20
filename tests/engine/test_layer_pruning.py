"""A lean single-prefill request prunes its prefill layer by layer and reserves what it holds at its peak.

The KV is measured, not computed: hooks registered before the path's own see, at every attention
layer, the prefill's full layer in the transformers cache and every :class:`LaneLayer` alive (found
by the garbage collector, whoever holds it); the gather's transient (a layer's full prefill beside
its kept copy) is the first reading plus what that layer's copy adds by the next one. The decode is
then run as the scheduler runs it (a :class:`RaggedBatch`), the lane's allocated capacity read after
every step. The reservation must cover the largest reading and exceed it by less than one slot,
and the answer must be the in-process one (the full prefill held, kept entries gathered at the end).
"""

from __future__ import annotations

import gc

import pytest

from certkv.core.spec import GateSettings
from certkv.engine.layer_pruning import pruned_peak_slots
from certkv.engine.ragged_decode import Lane, LaneLayer, RaggedBatch
from certkv.model.generation import encode_request, stop_token_ids
from certkv.presses.registry import build_press
from certkv.requests.request_set import generate_requests
from certkv.runtime.single_prefill import SinglePrefillPath
from certkv.runtime.steps import Decode, Reserve

MAX_NEW = 40


class _KvMeter:
    """Token slots of KV alive at each attention layer's forward (module docstring), in entries
    summed over layers: the transformers cache's layers and every LaneLayer's allocated capacity."""

    def __init__(self, model):
        self.model = model
        self.readings: list[float] = []

    @staticmethod
    def lanes() -> float:
        gc.collect()
        return sum(o.capacity for o in gc.get_objects() if type(o) is LaneLayer)

    def hook(self, module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        self.readings.append(sum(layer.keys.shape[2] for layer in cache.layers) + self.lanes())
        return output

    def __enter__(self):
        self.handles = [layer.self_attn.register_forward_hook(self.hook, with_kwargs=True)
                        for layer in self.model.model.layers]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("press_name", ["snapkv", "streaming_llm"])
def test_reservation_covers_the_measured_peak_and_the_answer_is_unchanged(embedded, press_name):
    model, tokenizer = embedded
    request = generate_requests("demo", n=1, seed=41, context_length=(300, 360))[0]
    enc = encode_request(tokenizer, request.context, request.question, request.answer_prefix)
    stops = stop_token_ids(model)
    path = SinglePrefillPath(model, build_press(press_name, 0.5), GateSettings(), press_name, stops)
    assert path.prunes()
    expected = path.answer(enc, MAX_NEW, {})

    steps = path.steps(enc, MAX_NEW, {}, lean=True)
    reserve = next(steps)
    assert isinstance(reserve, Reserve)
    meter = _KvMeter(model)
    lanes_before = meter.lanes()
    with meter:
        decode = steps.send(None)
    assert isinstance(decode, Decode) and decode.cache is not None
    # Layer i's reading holds its full prefill; its copy (the lane's layer i) is made right after it.
    copies = [layer.capacity for layer in decode.cache.layers]
    layers = model.config.num_hidden_layers
    assert len(meter.readings) == layers
    prefill_peak = max(r - lanes_before + c for r, c in zip(meter.readings, copies)) / layers

    batch = RaggedBatch(model)
    lane = Lane(decode.cache, decode.question_ids, decode.position, decode.max_new_tokens, decode.stop_ids,
                lookup_ids=decode.lookup_ids, want_logprobs=decode.want_logprobs)
    batch.add(lane)
    decode_peak = lane.cache.slots
    while batch.lanes:
        batch.step()
        decode_peak = max(decode_peak, lane.cache.slots)
    decode.ids, decode.logprobs = lane.answer, lane.logprobs
    with pytest.raises(StopIteration) as stop:
        steps.send(None)

    answer = stop.value.value
    assert answer.ids == expected.ids and answer.mode == "evicted" and len(answer.ids) > 1
    n_ctx, room = len(enc.context_ids), len(enc.question_ids) + MAX_NEW
    kept = copies[0] - room
    assert kept == n_ctx // 2  # half of the context in every layer
    # Independent of the formula: every layer's kept entries and room plus the last full layer.
    assert prefill_peak == pytest.approx((layers * (kept + room) + n_ctx) / layers)
    peak = max(prefill_peak, decode_peak)
    assert peak <= reserve.slots < peak + 1
    assert reserve.slots == pruned_peak_slots([kept] * layers, n_ctx, room)
