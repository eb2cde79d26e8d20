"""Probabilistic press and Hájek attention: probabilities, selection layout, exactness at π = 1,
certificates, and the estimator's sanity on small synthetic inputs and a tiny random Llama."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")


# ---------------------------------------------------------------------------------------------
# inclusion probabilities
# ---------------------------------------------------------------------------------------------



def inclusion_probabilities(scores, budget):
    """certkv's capped proportional inclusion probabilities (poisson_selection._capped_proportional) on
    any scores: checked, in float64, with `budget` a number or a tensor broadcastable to the rows."""
    import torch

    from certkv.presses.poisson_selection import _capped_proportional

    if scores.dim() < 1:
        raise ValueError("scores must have at least one dimension (the entries)")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("scores must be finite to give inclusion probabilities")
    if bool((scores < 0).any()):
        raise ValueError("scores must be nonnegative to give inclusion probabilities")
    out_dtype = torch.promote_types(scores.dtype, torch.float32)
    s = scores.to(torch.float64)
    n = s.shape[-1]
    if n == 0:
        return s.to(out_dtype)
    b = torch.as_tensor(budget, dtype=torch.float64, device=s.device).expand(s.shape[:-1]).clamp(0, n)
    return _capped_proportional(s, b).to(out_dtype)

def test_inclusion_probabilities_sum_range_monotone():

    g = torch.Generator().manual_seed(0)
    scores = torch.rand(3, 50, generator=g) ** 4 * 10  # skewed: the top entries get capped
    for budget in (1, 5, 17.5, 40, 49):
        pi = inclusion_probabilities(scores, budget)
        torch.testing.assert_close(pi.sum(-1), torch.full((3,), float(budget)), atol=1e-4, rtol=0)
        assert bool((pi > 0).all()) and bool((pi <= 1).all())
        for row_scores, row_pi in zip(scores, pi):
            ranked = row_pi[row_scores.argsort()]
            assert bool((ranked[1:] >= ranked[:-1] - 1e-7).all())
    assert bool((inclusion_probabilities(scores, 40) == 1).any())  # capping happened
    assert bool((inclusion_probabilities(scores, 50) == 1).all())
    assert bool((inclusion_probabilities(scores, 80) == 1).all())
    assert bool((inclusion_probabilities(scores, 0) == 0).all())
    # proportional when nothing is capped
    flat = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    torch.testing.assert_close(inclusion_probabilities(flat, 1), flat / 10)
    # per-row budgets
    pi = inclusion_probabilities(scores, torch.tensor([2.0, 10.0, 30.0]))
    torch.testing.assert_close(pi.sum(-1), torch.tensor([2.0, 10.0, 30.0]), atol=1e-4, rtol=0)


def _capped_round_by_round(s, b):
    """The definition, executed literally: cap every entry whose proportional share reaches 1,
    re-spread the rest of the budget over the others, repeat until nothing new is capped (the
    uniform spread when only zero scores are left free). The reference for the closed form."""
    pi = torch.zeros_like(s)
    for row in range(s.shape[0]):
        capped = torch.zeros(s.shape[1], dtype=torch.bool)
        while True:
            remaining = max(float(b[row]) - int(capped.sum()), 0.0)
            free_sum = float(s[row][~capped].sum())
            if free_sum > 0:
                share = s[row] * remaining / free_sum
            else:
                share = torch.full_like(s[row], remaining / max(int((~capped).sum()), 1))
            share[capped] = 1.0
            newly = (share >= 1) & ~capped
            if not bool(newly.any()):
                break
            capped |= newly
        pi[row] = share.clamp(0, 1)
    return pi


def test_closed_form_capping_equals_capping_round_by_round():
    from certkv.presses.poisson_selection import _capped_proportional

    g = torch.Generator().manual_seed(11)
    for trial in range(120):
        n = int(torch.randint(1, 30, (1,), generator=g))
        s = torch.rand(3, n, generator=g, dtype=torch.float64) ** float(torch.randint(1, 12, (1,), generator=g))
        if trial % 4 == 1:
            s[s < 0.3] = 0  # zero scores: some rows need the uniform spread
        if trial % 4 == 2:
            s = torch.round(s * 4) / 4  # ties, and all-zero rows
        b = torch.rand(3, generator=g, dtype=torch.float64) * n
        if trial % 4 == 3:
            b = torch.floor(b)  # whole budgets: shares of exactly 1
        torch.testing.assert_close(_capped_proportional(s, b), _capped_round_by_round(s, b), atol=1e-12, rtol=0)


def test_inclusion_probabilities_zero_scores_and_bad_input():

    s = torch.tensor([[0.0, 0.0, 1.0, 3.0]])
    torch.testing.assert_close(inclusion_probabilities(s, 1), torch.tensor([[0.0, 0.0, 0.25, 0.75]]))
    # the positive scores cannot absorb a budget of 3: the rest goes to the zero-score entries
    torch.testing.assert_close(inclusion_probabilities(s, 3), torch.tensor([[0.5, 0.5, 1.0, 1.0]]))
    torch.testing.assert_close(inclusion_probabilities(torch.zeros(1, 4), 2), torch.full((1, 4), 0.5))
    with pytest.raises(ValueError, match="nonnegative"):
        inclusion_probabilities(torch.tensor([1.0, -1.0]), 1)
    with pytest.raises(ValueError, match="finite"):
        inclusion_probabilities(torch.tensor([1.0, float("nan")]), 1)


# ---------------------------------------------------------------------------------------------
# selection layout and realised retention
# ---------------------------------------------------------------------------------------------


def _selection(scores, n_kept, seed, **kw):
    from certkv.presses.poisson_selection import probabilistic_selection

    return probabilistic_selection(scores, n_kept, generator=torch.Generator().manual_seed(seed), **kw)


def test_selection_layout():
    from certkv.presses.poisson_selection import head_priority

    scores = torch.rand(2, 3, 120, generator=torch.Generator().manual_seed(1)) - 0.2  # some negative
    sel = _selection(scores, 48, seed=3, n_sink=4, window=16, head_share=0.5)
    assert sel.n_head == 20 + 14
    batch, heads, width = sel.indices.shape
    assert width == int(sel.counts.max()) and width > sel.n_head
    assert torch.equal(sel.valid.sum(-1), sel.counts)
    assert bool((sel.counts < width).any())  # variable counts: some heads padded
    assert torch.equal(sel.indices[..., : sel.n_head], head_priority(scores, 4, 16).topk(sel.n_head).indices)
    assert bool((sel.log_pi[..., : sel.n_head] == 0).all())
    assert bool((sel.log_pi[..., sel.n_head :][sel.valid[..., sel.n_head :]] < 0).any())
    assert bool((sel.log_pi[~sel.valid] == 0).all())
    for b in range(batch):
        for h in range(heads):
            idx = sel.indices[b, h].tolist()
            assert len(set(idx)) == len(idx)  # padding points at distinct unsampled entries
            kept = set(sel.indices[b, h][sel.valid[b, h]].tolist())
            assert set(range(4)) | set(range(104, 120)) <= kept
            tail = sel.indices[b, h, sel.n_head :][sel.valid[b, h, sel.n_head :]]
            assert torch.equal(tail, tail.sort().values)
    # same seed, same selection; head_share=1 keeps exactly the deterministic top-k
    again = _selection(scores, 48, seed=3, n_sink=4, window=16, head_share=0.5)
    assert torch.equal(again.indices, sel.indices) and torch.equal(again.valid, sel.valid)
    det = _selection(scores, 48, seed=3, head_share=1.0)
    assert det.n_head == 48 and bool(det.valid.all()) and bool((det.log_pi == 0).all())
    assert torch.equal(det.indices, head_priority(scores, 4, 16).topk(48).indices)


@pytest.mark.parametrize("batch", [1, 3])
def test_select_layers_equals_each_layer_selected_alone(batch):
    """Several layers selected in one call: each layer's entries, log π and counts are those of
    its own selection with its own generator (padding aside), for any batch size."""
    from certkv.presses.poisson_selection import probabilistic_selection
    from certkv.presses.probabilistic import ProbabilisticPress

    press = ProbabilisticPress(compression_ratio=0.6, head_share=0.3, seed=5)
    g = torch.Generator().manual_seed(4)
    scores = [torch.rand(batch, 2, 90, generator=g) ** 3 for _ in range(3)]
    joint = press.select_layers([0, 1, 2], scores)
    for layer, (together, s) in enumerate(zip(joint, scores)):
        alone = probabilistic_selection(s, 36, n_sink=4, window=16, head_share=0.3, generator=press.generator(layer))
        n = alone.indices.shape[-1]
        assert together.indices.shape[0] == batch and together.indices.shape[-1] >= n
        assert torch.equal(together.counts, alone.counts) and together.n_head == alone.n_head
        assert torch.equal(together.valid[..., :n], alone.valid) and not bool(together.valid[..., n:].any())
        assert torch.equal(together.log_pi[..., :n], alone.log_pi)
        assert torch.equal(together.indices[..., :n][alone.valid], alone.indices[alone.valid])
    with pytest.raises(ValueError, match="one score tensor per layer"):
        press.select_layers([0, 1], scores)


def test_pad_selection_and_widened_state():
    from certkv.presses.hajek_state import HajekState
    from certkv.presses.poisson_selection import pad_selection

    sel = _selection(torch.rand(1, 2, 50, generator=torch.Generator().manual_seed(8)), 20, seed=1, head_share=0.2)
    wide = pad_selection(sel, sel.indices.shape[-1] + 3)
    assert wide.indices.shape[-1] == sel.indices.shape[-1] + 3
    assert torch.equal(wide.valid.sum(-1), sel.counts) and torch.equal(wide.counts, sel.counts)
    state = HajekState.from_selection(sel, 50).widened(wide.indices.shape[-1])
    assert torch.equal(state.valid, wide.valid) and torch.equal(state.log_pi, wide.log_pi)
    assert bool((state.bias[..., -3:] == float("-inf")).all()) and bool((state.tail_weight[..., -3:] == 0).all())
    with pytest.raises(ValueError, match="pad"):
        pad_selection(sel, 1)


def test_realised_fraction_averages_to_target():
    scores = torch.rand(1, 4, 300, generator=torch.Generator().manual_seed(2)) ** 2
    for n_kept, head_share in ((90, 0.5), (150, 0.0), (60, 0.25)):
        fractions = [float(_selection(scores, n_kept, seed=s, head_share=head_share).counts.float().mean()) / 300
                     for s in range(40)]
        assert sum(fractions) / len(fractions) == pytest.approx(n_kept / 300, abs=0.01)
        assert len(set(fractions)) > 1  # it does vary per draw


# ---------------------------------------------------------------------------------------------
# the attention function against an explicit per-head computation
# ---------------------------------------------------------------------------------------------


def _fake_module(state, groups):
    from certkv.presses.hajek_state import set_state

    module = SimpleNamespace(layer_idx=0, num_key_value_groups=groups, is_causal=True, training=False)
    set_state(module, state)
    return module


def test_hajek_attention_matches_explicit_computation():
    from certkv.presses.hajek_attention import hajek_attention, layer_certificates
    from certkv.presses.hajek_state import HajekState

    g = torch.Generator().manual_seed(4)
    batch, kv_heads, groups, d, ctx, new = 2, 2, 2, 4, 40, 3
    sel = _selection(torch.rand(batch, kv_heads, ctx, generator=g), 20, seed=5, n_sink=2, window=4, head_share=0.3)
    state = HajekState.from_selection(sel, ctx)
    assert not state.trivial
    n = state.n_slots
    full_k = torch.randn(batch, kv_heads, ctx, d, generator=g)
    full_v = torch.randn(batch, kv_heads, ctx, d, generator=g)
    gather = sel.indices.unsqueeze(-1).expand(-1, -1, -1, d)
    keys = torch.cat([full_k.gather(2, gather), torch.randn(batch, kv_heads, new, d, generator=g)], dim=2)
    values = torch.cat([full_v.gather(2, gather), torch.randn(batch, kv_heads, new, d, generator=g)], dim=2)
    scale = d**-0.5
    pi = sel.log_pi.exp()

    for q_len, mask in ((new, "bool"), (new, "float"), (new, None), (1, None), (1, "bool")):
        keys_q, values_q = keys[:, :, : n + q_len], values[:, :, : n + q_len]
        kl = n + q_len
        query = torch.randn(batch, kv_heads * groups, q_len, d, generator=g)
        allowed = torch.arange(kl).unsqueeze(0) <= (kl - q_len + torch.arange(q_len)).unsqueeze(1)
        attention_mask = None
        if mask == "bool":
            attention_mask = allowed.expand(batch, 1, q_len, kl)
        elif mask == "float":  # transformers' additive form
            attention_mask = torch.where(allowed, 0.0, float("-inf")).expand(batch, 1, q_len, kl)
        module = _fake_module(state, groups)
        out, _ = hajek_attention(module, query, keys_q, values_q, attention_mask, scaling=scale)
        assert out.shape == (batch, q_len, kv_heads * groups, d)
        cert = layer_certificates(module)[-1]
        assert cert.shape == (batch, kv_heads, q_len)
        for b in range(batch):
            for h in range(kv_heads):
                slots = [i for i in range(n) if sel.valid[b, h, i]] + list(range(n, kl))
                correction = torch.tensor([-math.log(pi[b, h, i]) if i < n else 0.0 for i in slots])
                tail = [j for j, i in enumerate(slots) if sel.n_head <= i < n]
                for qh in range(groups):
                    head = h * groups + qh
                    for t in range(q_len):
                        visible = [j for j, i in enumerate(slots) if allowed[t, i]]
                        logits = keys_q[b, h, slots] @ query[b, head, t] * scale + correction
                        w = torch.zeros(len(slots))
                        w[visible] = torch.softmax(logits[visible], dim=0)
                        o = w @ values_q[b, h, slots]
                        torch.testing.assert_close(out[b, t, head], o, atol=1e-5, rtol=1e-5)
                for t in range(q_len):
                    per_head = []
                    for qh in range(groups):
                        head = h * groups + qh
                        visible = [j for j, i in enumerate(slots) if allowed[t, i]]
                        logits = keys_q[b, h, slots] @ query[b, head, t] * scale + correction
                        w = torch.zeros(len(slots))
                        w[visible] = torch.softmax(logits[visible], dim=0)
                        o = w @ values_q[b, h, slots]
                        terms = [(1 - pi[b, h, slots[j]]) * w[j] ** 2 * (values_q[b, h, slots[j]] - o).square().sum()
                                 for j in tail]
                        per_head.append(torch.stack(terms).sum().sqrt())
                    torch.testing.assert_close(cert[b, h, t], max(per_head), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("pending_steps, pending_bytes", [(64, 8 * 2**20), (2, 8 * 2**20), (64, 1)])
def test_certificates_reduced_together_equal_each_step_reduced_alone(pending_steps, pending_bytes, monkeypatch):
    """Steps keep their tail weights and output and are reduced when read (or when too many wait,
    or their weights hold too much memory), consecutive same-shape steps in one batch: the values
    must equal each step's certificate computed on its own."""
    from certkv.presses import hajek_attention as module_under_test
    from certkv.presses.hajek_attention import (
        CertificateTerms,
        certificate,
        corrected_attention,
        hajek_attention,
        layer_certificates,
    )
    from certkv.presses.hajek_state import HajekState

    monkeypatch.setattr(module_under_test, "PENDING_STEPS", pending_steps)
    monkeypatch.setattr(module_under_test, "PENDING_BYTES", pending_bytes)

    g = torch.Generator().manual_seed(9)
    batch, kv_heads, groups, d, ctx = 2, 2, 3, 8, 48
    sel = _selection(torch.rand(batch, kv_heads, ctx, generator=g), 24, seed=3, n_sink=2, window=4, head_share=0.25)
    state = HajekState.from_selection(sel, ctx)
    module = _fake_module(state, groups)
    keys = torch.randn(batch, kv_heads, state.n_slots + 10, d, generator=g)
    values = torch.randn(batch, kv_heads, state.n_slots + 10, d, generator=g)
    expected = []
    k_len = state.n_slots
    for q_len in (3, 1, 1, 1, 2, 1, 1):  # question feed, decoded tokens, a two-token proposal, ...
        k_len += q_len
        query = torch.randn(batch, kv_heads * groups, q_len, d, generator=g)
        k, v = keys[:, :, :k_len], values[:, :, :k_len]
        out, weights = corrected_attention(query, k, v, None, d**-0.5, state)
        alone = certificate(weights, out, v, state).view(batch, kv_heads, groups, q_len).amax(dim=2)
        expected.append(alone)
        hajek_attention(module, query, k, v, None, scaling=d**-0.5)
        if q_len == 2:  # a read in the middle settles the steps so far; later ones stay pending
            assert len(layer_certificates(module)) == len(expected)
    waiting = sum(isinstance(step, CertificateTerms) for step in module.certkv_certificates)
    assert waiting == (2 if pending_steps == 64 and pending_bytes > 1 else 0)  # the last read, or a cap, settled the rest
    got = layer_certificates(module)
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert a.shape == b.shape == (batch, kv_heads, b.shape[-1])
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), step
        assert (a > 0).any(), "a sampled tail must give positive certificates"


