"""Agreement drop: the windowed computation equals a direct one from eager attention probabilities."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attn_implementation="eager",
    )
    return LlamaForCausalLM(config).eval()


def _prefill_with_hooks(model, recorder, n_tokens=80):
    """One eager prefill; returns (per-layer eager attentions, per-layer window attentions)."""
    from kvpress.utils import extract_keys_and_values
    from transformers import DynamicCache

    from certkv.model.window_attention import window_attention

    eager, windowed = {}, {}

    def hook(module, args, kwargs, output):
        keys, _ = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        recorder.observe(module, kwargs["hidden_states"], keys, kwargs)
        eager[module.layer_idx] = output[1]
        windowed[module.layer_idx] = window_attention(
            module, kwargs["hidden_states"], keys, kwargs["position_embeddings"], recorder.window
        )
        return output

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        ids = torch.randint(0, 100, (1, n_tokens), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            model.model(input_ids=ids, past_key_values=DynamicCache(), output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    return [eager[i] for i in sorted(eager)], [windowed[i] for i in sorted(windowed)]



def layer_agreement(weights, top_k: int) -> float:
    """One request's layer agreement as a float (certkv.signals.agreement.layer_agreements of batch size 1)."""
    from certkv.signals.agreement import layer_agreements

    if weights.shape[0] != 1:
        raise ValueError(f"layer_agreement takes one request; got batch size {weights.shape[0]} (use layer_agreements)")
    return float(layer_agreements(weights, top_k)[0])

def test_window_attention_equals_eager_and_drop_equals_direct(tiny_llama):
    from certkv.signals.agreement import AgreementRecorder, agreement_drop

    recorder = AgreementRecorder()
    assert (recorder.window, recorder.top_k, recorder.split_divisor) == (32, 32, 3)
    eager, windowed = _prefill_with_hooks(tiny_llama, recorder)
    assert len(eager) == 3
    for e, w in zip(eager, windowed):
        assert w.shape == (1, 4, 32, 80)
        torch.testing.assert_close(w, e[:, :, -32:, :].float(), atol=1e-5, rtol=0)
    direct = [layer_agreement(e[:, :, -32:, :], 32) for e in eager]
    assert recorder.per_layer()[0] == pytest.approx(direct, abs=1e-6)
    assert recorder.drop() == pytest.approx(agreement_drop(direct), abs=1e-6)
    assert recorder.drop() == pytest.approx(direct[0] - direct[2], abs=1e-6)


def test_attach_observes_prefill_only(tiny_llama):
    from transformers import DynamicCache

    from certkv.signals.agreement import AgreementRecorder

    recorder = AgreementRecorder(window=8, top_k=4)
    before = [len(layer.self_attn._forward_hooks) for layer in tiny_llama.model.layers]
    cache = DynamicCache()
    with torch.no_grad(), recorder.attach(tiny_llama):
        tiny_llama.model(input_ids=torch.arange(20).view(1, -1), past_key_values=cache)
        first = recorder.per_layer()
        # a decoding step must not overwrite the prefill's signal
        tiny_llama.model(input_ids=torch.tensor([[5]]), past_key_values=cache, position_ids=torch.tensor([[20]]))
    assert recorder.per_layer() == first
    assert all(0.0 <= a <= 1.0 for a in first[0])
    assert [len(layer.self_attn._forward_hooks) for layer in tiny_llama.model.layers] == before


def test_jaccard_identical_and_disjoint_sets():
    k_len, k = 12, 4
    same = torch.zeros(1, 3, 2, k_len)
    same[..., :k] = 1.0  # every head's top-4 is {0, 1, 2, 3}
    assert layer_agreement(same.softmax(-1), k) == pytest.approx(1.0)

    disjoint = torch.zeros(1, 3, 2, k_len)
    for h in range(3):
        disjoint[:, h, :, h * k : (h + 1) * k] = 5.0
    assert layer_agreement(disjoint.softmax(-1), k) == pytest.approx(0.0)

    # two of three heads agree: pairs (0,1)=1, (0,2)=0, (1,2)=0
    mixed = disjoint.clone()
    mixed[:, 1] = disjoint[:, 0]
    assert layer_agreement(mixed.softmax(-1), k) == pytest.approx(1 / 3)

    # top_k larger than the number of keys: every head takes all keys
    assert layer_agreement(torch.rand(1, 4, 3, 5).softmax(-1), 32) == pytest.approx(1.0)
    # a single head agrees with itself
    assert layer_agreement(torch.rand(1, 1, 3, 5).softmax(-1), 2) == pytest.approx(1.0)


def test_layer_split():
    from certkv.signals.agreement import agreement_drop, layer_split

    assert layer_split(1) == (range(0, 1), range(0, 1))
    assert layer_split(2) == (range(0, 1), range(1, 2))
    assert layer_split(3) == (range(0, 1), range(2, 3))
    assert layer_split(7) == (range(0, 2), range(5, 7))
    assert agreement_drop([0.4]) == 0.0
    assert agreement_drop([0.9, 0.5]) == pytest.approx(0.4)
    assert agreement_drop([0.9, 0.0, 0.5]) == pytest.approx(0.4)
    assert agreement_drop([1.0, 0.8, 0.0, 0.0, 0.0, 0.2, 0.4]) == pytest.approx(0.9 - 0.3)


