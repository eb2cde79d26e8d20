"""certkv's per-token KV formats (fp8, int, split) against references written here.

* The quantisers equal an independent float64 implementation: fp8 rounds to the nearest value of
  the format's grid (read off its 256 bit patterns, ties to an even mantissa) after division by
  the scale and saturation at the format's largest value; int is symmetric per group with a
  float16 scale ``amax / (2^(b-1) - 1)``.
* A :class:`TokenFormatLayer` fed a prefill, then tokens one at a time, returns at every step
  every entry as stored once the step's own are stored: the tokens that have left the
  full-precision window quantised one by one (the step's own too when the window is empty), then
  the window; the prefill reads itself at full precision. It never changes a stored token, a chunk
  stores what single tokens do, and it is priced (:func:`held_units`, :func:`held_tokens`) as
  counted by hand.
* "Dequantise, then attend": the embedded model's generations in a format (:func:`run_in_format`)
  equal a float64 run of the model whose cache replaces every newly stored key and value by its
  reference quantise→dequantise before a decoding step's attention reads them (the prefill reads
  its own at full precision, then stores them so).
"""

from __future__ import annotations

import pytest

#: Residual window lengths the per-token layer is fed with (0: every token stored at once).
WINDOWS = (0, 3)


# -- independent float64 quantisers ---------------------------------------------------------------