def test_hajek_correction_is_closer_to_full_attention_than_uncorrected():
    """Sampling the tail ∝ weight and correcting by −log π estimates the full output; ignoring π
    over-weights the deterministic head. Synthetic logits: sinks carry much mass, the tail carries
    most, and the tail's values point elsewhere, so the uncorrected bias is large."""
    from certkv.presses.hajek_attention import hajek_attention, layer_certificates
    from certkv.presses.hajek_state import HajekState

    g = torch.Generator().manual_seed(6)
    k_len, d = 300, 8
    scale = d**-0.5
    logits = torch.randn(k_len, generator=g)
    logits[:4] = 3.0
    keys = torch.zeros(1, 1, k_len, d)
    keys[0, 0, :, 0] = logits / scale  # with query e_0 the logits are exactly `logits`
    query = torch.zeros(1, 1, 1, d)
    query[..., 0] = 1.0
    values = torch.randn(1, 1, k_len, d, generator=g)
    values[0, 0, :4, 0] += 3.0
    values[0, 0, 4:, 0] -= 1.0
    noisy = logits.exp() * torch.exp(0.3 * torch.randn(k_len, generator=g))  # an imperfect size measure
    errors_corrected, errors_plain, certs, outputs = [], [], [], []
    for seed in range(30):
        sel = _selection(noisy.view(1, 1, -1), 90, seed=seed, n_sink=4, window=16, head_share=0.5)
        gather = sel.indices.unsqueeze(-1).expand(-1, -1, -1, d)
        # decode step: the new token's own key (zero logit, zero value) follows the kept entries
        kk = torch.cat([keys.gather(2, gather), torch.zeros(1, 1, 1, d)], dim=2)
        vv = torch.cat([values.gather(2, gather), torch.zeros(1, 1, 1, d)], dim=2)
        ref = (torch.softmax(torch.cat([logits, torch.zeros(1)]), 0) @ torch.cat([values[0, 0], torch.zeros(1, d)]))
        state = HajekState.from_selection(sel, k_len)
        module = _fake_module(state, 1)
        corrected = hajek_attention(module, query, kk, vv, None, scaling=scale)[0].view(d)
        certs.append(float(layer_certificates(module)[-1].max()))
        plain_state = HajekState(torch.zeros_like(sel.log_pi), sel.valid, sel.counts, sel.n_head, k_len)
        plain = hajek_attention(_fake_module(plain_state, 1), query, kk, vv, None, scaling=scale)[0].view(d)
        errors_corrected.append(float((corrected - ref).norm()))
        errors_plain.append(float((plain - ref).norm()))
        outputs.append(corrected)
    mean_corrected = sum(errors_corrected) / len(errors_corrected)
    mean_plain = sum(errors_plain) / len(errors_plain)
    assert mean_corrected < 0.75 * mean_plain  # measured: 0.23 vs 0.45
    # the corrected output is nearly unbiased: its average over draws is close to the full output
    assert float((torch.stack(outputs).mean(0) - ref).norm()) < 0.25 * mean_plain  # measured: 0.045
    assert min(certs) > 0
    # the certificate is on the scale of the error it describes
    assert 0.2 < mean_corrected / (sum(certs) / len(certs)) < 5


