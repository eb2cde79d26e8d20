"""The candidate batch's attention skips each lane's padding and gives the padded batch's outputs."""

from __future__ import annotations

import pytest
import torch


def _right_aligned_mask(lengths, width, new):
    slots = torch.arange(width + new).unsqueeze(0)
    starts = width - torch.tensor(lengths).unsqueeze(1)
    return (slots >= starts).long()


def test_lane_groups_split_lanes_by_first_real_slot():
    from certkv.engine.batched_decode import lane_groups

    mask = _right_aligned_mask([9, 9, 6, 2, 2], 9, 3)
    assert lane_groups(mask) == [(0, 2, 0), (2, 3, 3), (3, 5, 7)]
    assert lane_groups(_right_aligned_mask([9, 9], 9, 2)) is None  # nothing to skip


@pytest.mark.parametrize("q_len", [5, 2, 1])  # a verify forward (sdpa); decoding steps (grouped matmuls)
def test_grouped_attention_equals_attention_over_the_whole_padded_width(q_len):

    from certkv.engine.batched_decode import lane_groups
    from certkv.model.attention import attention_lane_groups, gqa_sdpa_attention

    g = torch.Generator().manual_seed(3)
    lengths, width, kv_heads, heads, d = [40, 40, 25, 11, 11, 3], 40, 2, 4, 8
    mask2d = _right_aligned_mask(lengths, width, q_len)
    k_len = width + q_len
    causal = torch.arange(k_len).unsqueeze(0) <= (width + torch.arange(q_len)).unsqueeze(1)
    mask4d = (mask2d.bool()[:, None, None, :] & causal[None, None]).expand(len(lengths), 1, q_len, k_len)
    query = torch.randn(len(lengths), heads, q_len, d, generator=g)
    key = torch.randn(len(lengths), kv_heads, k_len, d, generator=g)
    value = torch.randn(len(lengths), kv_heads, k_len, d, generator=g)
    module = type("M", (), {"is_causal": True})()
    whole = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask4d, scale=d**-0.5, enable_gqa=True
    ).transpose(1, 2)
    ungrouped, _ = gqa_sdpa_attention(module, query, key, value, mask4d, scaling=d**-0.5)
    torch.testing.assert_close(ungrouped, whole, atol=1e-6, rtol=1e-5)
    groups = lane_groups(mask2d)
    assert groups is not None and len(groups) == 4
    with attention_lane_groups(groups):
        grouped, _ = gqa_sdpa_attention(module, query, key, value, mask4d, scaling=d**-0.5)
    torch.testing.assert_close(grouped, whole, atol=1e-6, rtol=1e-5)
    # padding slots really are skipped: garbage there changes nothing
    key[3:, :, :29] = float("nan")
    value[3:, :, :29] = float("nan")
    with attention_lane_groups(groups):
        poisoned, _ = gqa_sdpa_attention(module, query, key, value, mask4d, scaling=d**-0.5)
    torch.testing.assert_close(poisoned, whole, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("q_len", [3, 7])  # grouped matmuls; sdpa
def test_attention_without_a_mask_is_causal_over_the_last_positions(q_len):
    """transformers passes no mask when nothing needs masking; the new positions are the last keys."""
    from certkv.model.attention import gqa_sdpa_attention

    g = torch.Generator().manual_seed(5)
    batch, heads, kv_heads, k_len, d = 2, 4, 2, 17, 8
    query = torch.randn(batch, heads, q_len, d, generator=g)
    key = torch.randn(batch, kv_heads, k_len, d, generator=g)
    value = torch.randn(batch, kv_heads, k_len, d, generator=g)
    allowed = torch.arange(k_len).unsqueeze(0) <= (k_len - q_len + torch.arange(q_len)).unsqueeze(1)
    want = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, scale=d**-0.5, enable_gqa=True
    ).transpose(1, 2)
    module = type("M", (), {"is_causal": True})()
    got, _ = gqa_sdpa_attention(module, query, key, value, None, scaling=d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
