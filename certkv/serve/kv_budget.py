"""``--kv-budget`` / ``--kv-budget-mb``: the server's KV memory in token slots.

A token slot is one token's keys and values in every layer and KV head (:mod:`certkv.engine.ragged_decode`),
so it takes ``2 × layers × kv_heads × head_dim × bytes per element`` bytes of the model's cache dtype:
1 KiB for the embedded model (2 layers, 2 KV heads of 32) in float32, 22.5 KiB for SmolLM2-135M (30 layers, 3 KV heads of
64) in bfloat16. The scheduler admits, holds and frees slots; this module converts an operator's
megabytes into them, with the model's own shapes, so both flags mean the same memory.
``--prefix-cache-mib`` keeps compressed contexts inside that budget (:mod:`certkv.runtime.prefix_cache`);
the server and every replica build it and check it against their point here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from certkv.errors import CertkvError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from certkv.runtime.certified_runtime import CertifiedRuntime
    from certkv.runtime.prefix_cache import PrefixCache


def bytes_per_slot(model: PreTrainedModel) -> int:
    """Bytes one token's KV takes in `model`'s cache (keys and values, every layer and KV head)."""
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * element


def check_flags(tokens: int | None, megabytes: float | None) -> None:
    """One line naming the flag when ``--kv-budget`` / ``--kv-budget-mb`` are unusable (before the model loads)."""
    if tokens is not None and megabytes is not None:
        raise CertkvError("give --kv-budget (token slots) or --kv-budget-mb (MiB), not both")
    if tokens is not None and tokens < 1:
        raise CertkvError(f"--kv-budget must be a positive number of token slots, got {tokens}")
    if megabytes is not None and not (megabytes > 0 and math.isfinite(megabytes)):
        raise CertkvError(f"--kv-budget-mb must be a positive number of MiB, got {megabytes}")


def budget_slots(model: PreTrainedModel, tokens: int | None, megabytes: float | None) -> int | None:
    """The budget in token slots from ``--kv-budget`` (slots) or ``--kv-budget-mb`` (MiB), None when neither
    is given; one line naming the flag when a value is unusable or both are given."""
    check_flags(tokens, megabytes)
    if tokens is not None or megabytes is None:
        return tokens
    per = bytes_per_slot(model)
    slots = int(megabytes * (1 << 20) // per)
    if slots < 1:
        raise CertkvError(f"--kv-budget-mb {megabytes:g} holds less than one token of this model's KV "
                          f"({per} bytes a token); raise it")
    return slots


def prefix_cache_of(mib: float) -> PrefixCache | None:
    """``--prefix-cache-mib``'s cache (None: 0, off); each server process, each replica, keeps its own."""
    if mib == 0:
        return None
    from certkv.runtime.prefix_cache import PrefixCache

    return PrefixCache(mib)


def check_prefix_cache(runtime: CertifiedRuntime) -> dict[str, str]:
    """One line (a CertkvError) when ``--prefix-cache-mib`` is set on a point no request of which can
    reuse a compressed context; otherwise the strata (a pooled point: its policy) that bypass the
    cache, with why (empty without a cache)."""
    if runtime.prefix_cache is None:
        return {}
    refusal = runtime.prefix_cache_refusal()
    if refusal is not None:
        raise CertkvError(f"--prefix-cache-mib: {refusal}; serve it without the flag")
    return runtime.prefix_bypassed()