# ---------------------------------------------------------------------------------------------
# tiny random Llama: exactness at π = 1, certificates, realised retention
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(7)
    context = torch.randint(0, 100, (1, 96), generator=g)
    question = torch.randint(0, 100, (5,), generator=g).tolist()
    return model, context, question


def _answer(model, context, question, press=None, hajek=False, new_tokens=5):
    """Prefill (under `press`), feed the question, decode greedily; returns (tokens, question logits)."""
    from contextlib import ExitStack

    from transformers import DynamicCache

    from certkv.model.generation import greedy_decode
    from certkv.presses.hajek_attention import use_hajek_attention
    from certkv.presses.hajek_state import CERT_ATTR, clear_states
    from certkv.presses.probabilistic import attention_modules

    clear_states(model)
    cache = DynamicCache()
    n_ctx = context.shape[1]
    with ExitStack() as stack, torch.no_grad():
        if hajek:
            stack.enter_context(use_hajek_attention(model))
        if press is not None:
            stack.enter_context(press(model))
        model.model(input_ids=context, past_key_values=cache)
        if press is not None:
            stack.pop_all().close()  # hooks off before decoding
            if hajek:
                stack.enter_context(use_hajek_attention(model))
        length = cache.get_seq_length()
        q = torch.tensor([question])
        positions = torch.arange(n_ctx, n_ctx + len(question)).unsqueeze(0)
        logits = model(input_ids=q, past_key_values=cache, position_ids=positions).logits
        cache.crop(length)
        for module in attention_modules(model):  # the prefill's certificates gone, the states kept
            if getattr(module, CERT_ATTR, None):
                setattr(module, CERT_ATTR, [])
        tokens = greedy_decode(model, cache, question, n_ctx, new_tokens)
    return tokens, logits


