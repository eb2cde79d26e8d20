"""certkv's cheaper SnapKV scoring equals kvpress's SnapKVPress.score bit for bit."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _check(model, input_ids, settings):
    from kvpress import SnapKVPress
    from transformers import DynamicCache

    from certkv.engine.snapkv_scores import snapkv_scores

    compared = []

    def hook(module, args, kwargs, output):
        keys = kwargs["past_key_values"].layers[module.layer_idx].keys
        for window, kernel in settings:
            ref = SnapKVPress(window_size=window, kernel_size=kernel).score(
                module, kwargs["hidden_states"], keys, None, None, kwargs
            )
            ours = snapkv_scores(module, kwargs["hidden_states"], keys, window, kernel, kwargs["position_embeddings"])
            compared.append(torch.equal(ref, ours))
        return output

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model.model(input_ids=input_ids, past_key_values=DynamicCache())
    finally:
        for handle in handles:
            handle.remove()
    assert compared and all(compared)


def test_equal_to_kvpress_on_the_embedded_model(embedded):
    from certkv.model.generation import encode_request
    from certkv.requests.request_set import generate_requests

    model, tok = embedded
    for request in generate_requests("demo", 3, seed=11, context_length=(100, 400)):
        ids = torch.tensor([encode_request(tok, request.context, request.question).context_ids])
        _check(model, ids, [(64, 5), (16, 3), (32, 7)])


def test_equal_to_kvpress_on_a_gqa_llama_with_more_heads():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    _check(model, torch.randint(0, 100, (1, 300)), [(64, 5), (8, 1)])


def test_short_context_is_a_clear_error(embedded):
    from certkv.engine.snapkv_scores import snapkv_scores

    model, _ = embedded
    module = model.model.layers[0].self_attn
    with pytest.raises(ValueError, match="must exceed the window size"):
        snapkv_scores(module, torch.zeros(1, 10, model.config.hidden_size), torch.zeros(1, 2, 10, 32), 64, 5, None)
