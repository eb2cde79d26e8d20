"""The gate signals' recorders: the code that measures each signal declared in
:data:`certkv.core.signals.SIGNALS` (docs/design.md, "Gate signals").

* :mod:`certkv.signals.agreement`: the agreement drop, recorded inside the engine's single prefill;
* :mod:`certkv.signals.lookahead`: the lookahead probe on the full cache and the mass it puts on
  the entries a candidate evicts (``lookahead_heads``, ``lookahead_mass``).

The declarations stay in the torch-free :mod:`certkv.core.signals`; the recorders need the model.
``confidence_min`` and ``logprob_mean`` need only the answer's token log-probabilities, so their
one definition, :func:`certkv.core.gate_features.answer_confidence`, sits in the core, where the
runtime's gate reads it too; it is named here for completeness.
Importing this package is cheap and has no side effects: torch, transformers and kvpress are
imported only when a name that needs them is used.
"""

from __future__ import annotations

from certkv._lazy import lazy_getattr

_LAZY = {
    "AgreementRecorder": ("certkv.signals.agreement", "AgreementRecorder"),
    "agreement_drop": ("certkv.signals.agreement", "agreement_drop"),
    "layer_agreements": ("certkv.signals.agreement", "layer_agreements"),
    "layer_split": ("certkv.signals.agreement", "layer_split"),
    "answer_confidence": ("certkv.core.gate_features", "answer_confidence"),
    "LookaheadProbe": ("certkv.signals.lookahead", "LookaheadProbe"),
    "lookahead_probe": ("certkv.signals.lookahead", "lookahead_probe"),
    "evicted_mass": ("certkv.signals.lookahead", "evicted_mass"),
    "window_attention": ("certkv.model.window_attention", "window_attention"),
    "window_attention_mean": ("certkv.model.window_attention", "window_attention_mean"),
}


__getattr__ = lazy_getattr("certkv.signals", _LAZY)

__all__ = list(_LAZY)