def test_all_pi_one_equals_deterministic_press(tiny):
    from certkv.presses.deterministic_head import DeterministicHeadPress
    from certkv.presses.hajek_attention import certificate_max, certificate_steps
    from certkv.presses.hajek_state import kept_fraction
    from certkv.presses.probabilistic import ProbabilisticPress

    model, context, question = tiny
    ref_tokens, ref_logits = _answer(model, context, question, DeterministicHeadPress(compression_ratio=0.5))
    press = ProbabilisticPress(compression_ratio=0.5, head_share=1.0, seed=3)
    tokens, logits = _answer(model, context, question, press, hajek=True)
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits)
    assert kept_fraction(model) == 0.5
    steps = certificate_steps(model)
    assert len(steps) == 1 and len(steps[0]) == 5  # question feed + 4 decoded tokens
    assert certificate_max(model) == 0.0


def test_engine_selects_all_layers_at_once_as_the_press_prunes_layer_by_layer(tiny):
    """selection_hooks scores each layer and selects after the last one (one batched selection per
    press); the press itself prunes layer by layer. Same kept entries, log π and counts per layer."""
    from transformers import DynamicCache

    from certkv.engine.probabilistic_decode import selection_hooks
    from certkv.presses.hajek_state import STATE_ATTR, clear_states
    from certkv.presses.probabilistic import ProbabilisticPress, attention_modules

    model, context, _ = tiny
    presses = {f"p{seed}": ProbabilisticPress(compression_ratio=0.6, head_share=0.25, seed=seed) for seed in range(3)}
    selections: dict = {}
    full = DynamicCache()
    with torch.no_grad(), selection_hooks(model, presses, selections):
        model.model(input_ids=context, past_key_values=full)
    for policy, press in presses.items():
        clear_states(model)
        cache = DynamicCache()
        with torch.no_grad(), press(model):
            model.model(input_ids=context, past_key_values=cache)
        assert len(selections[policy]) == 3
        for module, joint in zip(attention_modules(model), selections[policy]):
            state = getattr(module, STATE_ATTR)
            n = int(joint.counts.max())
            assert torch.equal(joint.counts, state.counts) and joint.n_head == state.n_head
            assert torch.equal(joint.valid[..., :n], state.valid[..., :n])
            assert torch.equal(joint.log_pi[..., :n], state.log_pi[..., :n])
            assert not bool(joint.valid[..., n:].any()) and not bool(state.valid[..., n:].any())
            full_keys = full.layers[module.layer_idx].keys
            index = joint.indices[..., :n].unsqueeze(-1).expand(-1, -1, -1, full_keys.shape[-1])
            pruned = cache.layers[module.layer_idx].keys[:, :, :n]
            valid = joint.valid[..., :n]
            assert torch.equal(full_keys.gather(2, index)[valid], pruned[valid])  # the same entries kept
        clear_states(model)


