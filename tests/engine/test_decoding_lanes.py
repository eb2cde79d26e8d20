"""Decoding-time presses as lanes of one ragged batch, drafted and chunked between compression
events (certkv/engine/decoding_lanes.py): every lane's generation and the KV it held after each
token are those of kvpress's hooks decoding it alone, one token a forward (run_decoding, itself
checked against kvpress's pipeline in test_decoding_presses.py)."""

from __future__ import annotations

import pytest

N_REQUESTS = 2
MAX_NEW = 64


def _presses():
    from kvpress import (
        CompressionRatioDecodingPress,
        DecodingPress,
        KnormPress,
        PrefillDecodingPress,
        StreamingLLMPress,
        TOVAPress,
    )

    return {
        "streaming@0.5/8": CompressionRatioDecodingPress(StreamingLLMPress(), target_compression_ratio=0.5,
                                                         compression_interval=8),
        # a short buffer: kvpress scores on the last 2 steps only
        "tova@0.4/5/buffer2": CompressionRatioDecodingPress(TOVAPress(), target_compression_ratio=0.4,
                                                            compression_interval=5, hidden_states_buffer_size=2),
        # a fixed target below the question's length: kvpress compresses at the question's forward too
        "streaming/target12/3": DecodingPress(StreamingLLMPress(), compression_interval=3, target_size=12),
        "prefill-streaming+tova": PrefillDecodingPress(
            prefilling_press=StreamingLLMPress(compression_ratio=0.5),
            decoding_press=CompressionRatioDecodingPress(TOVAPress(), target_compression_ratio=0.3,
                                                         compression_interval=7)),
        "knorm@0.5/8": CompressionRatioDecodingPress(KnormPress(), target_compression_ratio=0.5,
                                                     compression_interval=8),
    }


@pytest.fixture(scope="module")
def requests(embedded_recite):
    from certkv.model.generation import encode_request
    from certkv.requests.request_set import generate_requests

    _, tokenizer = embedded_recite
    drawn = generate_requests("recite", N_REQUESTS, seed=77)
    return [encode_request(tokenizer, r.context, r.question, r.answer_prefix) for r in drawn]


def test_batchable_presses_decode_as_alone(embedded_recite, requests):
    import torch
    from transformers import DynamicCache

    from certkv.engine.decoding_lanes import batchable_decoding_press, prefilled_lane
    from certkv.engine.decoding_run import run_decoding
    from certkv.engine.ragged_decode import RaggedBatch
    from certkv.model.generation import greedy_decode, stop_token_ids

    model, _ = embedded_recite
    presses = {name: p for name, p in _presses().items() if batchable_decoding_press(p, model)}
    assert set(presses) == set(_presses())
    stops, events = stop_token_ids(model), 0
    for enc in requests:
        full = DynamicCache()
        with torch.no_grad():
            model.model(input_ids=torch.as_tensor(enc.context_ids).view(1, -1), past_key_values=full)
        draft = greedy_decode(model, full, enc.question_ids, len(enc.context_ids), MAX_NEW)
        full.crop(len(enc.context_ids))
        lanes = {name: prefilled_lane(model, p, enc, MAX_NEW, stops, full=full, draft=draft) for name, p in presses.items()}
        batch, slots, forwards = RaggedBatch(model), {name: [lane.cache.slots] for name, (lane, _) in lanes.items()}, 0
        for lane, _ in lanes.values():
            batch.add(lane)
        while batch.lanes:
            batch.step()
            forwards += 1
            for name, (lane, _) in lanes.items():
                slots[name].append(lane.cache.slots)
        for name, press in presses.items():
            # its first allocation (its decode's peak) never outgrown, cut at events
            assert all(b <= a for a, b in zip(slots[name], slots[name][1:])), name
            alone = run_decoding(model, press, enc, MAX_NEW)
            lane, kept = lanes[name]
            assert lane.answer == alone.token_ids, name
            assert lane.held == pytest.approx(alone.held), name
            assert kept == pytest.approx(alone.prefill_kept), name
            assert lane.logprobs == pytest.approx(alone.logprobs, abs=1e-3), name
            events += lane.compression.events
        # drafted chunks: far fewer forwards than tokens
        assert forwards < max(len(lane.answer) for lane, _ in lanes.values())
    assert events > 20


