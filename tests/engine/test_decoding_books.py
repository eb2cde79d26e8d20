"""kvpress's decoding-press books as certkv keeps them per lane (certkv/engine/decoding_compression.py):
what the scorer is handed at each compression event — its layer, the buffered hidden states, the
cache — and when, against kvpress's own hook decoding one token a forward. The scorer here records
its inputs, so buffer sizes and intervals that StreamingLLM and TOVA would not notice are checked."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

MAX_NEW = 40


def _recording_scorer(name: str = "StreamingLLMPress"):
    import kvpress

    @dataclass
    class Recording(getattr(kvpress, name)):  # type: ignore[misc]
        """The scorer, noting per call the layer, the buffered hidden states' shape and sum, the
        cache length it was handed and the last position seen."""

        calls: list = field(default_factory=list)

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            self.calls.append((module.layer_idx, tuple(hidden_states.shape), float(hidden_states.sum()), keys.shape[2],
                               int(kwargs["position_ids"].max())))
            return super().score(module, hidden_states, keys, values, attentions, kwargs)

    return Recording


@pytest.fixture(scope="module")
def request_(embedded_recite):
    from certkv.model.generation import encode_request
    from certkv.requests.request_set import generate_requests

    _, tokenizer = embedded_recite
    (r,) = generate_requests("recite", 1, seed=5)
    return encode_request(tokenizer, r.context, r.question, r.answer_prefix)


def _both(model, enc, make_press):
    """The scorer's calls and the run under kvpress's hooks, then as a drafted, chunked lane."""
    from certkv.engine.decoding_lanes import decode_lanes, prefilled_lane
    from certkv.engine.decoding_run import run_decoding
    from certkv.model.generation import stop_token_ids

    alone_press = make_press()
    alone = run_decoding(model, alone_press, enc, MAX_NEW)
    lane_press = make_press()
    lane, _ = prefilled_lane(model, lane_press, enc, MAX_NEW, stop_token_ids(model), draft=alone.token_ids)
    decode_lanes(model, [lane])
    return alone_press.base_press.calls, alone, lane_press.base_press.calls, lane


@pytest.mark.parametrize(("interval", "buffer"), [(1, 0), (3, 1), (5, 2)])  # (8, 256): test_decoding_lanes
def test_the_scorer_is_handed_what_kvpress_hands_it(embedded_recite, request_, interval, buffer):
    from kvpress import CompressionRatioDecodingPress

    model, _ = embedded_recite
    scorer = _recording_scorer()

    def make():
        return CompressionRatioDecodingPress(scorer(), target_compression_ratio=0.4, compression_interval=interval,
                                             hidden_states_buffer_size=buffer)

    want, alone, got, lane = _both(model, request_, make)
    assert lane.answer == alone.token_ids and lane.held == pytest.approx(alone.held)
    assert len(want) >= 2  # an event that evicted: one call per layer
    assert [c[:2] + c[3:] for c in got] == [c[:2] + c[3:] for c in want]
    assert [c[2] for c in got] == pytest.approx([c[2] for c in want], rel=1e-4, abs=1e-3)


def test_a_one_token_target_compresses_every_step_until_it_grows(embedded_recite, request_):
    """kvpress also compresses at a step feeding at least the target: while the ratio's target is one
    token, every step; from the step it reaches two, every interval again."""
    from kvpress import CompressionRatioDecodingPress

    model, _ = embedded_recite
    seen = len(request_.context_ids) + len(request_.question_ids)
    ratio = 1 - 2 / (seen + 12)  # the target reaches two tokens at the 12th answer token
    scorer = _recording_scorer("TOVAPress")  # StreamingLLM needs more entries than its 4 sinks
    want, alone, got, lane = _both(model, request_, lambda: CompressionRatioDecodingPress(
        scorer(), target_compression_ratio=ratio, compression_interval=8))
    assert lane.answer == alone.token_ids and lane.held == pytest.approx(alone.held)
    assert [c[3:] for c in got] == [c[3:] for c in want]
    held = alone.held
    assert held[5] == held[6] == 1 and max(held[15:]) > 2  # compressed at every step, then not


def test_only_presses_whose_books_certkv_keeps_decode_as_lanes(embedded):
    """A subclass of kvpress's decoding press keeps books of its own in its hook (CAM merges what it
    evicts), so it decodes alone; the prefilling half of the wrapper may be any press."""
    from kvpress import (
        CAMPress,
        CompressionRatioDecodingPress,
        PrefillDecodingPress,
        PyramidKVPress,
        SnapKVPress,
        StreamingLLMPress,
        TOVAPress,
    )

    from certkv.engine.decoding_lanes import batchable_decoding_press

    model, _ = embedded
    assert not batchable_decoding_press(CAMPress(StreamingLLMPress()), model)
    tova = CompressionRatioDecodingPress(TOVAPress(), target_compression_ratio=0.5, compression_interval=8)
    assert batchable_decoding_press(tova, model)
    assert batchable_decoding_press(PrefillDecodingPress(prefilling_press=SnapKVPress(0.5), decoding_press=tova), model)
    assert not batchable_decoding_press(PrefillDecodingPress(prefilling_press=SnapKVPress(0.5)), model)
    # a prefill keeping a different share per layer does not fit a lane's one allocation
    assert not batchable_decoding_press(PrefillDecodingPress(prefilling_press=PyramidKVPress(0.5), decoding_press=tova), model)


def test_a_lane_layer_that_outgrows_its_allocation_keeps_every_entry_and_says_so(caplog):
    """Growing past the allocation means a KV reservation was too small: the entries are kept
    (nothing lost), and a warning makes the under-reservation visible."""
    import logging

    import torch

    from certkv.engine.ragged_decode import LaneLayer

    keys, values = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    layer = LaneLayer.holding(keys, values, room=1)
    more_k, more_v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    with caplog.at_level(logging.WARNING, logger="certkv.engine.ragged_decode"):
        layer.append(more_k, more_v)
    assert not caplog.records  # within its room
    extra_k, extra_v = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    with caplog.at_level(logging.WARNING, logger="certkv.engine.ragged_decode"):
        layer.append(extra_k, extra_v)
    assert "outgrew its allocation (6 > 4 slots)" in caplog.text
    assert torch.equal(layer.keys, torch.cat([keys, more_k, extra_k], dim=2))
    assert torch.equal(layer.values, torch.cat([values, more_v, extra_v], dim=2))
    caplog.clear()
    for _ in range(5):  # it says so once: later forwards over the grown buffers stay quiet
        with caplog.at_level(logging.WARNING, logger="certkv.engine.ragged_decode"):
            layer.append(more_k, more_v)
    assert not caplog.records and layer.length == 11 and torch.equal(layer.keys[:, :, -1:], more_k)