@pytest.mark.parametrize("start", [0, 1, 3, 5])
def test_certificate_steps_reduces_all_layers_together_as_each_alone(tiny, start):
    """Reading the certificates computes every layer's pending decoded steps in one batch (the
    cache's values taken from its latest tensor); the per-step maxima must equal the definition
    applied to each step alone, and the remembered values must be let go after the read."""
    from certkv.presses.hajek_attention import CERT_ATTR, CertificateTerms, certificate_steps
    from certkv.presses.probabilistic import ProbabilisticPress, attention_modules

    model, context, question = tiny
    _answer(model, context, question, ProbabilisticPress(compression_ratio=0.6, head_share=0.25, seed=2), hajek=True,
            new_tokens=6)
    lists = [getattr(m, CERT_ATTR) for m in attention_modules(model)]
    assert all(isinstance(step, CertificateTerms) for steps in lists for step in steps[1:])  # decoded: pending

    def explicit(term):  # ĉ = sqrt(Σ_tail (1 − π) ŵ² ‖v − ô‖²), straight from the definition
        state = term.state
        values = state.latest_values
        rows, k_len = values.shape[0] * values.shape[1], values.shape[2]
        tail = values.reshape(rows, k_len, -1)[:, state.n_head : state.n_head + state.n_tail]
        spread = (tail.unsqueeze(1) - term.output.unsqueeze(2)).square().sum(-1)  # (rows, G·Q, T)
        c = (state.tail_weight_rows * term.weights.square() * spread).sum(-1).sqrt()
        batch, kv_heads, groups, q_len = term.shape
        return c.view(batch, kv_heads, groups, q_len).amax(dim=2)

    per_layer = [[steps[0]] + [explicit(t) for t in steps[1:]] for steps in lists]
    expected = torch.stack([torch.stack([c.amax(dim=(1, 2)) for c in steps]) for steps in per_layer]).amax(dim=0).T
    got = certificate_steps(model, start)
    assert len(got) == 1 and len(got[0]) == max(0, 6 - start)
    torch.testing.assert_close(torch.tensor(got), expected[:, start:], rtol=1e-6, atol=0)
    assert not any(isinstance(step, CertificateTerms) for steps in lists for step in steps) or start >= 6
    states = [m.certkv_hajek for m in attention_modules(model)]
    assert all("latest_values" not in state.__dict__ for state in states) or start >= 6