def test_key_norm_lanes_get_the_pipelines_first_layer_keys(embedded_recite, requests):
    """A K-norm lane's first-layer keys, bit for bit, are those of kvpress's pipeline: the question
    projected in a forward of its own, each answer token in a forward of one (first_layer_keys.py),
    though the lane shares its forwards with another lane and is fed drafted chunks."""
    import torch
    from kvpress import CompressionRatioDecodingPress, KnormPress, StreamingLLMPress
    from transformers import DynamicCache

    from certkv.engine.decoding_lanes import prefilled_lane
    from certkv.engine.ragged_decode import RaggedBatch
    from certkv.model.generation import greedy_decode, stop_token_ids

    model, _ = embedded_recite
    enc, max_new = requests[1], 24
    n_ctx, q = len(enc.context_ids), len(enc.question_ids)
    full = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=torch.as_tensor(enc.context_ids).view(1, -1), past_key_values=full)
    draft = greedy_decode(model, full, enc.question_ids, n_ctx, max_new)
    full.crop(n_ctx)
    # no compression event within max_new tokens: the keys stay where the forwards put them
    knorm = CompressionRatioDecodingPress(KnormPress(), target_compression_ratio=0.5, compression_interval=64)
    streaming = CompressionRatioDecodingPress(StreamingLLMPress(), target_compression_ratio=0.5, compression_interval=64)
    lane, _ = prefilled_lane(model, knorm, enc, max_new, stop_token_ids(model), full=full, draft=draft)
    other, _ = prefilled_lane(model, streaming, enc, max_new, stop_token_ids(model), full=full, draft=draft)
    batch = RaggedBatch(model)
    batch.add(other)  # the K-norm lane second: its tokens sit past another lane's in the packed sequence
    batch.add(lane)
    while batch.lanes:
        batch.step()
    assert lane.answer == draft and len(lane.answer) == max_new

    pipeline = DynamicCache()  # the pipeline's forwards: context, question, then one token each
    with torch.no_grad():
        model.model(input_ids=torch.as_tensor(enc.context_ids).view(1, -1), past_key_values=pipeline)
        feeds = [list(enc.question_ids)] + [[t] for t in lane.answer[:-1]]
        start = n_ctx
        for ids in feeds:
            positions = torch.arange(start, start + len(ids)).view(1, -1)
            model.model(input_ids=torch.as_tensor(ids).view(1, -1), position_ids=positions, past_key_values=pipeline)
            start += len(ids)
    expected = pipeline.layers[0].keys
    assert torch.equal(lane.cache.layers[0].keys, expected)
    assert lane.cache.layers[0].keys.shape[2] == n_ctx + q + max_new - 1


def test_a_key_norm_press_decodes_alone_off_the_cpu_or_where_the_key_projection_is_not_plain(embedded_recite):
    import copy

    import torch

    from certkv.engine.decoding_lanes import batchable_decoding_press
    from certkv.model.layers import attention_modules

    class ScaledLinear(torch.nn.Linear):
        pass

    model, _ = embedded_recite
    press = _presses()["knorm@0.5/8"]
    assert batchable_decoding_press(press, model)
    other = copy.deepcopy(model)
    first = attention_modules(other)[0]
    first.k_proj = ScaledLinear(first.k_proj.in_features, first.k_proj.out_features, bias=False)
    assert not batchable_decoding_press(press, other)
    assert batchable_decoding_press(_presses()["streaming@0.5/8"], other)
    # off the CPU (here the meta device: no data, only the device type) K-norm decodes alone
    elsewhere = copy.deepcopy(model).to("meta")
    assert not batchable_decoding_press(press, elsewhere)
    assert batchable_decoding_press(_presses()["streaming@0.5/8"], elsewhere)


def test_a_forward_cannot_run_past_an_event(embedded_recite, requests):
    from kvpress import CompressionRatioDecodingPress, StreamingLLMPress

    from certkv.engine.decoding_compression import DecodingCompression
    from certkv.engine.decoding_lanes import prefilled_lane
    from certkv.model.generation import stop_token_ids

    model, _ = embedded_recite
    press = CompressionRatioDecodingPress(StreamingLLMPress(), target_compression_ratio=0.5, compression_interval=4)
    lane, _ = prefilled_lane(model, press, requests[0], 8, stop_token_ids(model))
    books = lane.compression
    assert isinstance(books, DecodingCompression) and books.room() == 4
    books.confirm(model, lane.cache.layers, len(requests[0].question_ids), lane.position, question=True)
    assert books.room() == 3
    with pytest.raises(RuntimeError, match="past its lane's compression event"):
        books.confirm(model, lane.cache.layers, 4, lane.position + 20, question=False)


