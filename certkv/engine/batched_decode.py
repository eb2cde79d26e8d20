"""Greedy answers of many compressed caches of one request, decoded together.

Every candidate of a request shares the same context, so their caches differ only in which entries
were kept. They are stacked into one padded batch (padding masked out) and answered together:

1. *Verify.* The full-KV answer is a draft. One batched, teacher-forced forward of the question and
   the draft over every compressed cache gives each candidate's greedy choice at every draft
   position. A candidate that agrees with the draft everywhere has the draft as its answer.
2. *Continue.* A candidate that diverges at position j keeps the draft's first j tokens, takes its
   own token j, and decodes on from there. The draft tokens it did not choose are masked out of its
   cache, so each row attends to exactly the tokens of its own answer.

Positions follow kvpress: `position_ids` continue from the uncompressed context length, the cache
index from the (padded) pruned length. Stopping follows kvpress's pipeline too: at most
`max_new_tokens` tokens, stop after a stop token, but never on the first generated token.
"""

from __future__ import annotations


def padded_cache(full_cache, selections: list[list], context_length: int):
    """Gather every candidate's kept entries into one padded batch cache.

    `selections[c][layer]` holds candidate c's kept indices (1, kv_heads, n_kept) in kvpress's
    topk order, or None for "keep everything" (kvpress leaves such a cache untouched). Returns the
    DynamicCache of shape (candidates, kv_heads, longest, head_dim) per layer, the 0/1 mask of
    real (non-padding) entries, and each candidate's number of kept entries.
    """
    import torch
    from transformers import DynamicCache

    n = len(selections)
    n_layers = len(selections[0])
    lengths = [context_length if sel[0] is None else sel[0].shape[2] for sel in selections]
    width = max(lengths)
    device = full_cache.layers[0].keys.device
    cache = DynamicCache()
    for layer_idx in range(n_layers):
        keys = full_cache.layers[layer_idx].keys[:, :, :context_length]
        values = full_cache.layers[layer_idx].values[:, :, :context_length]
        idx = torch.zeros((n, keys.shape[1], width), dtype=torch.long, device=device)
        for row, sel in enumerate(selections):
            kept = sel[layer_idx]
            if kept is None:
                idx[row, :, :context_length] = torch.arange(context_length, device=device)
            else:
                idx[row, :, : kept.shape[2]] = kept[0]
        gather = idx.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        batch_keys = keys.expand(n, -1, -1, -1).gather(2, gather)
        batch_values = values.expand(n, -1, -1, -1).gather(2, gather)
        cache.update(batch_keys, batch_values, layer_idx)
    positions = torch.arange(width, device=device).unsqueeze(0)
    valid = (positions < torch.as_tensor(lengths, device=device).unsqueeze(1)).long()
    return cache, valid, lengths


def decode_candidates(
    model,
    cache,
    mask,
    question_ids: list[int],
    draft: list[int],
    context_length: int,
    max_new_tokens: int,
    stop_ids: set[int],
) -> list[list[int]]:
    """Greedy answers (token ids) of every row of a padded batch cache, verified against the `draft`."""
    import torch

    device = model.device
    n = mask.shape[0]
    q_len = len(question_ids)
    fed = list(question_ids) + list(draft[:-1])
    inputs = torch.as_tensor(fed, device=device).view(1, -1).expand(n, -1)
    positions = torch.arange(context_length, context_length + len(fed), device=device).view(1, -1).expand(n, -1)
    mask = torch.cat([mask, torch.ones((n, len(fed)), dtype=mask.dtype, device=device)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=inputs, past_key_values=cache, position_ids=positions, attention_mask=mask).logits
    choices = logits[:, q_len - 1 :, :].argmax(-1).tolist()  # greedy token at each draft position

    answers: list[list[int]] = []
    active: list[int] = []
    width = cache.get_seq_length()
    for row in range(n):
        tokens: list[int] = []
        for j, token in enumerate(choices[row]):
            tokens.append(token)
            if token != draft[j]:
                break
        diverged = tokens != draft[: len(tokens)] or len(tokens) < len(draft)
        finished = len(tokens) >= max_new_tokens or (len(tokens) > 1 and tokens[-1] in stop_ids)
        answers.append(tokens)
        if diverged and not finished:
            # Mask the draft tokens this row did not take: fed slots after its own prefix.
            first_unused = width - len(fed) + q_len + len(tokens) - 1
            mask[row, first_unused:] = 0
            active.append(row)

    with torch.no_grad():
        while active:
            step_ids = torch.zeros((n, 1), dtype=torch.long, device=device)
            step_pos = torch.zeros((n, 1), dtype=torch.long, device=device)
            for row in active:
                step_ids[row, 0] = answers[row][-1]
                step_pos[row, 0] = context_length + q_len + len(answers[row]) - 1
            new_col = torch.zeros((n, 1), dtype=mask.dtype, device=device)
            new_col[active] = 1
            mask = torch.cat([mask, new_col], dim=1)
            logits = model(input_ids=step_ids, past_key_values=cache, position_ids=step_pos, attention_mask=mask).logits
            next_tokens = logits[:, -1].argmax(-1).tolist()
            still = []
            for row in active:
                answers[row].append(next_tokens[row])
                if len(answers[row]) < max_new_tokens and answers[row][-1] not in stop_ids:
                    still.append(row)
            active = still
    return answers
