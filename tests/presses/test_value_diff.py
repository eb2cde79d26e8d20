"""ValueDiff press: its scores equal a brute-force computation, and certkv's fast path answers
with it exactly as kvpress's own pipeline does."""

from __future__ import annotations

import pytest
import torch


def _prefill_scores(model, press, ids):
    """The press's scores per layer, called as kvpress's hook calls score() during a prefill."""
    from kvpress.utils import extract_keys_and_values
    from transformers import DynamicCache

    from certkv.model.layers import attention_modules

    scores, handles = [], []

    def hook(module, args, kwargs, output):
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        scores.append(press.score(module, kwargs["hidden_states"], keys, values, output[1], kwargs))
        return output

    for module in attention_modules(model):
        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    cache = DynamicCache()
    try:
        with torch.no_grad():
            out = model.model(input_ids=ids, past_key_values=cache, output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    return scores, cache, out.attentions


def test_scores_equal_a_brute_force_computation(embedded):
    """Attention of the last W queries (eager weights of the whole prefill), averaged over the
    window and the GQA group, times the distance of each value from the mean of the others, each
    entry on its own; the window's entries above every other."""
    from certkv.model.generation import encode_request
    from certkv.model.loading import load_model
    from certkv.presses.value_diff import ValueDiffPress
    from certkv.requests.request_set import generate_requests

    model, tokenizer = load_model("embedded", device="cpu", attn_implementation="eager")
    window = 16
    press = ValueDiffPress(compression_ratio=0.5, window_size=window)
    req = generate_requests("demo", 1, seed=3, context_length=300)[0]
    ids = torch.tensor([encode_request(tokenizer, req.context, req.question).context_ids])
    scores, cache, attentions = _prefill_scores(model, press, ids)
    n = ids.shape[1]
    for layer, got in enumerate(scores):
        weights = attentions[layer][0, :, -window:, :].double()  # (H, W, n)
        values = cache.layers[layer].values[0].double()  # (H_kv, n, d)
        kv_heads = values.shape[0]
        groups = weights.shape[0] // kv_heads
        want = torch.empty(kv_heads, n, dtype=torch.float64)
        for h in range(kv_heads):
            attention = weights[h * groups : (h + 1) * groups].mean(dim=(0, 1))
            for j in range(n):
                others = torch.cat([values[h, :j], values[h, j + 1 :]]).mean(dim=0)
                want[h, j] = attention[j] * torch.linalg.vector_norm(values[h, j] - others)
        got = got[0].double()
        assert torch.allclose(got[:, : n - window], want[:, : n - window], rtol=1e-4, atol=1e-7), layer
        assert (got[:, n - window :] > got[:, : n - window].max()).all()


@pytest.fixture(scope="module")
def pipe(embedded):
    import kvpress  # noqa: F401  (registers the pipeline)
    from transformers import pipeline

    model, tokenizer = embedded
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")


def test_fast_path_answers_equal_kvpress_pipeline(embedded, pipe):
    from certkv.engine.engine import Engine, PressCandidate
    from certkv.presses.registry import build_press
    from certkv.requests.request_set import generate_requests

    model, tokenizer = embedded
    candidates = [PressCandidate(f"value_diff@{kv:.2f}", build_press("value_diff", kv), "value_diff", kv) for kv in (0.5, 0.2)]
    engine = Engine(model, tokenizer, candidates, max_new_tokens=8)
    assert engine.fast == candidates, "a plain ScorerPress takes the fast path"
    differ = 0
    for req in generate_requests("all", 6, seed=17, context_length="200-400"):
        result = engine.run(req.context, req.question)
        for cand, got in zip(candidates, result.candidates):
            want = pipe(req.context, question=req.question, press=cand.press, max_new_tokens=8)["answer"]
            assert got.answer == want, (req.id, cand.policy)
            differ += got.answer != result.full.answer
    assert differ > 0, "no answer changed under eviction: the comparison proves little"
