"""Prompt encoding and greedy decoding with kvpress's conventions.

certkv must answer exactly as kvpress's ``KVPressTextGenerationPipeline`` does, so the encoding
(BOS + context when the tokenizer has no chat template, the chat template split around the
context otherwise; the question followed by the template's suffix) and the decoding (positions
that continue from the uncompressed context length while the cache index continues from the
pruned length) follow that pipeline. Tests compare the two token for token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from certkv.core.spec import DEFAULT_MAX_NEW_TOKENS
from certkv.model.stopping import is_finished

if TYPE_CHECKING:
    from transformers import Cache, PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class EncodedRequest:
    """Token ids of one request: the context to prefill and the question fed after it."""

    context_ids: list[int]
    question_ids: list[int]


def encode_request(tokenizer: PreTrainedTokenizerBase, context: str, question: str, answer_prefix: str = "") -> EncodedRequest:
    """Encode as kvpress's pipeline does (its `preprocess`), with `answer_prefix` (the start of the
    answer, empty by default) after the question's suffix: after the chat template's assistant
    header, or after the line break of a model without a template."""
    if tokenizer.chat_template is None:
        context_text = (tokenizer.bos_token or "") + context
        suffix = "\n"
    else:
        separator = "#" * (len(context) + 10)
        templated = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + separator}],
            add_generation_prompt=True,
            tokenize=False,
            enable_thinking=False,
        )
        context_text, suffix = templated.split(separator)
    return EncodedRequest(
        context_ids=tokenizer.encode(context_text, add_special_tokens=False),
        question_ids=tokenizer.encode(question + suffix + answer_prefix, add_special_tokens=False),
    )


def for_protocol(enc: EncodedRequest, query_aware: bool) -> EncodedRequest:
    """What a protocol prefills (``context_ids``) and feeds after compression (``question_ids``).

    Question-agnostic (False): `enc` itself, as kvpress's pipeline runs it. Query-aware (True):
    the whole prompt but its last token is prefilled, so the press scores and evicts with the
    question in its window (the question's own entries are evicted like the context's), and the
    last token is fed after compression: the answer's first query reads the compressed cache, as
    every later one does. The prompt's tokens, and so the full-cache answer, are the same in both
    protocols; kvpress's "question in the context" mode differs only in re-tokenising the joined
    text (which splits a word at the seam for some tokenizers) and needs a non-empty suffix.

    Raises ValueError when a query-aware prompt has no question token to feed.
    """
    if not query_aware:
        return enc
    if not enc.question_ids:
        raise ValueError("the question encodes to no tokens; the query-aware protocol feeds its last token after compression")
    return EncodedRequest(context_ids=[*enc.context_ids, *enc.question_ids[:-1]], question_ids=list(enc.question_ids[-1:]))


def stop_token_ids(model: PreTrainedModel) -> set[int]:
    """The model's stop tokens: its generation config's ``eos_token_id`` (one or several; none: empty)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p of the chosen `tokens` under `logits`: ``logit_tok − logsumexp(logits)`` in float64.

    `logits` (..., vocab) in any float dtype, `tokens` (...) long (the greedy choices, taken by
    the caller from the same logits, so answers do not depend on this). Returns a float64 tensor
    of `tokens`' shape. The float64 copy is made one leading row at a time, so a wide candidate
    batch over a large vocabulary never holds all its logits in float64 at once.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    index = tokens.reshape(-1, 1)
    rows = max(1, (1 << 24) // max(1, flat.shape[-1]))  # at most ~128 MB of float64 per slice
    out = []
    for start in range(0, flat.shape[0], rows):
        part = flat[start : start + rows].double()
        out.append(part.gather(1, index[start : start + rows]).squeeze(1) - torch.logsumexp(part, dim=-1))
    return torch.cat(out).view(tokens.shape)


def greedy_decode(model: PreTrainedModel, cache: Cache, question_ids: Sequence[int], context_length: int,
                  max_new_tokens: int, logprobs: list[float] | None = None,
                  keep: Callable[[int, float], bool] | None = None) -> list[int]:
    """Feed the question after the (possibly pruned) cache and decode greedily.

    Returns the generated token ids, the stop token included when one was produced; decoding ends
    by :func:`certkv.model.stopping.is_finished`, the rule every certkv decoder shares. `logprobs`,
    when given, is extended with each generated token's log p (python floats, float64; see
    :func:`chosen_logprobs`). `keep`, when given, is called with each chosen token's id and log p
    before the token is kept; False ends the decode without it (a recompute gate's trigger, a
    decoding-time press's per-step bookkeeping: :mod:`certkv.engine.decoding_run`).
    Not speculative (certkv.engine.speculation): it is kvpress's one-token-a-forward decode, the reference.
    """
    device = model.device
    q = torch.as_tensor(list(question_ids), device=device).view(1, -1)
    positions = torch.arange(context_length, context_length + q.shape[1], device=device).unsqueeze(0)
    stops = stop_token_ids(model)
    generated: list[int] = []
    with torch.no_grad():
        out = model(input_ids=q, past_key_values=cache, position_ids=positions, logits_to_keep=1)
        next_position = positions[:, -1:]
        while True:
            logits = out.logits[0, -1]
            token = logits.argmax()
            if logprobs is not None or keep is not None:
                logprob = float(chosen_logprobs(logits.view(1, -1), token.view(1))[0])
                if keep is not None and not keep(int(token), logprob):
                    break
                if logprobs is not None:
                    logprobs.append(logprob)
            generated.append(int(token))
            if is_finished(generated, max_new_tokens, stops):
                break
            next_position = next_position + 1
            out = model(input_ids=token.view(1, 1), past_key_values=cache, position_ids=next_position)
    return generated


def full_kv_ids(model: PreTrainedModel, enc: EncodedRequest, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> list[int]:
    """The full-cache answer's token ids: prefill the whole context, then decode greedily."""
    cache = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=torch.as_tensor(enc.context_ids, device=model.device).view(1, -1), past_key_values=cache)
    return greedy_decode(model, cache, enc.question_ids, len(enc.context_ids), max_new_tokens)


def full_kv_answer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, context: str, question: str,
                   max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, answer_prefix: str = "") -> str:
    """Answer one request with the full cache (no eviction); the text decoded after `answer_prefix`."""
    ids = full_kv_ids(model, encode_request(tokenizer, context, question, answer_prefix), max_new_tokens)
    return tokenizer.decode(ids, skip_special_tokens=True)