def test_ratio_zero_is_the_full_cache(tiny):
    from certkv.presses.hajek_attention import certificate_steps
    from certkv.presses.hajek_state import kept_fraction
    from certkv.presses.probabilistic import ProbabilisticPress

    model, context, question = tiny
    full_tokens, full_logits = _answer(model, context, question)
    tokens, logits = _answer(model, context, question, ProbabilisticPress(compression_ratio=0.0), hajek=True)
    assert tokens == full_tokens and torch.equal(logits, full_logits)
    assert certificate_steps(model) == [] and kept_fraction(model) == 1.0


def test_sampled_tail_gives_positive_certificates_and_target_retention(tiny):
    from certkv.presses.hajek_attention import certificate_max, certificate_steps
    from certkv.presses.hajek_state import kept_fraction
    from certkv.presses.probabilistic import ProbabilisticPress, attention_modules

    model, context, question = tiny
    fractions, padded_slots = [], []
    for seed in range(8):
        press = ProbabilisticPress(compression_ratio=0.6, head_share=0.25, seed=seed)
        tokens, _ = _answer(model, context, question, press, hajek=True, new_tokens=3)
        assert len(tokens) == 3
        steps = certificate_steps(model)
        assert len(steps) == 1 and len(steps[0]) == 3 and all(c > 0 for c in steps[0])
        assert certificate_max(model) == max(steps[0])
        # reading from a later step gives the same values for the steps read
        assert certificate_steps(model, 1) == [steps[0][1:]] and certificate_steps(model, 3) == [[]]
        states = [m.certkv_hajek for m in attention_modules(model)]
        assert all(s is not None and s.context_length == 96 for s in states)
        # one common width for every layer (transformers builds one mask from layer 0's length)
        assert len({s.n_slots for s in states}) == 1
        padded_slots.append(sum(int((~s.valid).sum()) for s in states))
        fractions.append(kept_fraction(model))
    assert max(padded_slots) > 0  # variable counts were padded
    # n_kept = int(96 * 0.4) = 38 per head in expectation
    assert sum(fractions) / len(fractions) == pytest.approx(38 / 96, abs=0.03)
    # a new full prefill clears the states (they belonged to the previous request)
    from transformers import DynamicCache

    from certkv.presses.hajek_attention import use_hajek_attention

    with torch.no_grad(), use_hajek_attention(model):
        model.model(input_ids=context[:, :20], past_key_values=DynamicCache())
    assert all(m.certkv_hajek is None for m in attention_modules(model))
    assert certificate_steps(model) == []


