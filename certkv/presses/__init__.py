"""certkv's own presses and the attention function they need.

Importing this package is cheap and has no side effects: kvpress (which patches transformers'
attention functions when imported), torch and transformers are imported only when one of the
names below is first used. Nothing is registered with transformers until
:func:`certkv.presses.hajek_attention.register` is called.
"""

from __future__ import annotations

from certkv._lazy import lazy_getattr

_LAZY = {
    "ProbabilisticPress": ("certkv.presses.probabilistic", "ProbabilisticPress"),
    "ProbabilisticDecodingPress": ("certkv.presses.probabilistic_decoding", "ProbabilisticDecodingPress"),
    "DeterministicHeadPress": ("certkv.presses.deterministic_head", "DeterministicHeadPress"),
    "AttentionTimesValueNormPress": ("certkv.presses.value_norm", "AttentionTimesValueNormPress"),
    "ValueDiffPress": ("certkv.presses.value_diff", "ValueDiffPress"),
    "DeferKVPress": ("certkv.presses.deferkv", "DeferKVPress"),
    "LOREKVPress": ("certkv.presses.lorekv", "LOREKVPress"),
    "BehaviorPreservingPress": ("certkv.presses.behavior_preserving", "BehaviorPreservingPress"),
    "ResponseAwarePress": ("certkv.presses.response_aware", "ResponseAwarePress"),
    "HajekState": ("certkv.presses.hajek_state", "HajekState"),
    "probabilistic_selection": ("certkv.presses.poisson_selection", "probabilistic_selection"),
    "kept_fraction": ("certkv.presses.hajek_state", "kept_fraction"),
    "hajek_attention": ("certkv.presses.hajek_attention", "hajek_attention"),
    "use_hajek_attention": ("certkv.presses.hajek_attention", "use_hajek_attention"),
    "certificate_steps": ("certkv.presses.hajek_attention", "certificate_steps"),
    "certificate_max": ("certkv.presses.hajek_attention", "certificate_max"),
}


__getattr__ = lazy_getattr('certkv.presses', _LAZY)

__all__ = list(_LAZY)