def test_bad_settings_raise_value_error():
    from certkv.signals.agreement import AgreementRecorder, agreement_drop

    with pytest.raises(ValueError, match="window"):
        AgreementRecorder(window=0)
    with pytest.raises(ValueError, match="top_k"):
        AgreementRecorder(top_k=-1)
    with pytest.raises(ValueError, match="at least one layer"):
        agreement_drop([])
    with pytest.raises(ValueError, match="one request"):
        layer_agreement(torch.rand(2, 2, 3, 5), 2)
    with pytest.raises(ValueError, match="no layer"):
        AgreementRecorder().drop()


def test_captured_window_queries_are_the_recomputed_ones_and_change_nothing_else(embedded):
    """Inside capturing_window_queries the window attention uses the layer's own post-RoPE queries:
    on CPU the very bits that recomputing them gives, and the prefill's cache is unchanged."""
    from contextlib import nullcontext

    from transformers import DynamicCache

    from certkv.model.layers import attention_modules
    from certkv.model.window_attention import window_attention
    from certkv.model.window_queries import WIDTH, captured_queries, capturing_window_queries

    model, _ = embedded
    modules = attention_modules(model)
    ids = torch.randint(5, 100, (1, 150), generator=torch.Generator().manual_seed(3))
    seen = {}

    def hook(module, args, kwargs, output):
        keys = kwargs["past_key_values"].layers[module.layer_idx].keys
        hidden = kwargs["hidden_states"]
        captured = captured_queries(module, hidden.shape[1], 32)
        used = window_attention(module, hidden, keys, kwargs["position_embeddings"], 32)
        stash = module.__dict__.pop("_certkv_window_queries", None)  # recompute for the reference
        recomputed = window_attention(module, hidden, keys, kwargs["position_embeddings"], 32)
        if stash is not None:
            module.__dict__["_certkv_window_queries"] = stash
        seen[module.layer_idx] = (captured, used, recomputed,
                                  captured_queries(module, hidden.shape[1], WIDTH + 1),
                                  captured_queries(module, hidden.shape[1] + 1, 32))
        return output

    def prefill(capture: bool):
        cache = DynamicCache()
        handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
        try:
            with torch.no_grad(), (capturing_window_queries(model) if capture else nullcontext()):
                model.model(input_ids=ids, past_key_values=cache)
        finally:
            for h in handles:
                h.remove()
        return cache, dict(seen)

    implementation = model.config._attn_implementation
    plain_cache, plain = prefill(False)
    cache, captured = prefill(True)
    assert model.config._attn_implementation == implementation
    assert all(captured_queries(m, 150, 32) is None for m in modules), "captures must not outlive the block"
    for layer in range(len(modules)):
        assert plain[layer][0] is None  # nothing captured outside the block
        queries, used, recomputed, too_wide, other_length = captured[layer]
        assert queries is not None and queries.shape == (1, model.config.num_attention_heads, 32, model.config.head_dim)
        assert too_wide is None and other_length is None
        assert torch.equal(used, recomputed)
        assert torch.equal(cache.layers[layer].keys, plain_cache.layers[layer].keys)
        assert torch.equal(cache.layers[layer].values, plain_cache.layers[layer].values)


def test_capturing_is_a_no_op_for_eager_attention(tiny_llama):
    from transformers import DynamicCache

    from certkv.model.window_queries import captured_queries, capturing_window_queries

    with torch.no_grad(), capturing_window_queries(tiny_llama):
        assert tiny_llama.config._attn_implementation == "eager"
        tiny_llama.model(input_ids=torch.arange(5, 45).view(1, -1), past_key_values=DynamicCache())
    assert all(captured_queries(layer.self_attn, 40, 32) is None for layer in tiny_llama.model.layers)


def test_gate_and_press_share_one_window_attention_per_layer_and_prefill(tiny_llama):
    """The recorder and the probabilistic press's score read one window-attention mean per layer:
    computed once per prefill (counted) and never carried to the next."""
    from unittest import mock

    from transformers import DynamicCache

    import certkv.model.window_attention as window_attention_module
    from certkv.engine.probabilistic_decode import selection_hooks
    from certkv.presses.probabilistic import ProbabilisticPress
    from certkv.signals.agreement import AgreementRecorder

    recorder = AgreementRecorder()
    presses = {"a": ProbabilisticPress(compression_ratio=0.5), "b": ProbabilisticPress(compression_ratio=0.3, seed=1)}
    calls = []
    direct = window_attention_module.window_attention

    def counted(module, *args):
        calls.append(module.layer_idx)
        return direct(module, *args)

    with mock.patch.object(window_attention_module, "window_attention", counted):
        for n_tokens in (60, 61):
            selections: dict = {}
            with torch.no_grad(), recorder.attach(tiny_llama), selection_hooks(tiny_llama, presses, selections):
                tiny_llama.model(input_ids=torch.arange(5, 5 + n_tokens).view(1, -1), past_key_values=DynamicCache())
            assert all(len(v) == 3 for v in selections.values())
            assert all(s.shape[-1] == n_tokens for s in recorder.scores.values())
    assert calls == [0, 1, 2] * 2  # three readers per layer, one computation per layer and prefill
    from certkv.model.layers import attention_modules

    memo = window_attention_module._MEMO_ATTR
    assert all(memo not in m.__dict__ for m in attention_modules(tiny_llama)), "forgotten after the block"