def test_a_lane_gives_slots_back_and_never_outgrows_its_first_allocation(embedded_recite, requests):
    """Each compression event cuts the lane's buffers to what it can still need; the first
    allocation (its decode's peak) is never outgrown, and it matches the bound worked out by hand."""
    from certkv.engine.decoding_lanes import lane_slots, prefilled_lane
    from certkv.engine.ragged_decode import RaggedBatch
    from certkv.model.generation import stop_token_ids

    model, _ = embedded_recite
    enc, max_new = requests[0], 24
    n, q = len(enc.context_ids), len(enc.question_ids)
    k = int(n * (1 - 0.5))  # the prefill's kept half, as kvpress counts it
    # by hand: a ratio press keeps half of what it has seen at each event, every 8 steps
    # (question = one step): grows to n+q+7, then at most the target at the longest answer + 8
    hand = {"streaming@0.5/8": min(n + q + max_new, max(n + q + 7, int((n + q + max_new) * 0.5) + 8)),
            # a fixed target of 12 below the question's length: compressed at the question's forward
            "streaming/target12/3": min(n + q + max_new, max(n + q, 12 + 3)),
            # StreamingLLM keeps half of the context as it is prefilled; TOVA keeps 70% every 7 steps after
            "prefill-streaming+tova": min(k + q + max_new, max(k + q + 6, int((n + q + max_new) * 0.7) + 7))}
    presses = {name: p for name, p in _presses().items() if name in hand}
    lanes = {name: prefilled_lane(model, p, enc, max_new, stop_token_ids(model))[0] for name, p in presses.items()}
    batch = RaggedBatch(model)
    slots, layers = {}, model.config.num_hidden_layers
    for name, lane in lanes.items():
        assert lane.cache.slots == hand[name], name
        assert lane_slots(model, presses[name], enc, max_new) == hand[name] + -(-max(n, hand[name]) // layers)
        batch.add(lane)
        slots[name] = [lane.cache.slots]
    while batch.lanes:
        batch.step()
        for name, lane in lanes.items():
            slots[name].append(lane.cache.slots)
    for name, lane in lanes.items():
        seen = slots[name]
        assert all(b <= a for a, b in zip(seen, seen[1:])), name  # never grown
        assert max(lane.held) <= seen[0], name
        assert lane.compression.events > 1, name
    for name in ("streaming@0.5/8", "streaming/target12/3"):  # slots given back
        assert slots[name][-1] < slots[name][0], name
    # TOVA's target (70% of every position seen) stays above what the halved prefill leaves: nothing
    # to give back, and its first allocation is its whole question and answer
    assert slots["prefill-streaming+tova"][-1] == slots["prefill-streaming+tova"][0] == k + q + max_new


def test_prefill_time_candidates_decode_as_lanes_and_are_timed_once(embedded_recite):
    """Beside a decoding-time candidate, a prefill-time one decodes as a lane of the same batch: its
    answer is the padded fast path's, and its seconds hold its share of the lanes' decode: the lanes'
    shares fit in the decode's window, and no phase of the request's time comes out negative (the
    probe's evicted-mass time is taken out of the window that spent it, once)."""
    from kvpress import CompressionRatioDecodingPress, SnapKVPress, StreamingLLMPress

    from certkv.engine.engine import Engine, PressCandidate

    model, tokenizer = embedded_recite
    snapkv = PressCandidate("snapkv@0.50", SnapKVPress(compression_ratio=0.5), "snapkv", 0.5)
    decoding = PressCandidate("streaming_dec@0.50", CompressionRatioDecodingPress(
        StreamingLLMPress(), target_compression_ratio=0.5, compression_interval=8), "compression_ratio_decoding", 0.5)
    together = Engine(model, tokenizer, [snapkv, decoding], max_new_tokens=MAX_NEW, lookahead_tokens=4)
    alone = Engine(model, tokenizer, [snapkv], max_new_tokens=MAX_NEW, lookahead_tokens=4)
    # room for one lane a batch: the full answer decodes alone, then each candidate drafted by all of it
    one_by_one = Engine(model, tokenizer, [snapkv, decoding], max_new_tokens=MAX_NEW, lookahead_tokens=4, max_batch_bytes=1)
    assert together.lane_candidates == [decoding, snapkv] and alone.lane_candidates == []
    from certkv.requests.request_set import generate_requests

    for request in generate_requests("recite", 2, seed=77):
        result = together.run(request.context, request.question, request.answer_prefix)
        padded = alone.run(request.context, request.question, request.answer_prefix)
        single = one_by_one.run(request.context, request.question, request.answer_prefix)
        # the full answer, decoded as the lanes' first lane, is decode_full's (the padded path's)
        assert result.full.token_ids == padded.full.token_ids == single.full.token_ids
        assert result.full.confidence_min == pytest.approx(padded.full.confidence_min, rel=1e-3)
        assert [c.token_ids for c in single.candidates] == [c.token_ids for c in result.candidates]
        assert all(v >= 0 for v in result.seconds.values()), result.seconds
        # the lanes' shares are timed inside the lanes' window, apart from the evicted-mass time it subtracts
        lanes_seconds = sum(c.seconds for c in result.candidates)
        assert 0 < lanes_seconds <= result.seconds["candidates_decoding"] + 1e-9
        lane, fast = result.candidates[0], padded.candidates[0]
        assert lane.policy == fast.policy == "snapkv@0.50"
        assert lane.token_ids == fast.token_ids and lane.kv_retained_actual == fast.kv_retained_actual
        assert lane.lookahead_mass == pytest.approx(fast.lookahead_mass)
        assert lane.own_seconds and lane.seconds > 0 and not fast.own_seconds


def test_a_lane_that_compresses_its_prefill_takes_the_full_prefills_kept_entries(embedded_recite, requests):
    """A lane whose press also compresses prefills, built from the kept entries its prefilling
    scorer recorded in the request's one full prefill (what the engine does), holds exactly the
    keys and values of the lane that ran kvpress's pressed prefill itself, and decodes as it does."""
    import torch
    from kvpress import CompressionRatioDecodingPress, KnormPress, PrefillDecodingPress, SnapKVPress, StreamingLLMPress

    from certkv.engine.decoding_lanes import prefilled_lane
    from certkv.engine.full_cache import prefill_full
    from certkv.engine.ragged_decode import RaggedBatch
    from certkv.model.generation import stop_token_ids

    model, _ = embedded_recite
    stops = stop_token_ids(model)
    for prefilling in (SnapKVPress(compression_ratio=0.5, window_size=8), StreamingLLMPress(compression_ratio=0.4)):
        press = PrefillDecodingPress(prefilling_press=prefilling, decoding_press=CompressionRatioDecodingPress(
            KnormPress(), target_compression_ratio=0.5, compression_interval=8))
        for enc in requests:
            full, selections, _ = prefill_full(model, enc.context_ids, {"p#prefilling": prefilling})
            shared, kept_shared = prefilled_lane(model, press, enc, MAX_NEW, stops, full=full,
                                                 selection=selections["p#prefilling"])
            own, kept_own = prefilled_lane(model, press, enc, MAX_NEW, stops)
            assert kept_shared == kept_own < len(enc.context_ids)
            for a, b in zip(shared.cache.layers, own.cache.layers):
                assert a.length == b.length
                assert torch.equal(a.keys, b.keys)
                assert torch.equal(a.values, b.values)
            batch = RaggedBatch(model)
            for lane in (shared, own):
                batch.add(lane)
            while batch.lanes:
                batch.step()
            assert shared.answer == own.answer and shared.held == own.held


def test_a_lane_waits_for_a_growing_draft_until_it_is_a_chunk_ahead():
    """A lane caught up with the answer of a lane still decoding (the engine's full answer) skips
    forwards until that draft is DRAFT_LEAD tokens, its budget, or the lane's own departure away."""
    from certkv.engine.ragged_decode import DRAFT_LEAD, Lane, LaneCache, _waiting

    lead_answer = [5, 6, 7]
    lane = Lane(LaneCache([]), [1], 0, max_new_tokens=100, stop_ids=set(), draft=lead_answer)
    growing = {id(lead_answer)}
    assert not _waiting(lane, growing)  # its question is fed first
    lane.answer = [5, 6, 7]
    assert _waiting(lane, growing)  # caught up
    assert not _waiting(lane, set())  # the draft's lane is done: what there is, is all there will be
    lead_answer.extend(range(10, 10 + DRAFT_LEAD - 1))
    assert _waiting(lane, growing)  # not a whole chunk ahead yet
    lead_answer.append(99)
    assert not _waiting(lane, growing)  # a chunk ahead: fed it at once
    lane.answer = [5, 6, 8]
    assert not _waiting(lane, growing)  # departed: it goes on with its own proposals
    near_end = Lane(LaneCache([]), [1], 0, max_new_tokens=5, stop_ids=set(), draft=[5, 6, 7, 8])
    near_end.answer = [5, 6, 7]
    assert _waiting(near_end, {id(near_end.draft)})  # 1 ahead, 2 left to decode
    near_end.draft.append(9)
    assert not _waiting(near_end, {id(near_end.draft)})  # the rest of its answer is there