def test_register_and_context_manager(tiny):
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from certkv.presses.hajek_attention import NAME, hajek_attention, register, use_hajek_attention

    model = tiny[0]
    register()
    register()
    assert AttentionInterface._global_mapping[NAME] is hajek_attention
    assert NAME in ALL_MASK_ATTENTION_FUNCTIONS
    with use_hajek_attention(model):
        assert model.config._attn_implementation == NAME
    assert model.config._attn_implementation == "sdpa"


def test_bad_parameters_raise_value_error():
    from kvpress import KnormPress

    from certkv.presses.deterministic_head import DeterministicHeadPress
    from certkv.presses.probabilistic import ProbabilisticPress
    from certkv.presses.value_norm import AttentionTimesValueNormPress

    for kwargs, match in (
        ({"compression_ratio": 1.0}, "compression_ratio"),
        ({"compression_ratio": -0.1}, "compression_ratio"),
        ({"head_share": 1.5}, "head_share"),
        ({"n_sink": -1}, "n_sink"),
        ({"window": 2.5}, "window"),
        ({"seed": -3}, "seed"),
        ({"score_floor": -1.0}, "score_floor"),
        ({"score_floor": float("inf")}, "score_floor"),
        ({"base_press": "snapkv"}, "base_press"),
    ):
        with pytest.raises(ValueError, match=match):
            ProbabilisticPress(**kwargs)
    with pytest.raises(ValueError, match="window_size"):
        AttentionTimesValueNormPress(window_size=0)
    with pytest.raises(ValueError, match="base_press"):
        DeterministicHeadPress(base_press=object())
    ProbabilisticPress(compression_ratio=0.3, base_press=KnormPress())  # any ScorerPress sizes the tail