def _fp8_grid(dtype: str):
    """Every finite value of the fp8 format, ascending, with its bit pattern."""
    import torch

    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view({"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[dtype]).double()
    finite = torch.isfinite(values)
    values, codes = values[finite], codes[finite].long()
    order = torch.argsort(values, stable=True)
    return values[order], codes[order]


def ref_fp8(x, dtype: str, scale: float):
    """x / scale saturated at the format's largest value, rounded to the nearest grid value (ties:
    the even mantissa, the last bit of the pattern), times scale; float64."""
    import torch

    values, codes = _fp8_grid(dtype)
    y = (x.double() / scale).clamp(-values.max(), values.max()).contiguous()
    hi = torch.searchsorted(values, y).clamp(max=len(values) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = y - values[lo], values[hi] - y
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    return torch.where(take_hi, values[hi], values[lo]) * scale


def ref_int(x, nbits: int, group: int):
    """Symmetric `nbits` integers per `group` channels: float16 scale amax / (2^(b-1) - 1),
    round half to even, clamp; float64 (a group of zeros stays zero)."""
    import torch

    largest = 2 ** (nbits - 1) - 1
    g = x.double().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scale = (g.abs().amax(dim=-1, keepdim=True) / largest).to(torch.float16).double()
    q = torch.round(g / torch.where(scale == 0, torch.ones_like(scale), scale)).clamp(-largest, largest)
    return (q * scale).reshape(x.shape)


def ref_qdq(part: dict, x):
    """The reference quantise→dequantise of one format (a mapping as a contract writes it)."""
    if part["backend"] == "fp8":
        return ref_fp8(x, part.get("dtype", "e4m3"), part.get("scale", 1.0))
    return ref_int(x, part["nbits"], part.get("q_group_size") or x.shape[-1])


def _parts(fmt: dict) -> tuple[dict, dict]:
    return (fmt["keys"], fmt["values"]) if fmt["backend"] == "split" else (fmt, fmt)


# -- (a) the quantisers ------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "scale"), [("e4m3", 1.0), ("e4m3", 0.25), ("e5m2", 1.0), ("e5m2", 4.0)])
def test_fp8_quantiser_equals_the_grid_rounding(dtype, scale):
    import torch

    from certkv.kv_formats.spec import parse_format
    from certkv.kv_formats.token_quantisers import token_quantiser

    largest = {"e4m3": 448.0, "e5m2": 57344.0}[dtype]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 40, 32, generator=gen) * torch.logspace(-6, 2, 32)  # subnormals to large values
    beyond = torch.tensor([1.001, 1.03, 1.1, 2.0, 1e3]) * largest * scale  # past the largest value: saturates
    x[0, 0, 0, :10] = torch.cat([beyond, -beyond])
    quantiser = token_quantiser(parse_format({"backend": "fp8", "dtype": dtype, "scale": scale}), 32)
    stored = quantiser.quantize(x)
    assert stored.data.dtype == {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[dtype] and stored.scale is None
    got = stored.dequantize()
    assert got.dtype == torch.float32 and got.shape == x.shape
    want = ref_fp8(x, dtype, scale)
    assert torch.equal(got.double(), want)
    assert got[0, 0, 0, :5].tolist() == [largest * scale] * 5 and got[0, 0, 0, 5:10].tolist() == [-largest * scale] * 5
    assert not torch.isnan(got).any()
    # not the identity: most values moved, normal ones by at most half a step (relative 2^-4 or 2^-3)
    normal = (x.abs() < largest * scale) & (x.abs() >= torch.finfo(stored.data.dtype).tiny * scale)
    assert (got != x).float().mean() > 0.9
    rel = ((got - x).abs() / x.abs())[normal]
    assert 0 < rel.max() <= {"e4m3": 2**-4, "e5m2": 2**-3}[dtype] + 1e-7


@pytest.mark.parametrize(("nbits", "group"), [(8, None), (8, 32), (7, None), (6, 32), (5, 16), (4, 16), (3, 8), (2, 8)])
def test_int_quantiser_equals_symmetric_groups(nbits, group):
    import torch

    from certkv.kv_formats.spec import parse_format
    from certkv.kv_formats.token_quantisers import token_quantiser

    gen = torch.Generator().manual_seed(nbits * 100 + (group or 0))
    x = torch.randn(1, 2, 50, 64, generator=gen) * 3
    x[0, 1, 7] = 0.0  # a whole token and head of zeros
    x[0, 0, 9, :16] = 0.0  # one zero group (or a partly zero head when the group is the head)
    fmt = {"backend": "int", "nbits": nbits, "q_group_size": group}
    stored = token_quantiser(parse_format(fmt), 64).quantize(x)
    size = group or 64
    largest = 2 ** (nbits - 1) - 1
    # below 8 bits packed, eight channels in nbits bytes (a uint8 of head_dim * nbits / 8); 8 bits an int8 each
    packed = nbits < 8
    assert stored.data.dtype == (torch.uint8 if packed else torch.int8)
    assert stored.data.shape == (1, 2, 50, 64 * nbits // 8) and stored.shape == (1, 2, 50, 64)
    assert stored.nbytes == stored.data.numel() + 2 * stored.scale.numel()
    from certkv.kv_formats.spec import stored_share

    # the bytes stored are the bytes the format is priced at, over a 16-bit token
    assert stored.nbytes / (2 * x.numel()) == stored_share(parse_format(fmt), 64) == parse_format(fmt).bytes_share(64)
    assert int(stored.quantiser.integers(stored).abs().max()) == largest
    assert stored.scale.dtype == torch.float16 and stored.scale.shape == (1, 2, 50, 64 // size)
    got = stored.dequantize()
    assert got.dtype == torch.float32
    assert torch.equal(got.double(), ref_int(x, nbits, size))
    assert torch.equal(got[0, 1, 7], torch.zeros(64)) and not torch.isnan(got).any()
    assert torch.equal(got[0, 0, 9, :16], torch.zeros(16))
    assert (got != x).float().mean() > 0.5  # it quantised


@pytest.mark.parametrize("nbits", [2, 3, 4, 5, 6, 7])
def test_packed_integers_round_trip_and_head_sizes_that_do_not_pack_fall_back(nbits):
    """Every integer of the range survives packing, channel by channel, for each width; 4 bits pack
    as nibbles do; a head size that is not a multiple of 8 stores two to a byte (at most 4 bits,
    even size) or an int8 each, and is priced so by stored_share."""
    import torch

    from certkv.kv_formats.spec import parse_format, stored_bits, stored_share
    from certkv.kv_formats.token_quantisers import pack_bits, pack_nibbles, token_quantiser, unpack_bits

    low, high = -(2 ** (nbits - 1)), 2 ** (nbits - 1) - 1
    q = torch.arange(low, high + 1, dtype=torch.int8).repeat(8)[: 8 * (2 ** nbits // 8 + 1)]
    q = torch.cat([q, q.flip(0)])[None, :]
    q = q[:, : q.shape[1] // 8 * 8]
    packed = pack_bits(q, nbits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == q.shape[-1] * nbits // 8
    assert torch.equal(unpack_bits(packed, nbits), q)
    if nbits == 4:
        assert torch.equal(packed, pack_nibbles(q))
    for head, bits in ((64, nbits), (6, 4 if nbits <= 4 else 8), (5, 8)):
        assert stored_bits(nbits, head) == bits
        fmt = parse_format({"backend": "int", "nbits": nbits, "q_group_size": head})
        x = torch.randn(1, 1, 3, head, generator=torch.Generator().manual_seed(head))
        stored = token_quantiser(fmt, head).quantize(x)
        assert stored.shape == (1, 1, 3, head) and stored.data.shape[-1] * 8 == head * bits
        assert stored.nbytes / (2 * x.numel()) == pytest.approx(stored_share(fmt, head))
        assert torch.equal(stored.dequantize().double(), ref_int(x, nbits, head))


def test_quantisers_dequantise_to_the_input_dtype_and_refuse_a_ragged_group():
    import torch

    from certkv.kv_formats.spec import parse_format
    from certkv.kv_formats.token_quantisers import token_quantiser

    x = (torch.randn(1, 2, 5, 32, generator=torch.Generator().manual_seed(0)) * 2).to(torch.bfloat16)
    for fmt in ({"backend": "fp8"}, {"backend": "int", "nbits": 8, "q_group_size": 16}):
        got = token_quantiser(parse_format(fmt), 32).quantize(x).dequantize()
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, ref_qdq(fmt, x.float()).to(torch.bfloat16))
    with pytest.raises(ValueError, match="q_group_size 24 does not divide the model's head size 32"):
        token_quantiser(parse_format({"backend": "int", "nbits": 8, "q_group_size": 24}), 32)


# -- (b) the per-token layer ---------------------------------------------------------------------------


LAYER_FORMATS = {
    "int8": lambda r: {"backend": "int", "nbits": 8, "residual_length": r},
    "fp8e4m3": lambda r: {"backend": "fp8", "residual_length": r},
    # keys stored at once, values after a window of r tokens
    "split": lambda r: {"backend": "split", "keys": {"backend": "int", "nbits": 4, "q_group_size": 16},
                        "values": {"backend": "fp8", "dtype": "e5m2", "residual_length": r}},
}


def _token_by_token(part: dict, x):
    """`x` (1, heads, n, d) quantised and dequantised one token at a time by the reference."""
    import torch

    return torch.cat([ref_qdq(part, x[:, :, i : i + 1]).float() for i in range(x.shape[-2])], dim=-2)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", sorted(LAYER_FORMATS))
def test_token_format_layer_step_by_step(name, window):
    import torch
    from transformers import LlamaConfig

    from certkv.kv_formats.caches import TokenFormatLayer, build_cache, held_tokens, held_units
    from certkv.kv_formats.spec import parse_format

    fmt_data = LAYER_FORMATS[name](window)
    fmt, parts = parse_format(fmt_data), _parts(fmt_data)
    windows = [p.get("residual_length", 0) for p in parts]
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    cache = build_cache(fmt, config)
    assert all(isinstance(layer, TokenFormatLayer) for layer in cache.layers) and len(cache.layers) == 2
    n, steps, heads, d = 9, 8, 2, 32
    gen = torch.Generator().manual_seed(len(name) + window)
    states = [torch.randn(1, heads, n + steps, d, generator=gen) * 4 for _ in range(4)]  # k, v of each layer
    shares = [parse_format({**p, "residual_length": 0}).bytes_share(d) for p in parts]

    def check_held(tokens: int, decoded: int) -> None:
        """held_units / held_tokens counted by hand: per part, the decoded tokens still in its
        window at full precision, the others at the part's share; keys and values each half."""
        in_window = [min(decoded, w) for w in windows]
        units = sum((tokens - w) * s + w for w, s in zip(in_window, shares)) / 2
        assert held_units(cache, fmt, d) == pytest.approx(units, rel=1e-12)
        assert held_tokens(cache) == tokens

    for layer in range(2):
        k, v = states[2 * layer], states[2 * layer + 1]
        got = cache.update(k[:, :, :n], v[:, :, :n], layer)
        assert torch.equal(got[0], k[:, :, :n]) and torch.equal(got[1], v[:, :, :n])  # the prefill reads itself
    check_held(n, 0)
    earlier = None
    for t in range(steps):
        for layer in range(2):
            outs = cache.update(states[2 * layer][:, :, n + t : n + t + 1], states[2 * layer + 1][:, :, n + t : n + t + 1], layer)
            for part, w, x, out in zip(parts, windows, states[2 * layer : 2 * layer + 2], outs):
                stored = n + max(0, t + 1 - w)  # tokens quantised once this step's own is stored
                want = torch.cat([_token_by_token(part, x[:, :, :stored]), x[:, :, stored : n + t + 1]], dim=-2)
                assert torch.equal(out, want), (t, layer)
        check_held(n + t + 1, t + 1)
        layer0 = cache.layers[0]
        now = [(s.data.clone(), None if s.scale is None else s.scale.clone())
               for s in (layer0._quantized_keys, layer0._quantized_values)]
        if earlier is not None:  # a stored token never changes
            for (data, scale), (old_data, old_scale) in zip(now, earlier):
                assert torch.equal(data[:, :, : old_data.shape[-2]].view(torch.uint8), old_data.view(torch.uint8))
                assert old_scale is None or torch.equal(scale[:, :, : old_scale.shape[-2]], old_scale)
        earlier = now
    # A chunk fed at once stores the same tokens as one at a time, and the tokens after it read the same entries.
    chunked = build_cache(fmt, config)
    for layer in range(2):
        k, v = states[2 * layer], states[2 * layer + 1]
        chunked.update(k[:, :, :n], v[:, :, :n], layer)
        chunked.update(k[:, :, n : n + 5], v[:, :, n : n + 5], layer)
        for t in range(5, steps):
            outs = chunked.update(k[:, :, n + t : n + t + 1], v[:, :, n + t : n + t + 1], layer)
            for part, w, x, out in zip(parts, windows, (k, v), outs):
                stored = n + max(0, t + 1 - w)
                assert torch.equal(out, torch.cat([_token_by_token(part, x[:, :, :stored]), x[:, :, stored : n + t + 1]], dim=-2))
    for a, b in zip(chunked.layers, cache.layers):
        for which in ("keys", "values"):
            assert torch.equal(getattr(a, f"_quantized_{which}").dequantize(), getattr(b, f"_quantized_{which}").dequantize())
            window_a, window_b = getattr(a, which), getattr(b, which)
            assert window_a.numel() == window_b.numel() and (window_a.numel() == 0 or torch.equal(window_a, window_b))


# -- (c) dequantise, then attend ------------------------------------------------------------------------

#: The formats the embedded model's generations are checked in (residual 0: a decoding step's own
#: entries are stored quantised before its attention reads them).
MODEL_FORMATS = {
    "fp8e4m3": {"backend": "fp8", "dtype": "e4m3"},
    "int8": {"backend": "int", "nbits": 8},
    "k_int8g16_v_int4g16": {"backend": "split", "keys": {"backend": "int", "nbits": 8, "q_group_size": 16},
                            "values": {"backend": "int", "nbits": 4, "q_group_size": 16}},
}
#: Their bytes over a 16-bit cache's at the embedded model's head size of 32, by hand: fp8 8 bits;
#: int8 8 bits and a 16-bit scale per head; the split's keys 8 and values 4 bits, a scale per 16.
SHARES = {"fp8e4m3": 8 / 16, "int8": (8 + 16 / 32) / 16, "k_int8g16_v_int4g16": ((8 + 1) / 16 + (4 + 1) / 16) / 2}
N_NEW = 16
#: float32 against float64 logits: up to 5e-5 measured (an element that rounds to the other side
#: of a quantisation step in float32 included); the formats themselves move them by 0.03 to 3.
LOGIT_TOL = 2e-4


def _reference_cache(model, fmt: dict | None):
    """A float64 cache that stores each layer's new keys and values as their reference
    quantise→dequantise (None: as computed); the prefill reads its own unquantised, a decoding
    step reads every entry as stored, its own included."""
    import torch
    from transformers.cache_utils import Cache, DynamicLayer

    class Layer(DynamicLayer):
        def update(self, keys, values, cache_kwargs=None):
            prefill = not self.is_initialized
            if prefill:
                self.lazy_initialization(keys, values)
            stored = (keys, values) if fmt is None else [ref_qdq(p, x) for p, x in zip(_parts(fmt), (keys, values))]
            self.keys, self.values = torch.cat([self.keys, stored[0]], dim=-2), torch.cat([self.values, stored[1]], dim=-2)
            return (keys, values) if prefill else (self.keys, self.values)

    return Cache(layers=[Layer() for _ in range(model.config.num_hidden_layers)])


def _reference_logits(model, fmt: dict | None, enc, tokens: list[int]):
    """The float64 model's logits before each of `tokens` (fed them one by one, as kvpress decodes)."""
    import torch

    cache = _reference_cache(model, fmt)
    n = len(enc.context_ids)
    rows = []
    with torch.no_grad():
        model.model(input_ids=torch.tensor([enc.context_ids]), past_key_values=cache)
        q = len(enc.question_ids)
        out = model(input_ids=torch.tensor([enc.question_ids]), past_key_values=cache,
                    position_ids=torch.arange(n, n + q).unsqueeze(0))
        for i, token in enumerate(tokens):
            rows.append(out.logits[0, -1])
            if i + 1 < len(tokens):
                out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=torch.tensor([[n + q + i]]))
    return torch.stack(rows)


@pytest.fixture(scope="module")
def float64_model():
    from certkv.model.loading import load_model

    return load_model("embedded", device="cpu")[0].double()


@pytest.mark.parametrize("name", sorted(MODEL_FORMATS))
def test_generation_in_a_format_is_dequantise_then_attend(name, embedded, float64_model):
    """:func:`run_in_format` (the solo decode calibration's pipeline path and the runtime use), and
    the engine's answer for the same format alone (decoded as a lane beside the full answer), both
    against the float64 reference."""
    import torch

    from certkv.engine.engine import Engine, PressCandidate
    from certkv.engine.format_run import run_in_format
    from certkv.kv_formats.spec import parse_format
    from certkv.model.generation import encode_request
    from certkv.requests.request_set import generate_requests

    model, tokenizer = embedded
    fmt = MODEL_FORMATS[name]
    share = SHARES[name]
    engine = Engine(model, tokenizer, [PressCandidate(f"{name}@1.00", None, "none", 1.0, kv_format=parse_format(fmt))],
                    max_new_tokens=N_NEW)
    logits: list = []
    same, moved = 0, 0.0
    requests = generate_requests("all", 4, seed=11, context_length="200-320")
    for req in requests:
        enc = encode_request(tokenizer, req.context, req.question)
        answer = engine.run(req.context, req.question).candidates[0]
        logits.clear()
        hook = model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out[0, -1].detach().clone()))
        try:
            run = run_in_format(model, parse_format(fmt), enc, N_NEW)
        finally:
            hook.remove()
        assert answer.token_ids == run.token_ids, req.id
        assert answer.logprobs == pytest.approx(run.logprobs, abs=LOGIT_TOL)
        # every token is stored in the format at once: the bytes are its share, throughout
        assert run.held_units == pytest.approx([share * h for h in run.held], rel=1e-12)
        assert (answer.kv_peak_bytes, answer.kv_time_bytes) == pytest.approx((share, share), rel=1e-12)
        ran = torch.stack(logits[: len(run.token_ids)]).double()
        assert run.held_units and len(run.held_units) == len(run.token_ids)
        want = _reference_logits(float64_model, fmt, enc, run.token_ids)
        # The reference follows the run's tokens; where its own greedy choice agrees all the way,
        # the whole logit rows agree to float32's noise.
        if want.argmax(dim=-1).tolist() == run.token_ids:
            same += 1
            assert (ran - want).abs().max() < LOGIT_TOL, (req.id, float((ran - want).abs().max()))
            chosen = torch.log_softmax(want, dim=-1)[torch.arange(len(run.token_ids)), run.token_ids]
            assert torch.allclose(torch.tensor(run.logprobs, dtype=torch.float64), chosen, atol=LOGIT_TOL)
        unquantised = _reference_logits(float64_model, None, enc, run.token_ids)
        moved = max(moved, float((unquantised - want).abs().max()))
    assert same >= len(requests) - 1, same
    assert moved > 100 * LOGIT_TOL, moved  # the format changed the logits: agreeing above proves something


# -- (d) three tiers: full precision, quantised, evicted ---------------------------------------------

TIERED = {"backend": "tiered", "full": 0.2, "quantised": {"backend": "int", "nbits": 4, "q_group_size": 16}}


def _tiered_reference_cache(model, kept: list, n_full: int):
    """A float64 cache holding, per layer and KV head, the press's kept entries `kept[layer]`
    ((1, H_kv, n_kept), highest score first): the first `n_full` as computed, the others and every
    later entry as their reference quantise→dequantise; the prefill reads itself unquantised."""
    import torch
    from transformers.cache_utils import Cache, DynamicLayer

    part = TIERED["quantised"]

    class Layer(DynamicLayer):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

        def update(self, keys, values, cache_kwargs=None):
            if not self.is_initialized:
                self.lazy_initialization(keys, values)
                index = kept[self.index][0].unsqueeze(-1).unsqueeze(0).expand(1, -1, -1, keys.shape[-1])
                tiers = []
                for x in (keys, values):
                    chosen = torch.gather(x, 2, index)
                    tiers.append(torch.cat([chosen[:, :, :n_full], ref_qdq(part, chosen[:, :, n_full:])], dim=2))
                self.keys, self.values = tiers
                return keys, values
            self.keys = torch.cat([self.keys, ref_qdq(part, keys)], dim=-2)
            self.values = torch.cat([self.values, ref_qdq(part, values)], dim=-2)
            return self.keys, self.values

    return Cache(layers=[Layer(i) for i in range(model.config.num_hidden_layers)])


def test_tiered_lane_keeps_the_highest_scored_at_full_precision(embedded, float64_model):
    """SnapKV × a tiered format (the 0.2 of the context SnapKV scores highest at full precision, the
    rest it keeps as 4-bit integers, the others evicted), decoded as the engine's lane: its tokens
    and log p equal a float64 dequantise-then-attend run over those tiers, and its bytes are the
    tiers' counted by hand (the same press with every kept entry quantised is cheaper)."""
    import torch

    from certkv.core.kv_cost import kv_cost
    from certkv.engine.engine import Engine, PressCandidate
    from certkv.engine.full_cache import prefill_full
    from certkv.kv_formats.spec import parse_format
    from certkv.model.generation import encode_request
    from certkv.presses.registry import build_press
    from certkv.requests.request_set import generate_requests

    model, tokenizer = embedded
    press = build_press("snapkv", 0.6, {})
    candidates = [PressCandidate("tiered", press, "snapkv", 0.6, kv_format=parse_format(TIERED)),
                  PressCandidate("int4", press, "snapkv", 0.6, kv_format=parse_format(TIERED["quantised"]))]
    engine = Engine(model, tokenizer, candidates, max_new_tokens=N_NEW)
    share = (4 + 16 / 16) / 16
    same = 0
    requests = generate_requests("all", 4, seed=11, context_length="200-320")
    for req in requests:
        enc = encode_request(tokenizer, req.context, req.question)
        tiered, all_quantised = engine.run(req.context, req.question).candidates
        n_ctx, n_q = len(enc.context_ids), len(enc.question_ids)
        _, kept, _ = prefill_full(model, enc.context_ids, {"snapkv": press})
        n_kept, n_full = kept["snapkv"][0].shape[-1], int(0.2 * n_ctx)
        assert n_kept == int(0.6 * n_ctx) and 0 < n_full < n_kept
        steps = len(tiered.token_ids)
        units = [n_full + (n_kept + n_q + t - n_full) * share for t in range(steps)]
        cost = kv_cost(units, n_ctx, n_q)
        assert (tiered.kv_peak_bytes, tiered.kv_time_bytes) == pytest.approx((cost.peak, cost.time), rel=1e-12)
        assert all_quantised.kv_peak_bytes < tiered.kv_peak_bytes < tiered.kv_peak
        cache = _tiered_reference_cache(float64_model, kept["snapkv"], n_full)
        with torch.no_grad():
            float64_model.model(input_ids=torch.tensor([enc.context_ids]), past_key_values=cache)
            out = float64_model(input_ids=torch.tensor([enc.question_ids]), past_key_values=cache,
                                position_ids=torch.arange(n_ctx, n_ctx + n_q).unsqueeze(0))
            rows = [out.logits[0, -1]]
            for i, token in enumerate(tiered.token_ids[:-1]):
                out = float64_model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                                    position_ids=torch.tensor([[n_ctx + n_q + i]]))
                rows.append(out.logits[0, -1])
        want = torch.stack(rows)
        if want.argmax(dim=-1).tolist() == tiered.token_ids:
            same += 1
            chosen = torch.log_softmax(want, dim=-1)[torch.arange(steps), tiered.token_ids]
            assert torch.allclose(torch.tensor(tiered.logprobs, dtype=torch.float64), chosen, atol=LOGIT_TOL), req.id
    assert same >= len(requests) - 1, same
