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

    from certkv.gate.agreement import window_attention

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


def test_window_attention_equals_eager_and_drop_equals_direct(tiny_llama):
    from certkv.gate.agreement import AgreementRecorder, agreement_drop, layer_agreement

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

    from certkv.gate.agreement import AgreementRecorder

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
    from certkv.gate.agreement import layer_agreement

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
    from certkv.gate.agreement import agreement_drop, layer_split

    assert layer_split(1) == (range(0, 1), range(0, 1))
    assert layer_split(2) == (range(0, 1), range(1, 2))
    assert layer_split(3) == (range(0, 1), range(2, 3))
    assert layer_split(7) == (range(0, 2), range(5, 7))
    assert agreement_drop([0.4]) == 0.0
    assert agreement_drop([0.9, 0.5]) == pytest.approx(0.4)
    assert agreement_drop([0.9, 0.0, 0.5]) == pytest.approx(0.4)
    assert agreement_drop([1.0, 0.8, 0.0, 0.0, 0.0, 0.2, 0.4]) == pytest.approx(0.9 - 0.3)


def test_bad_settings_raise_value_error():
    from certkv.gate.agreement import AgreementRecorder, agreement_drop, layer_agreement

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