def test_imports_have_no_side_effects():
    import importlib
    import subprocess
    import sys

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    # the packages are lazy: importing them imports neither torch nor kvpress (which patches transformers)
    code = (
        "import sys, certkv.presses, certkv.signals; "
        "assert 'kvpress' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    # importing the attention module registers nothing
    import certkv.presses.hajek_attention as hajek

    saved = [(m, m._global_mapping.pop(hajek.NAME, None)) for m in (AttentionInterface, type(ALL_MASK_ATTENTION_FUNCTIONS))]
    try:
        importlib.reload(hajek)
        assert hajek.NAME not in AttentionInterface._global_mapping
        assert hajek.NAME not in ALL_MASK_ATTENTION_FUNCTIONS
    finally:
        for mapping, value in saved:
            if value is not None:
                mapping._global_mapping[hajek.NAME] = value


def test_selection_refuses_tails_it_cannot_turn_into_sizes():
    """Non-finite tail scores, scores whose shift to nonnegative overflows, and a non-finite or
    negative floor raise instead of giving NaN inclusion probabilities (and an empty tail)."""
    from certkv.presses.poisson_selection import probabilistic_selection

    kw = dict(n_sink=0, window=0, head_share=0.0, generator=torch.Generator().manual_seed(0))
    ok = torch.rand(1, 1, 40)
    assert int(probabilistic_selection(ok, 20, **kw).counts) > 0
    for scores, floor in (
        (ok.clone().index_fill_(-1, torch.tensor([5]), float("inf")), 0.01),
        (torch.tensor([[[1.7e308, -1.7e308] * 20]], dtype=torch.float64), 0.01),
        (ok, float("inf")),
        (ok, float("nan")),
        (ok, -5.0),
    ):
        with pytest.raises(ValueError, match="non-finite|score_floor"):
            probabilistic_selection(scores, 20, **{**kw, "score_floor": floor})
