"""Runtime gate signals (docs/design.md, "Gate signals").

Importing this package is cheap and has no side effects: torch and kvpress are imported only when
a function that needs them is called.
"""

from __future__ import annotations

from certkv._lazy import lazy_getattr

_LAZY = {
    "AgreementRecorder": ("certkv.gate.agreement", "AgreementRecorder"),
    "agreement_drop": ("certkv.gate.agreement", "agreement_drop"),
    "layer_agreement": ("certkv.gate.agreement", "layer_agreement"),
    "layer_agreements": ("certkv.gate.agreement", "layer_agreements"),
    "layer_split": ("certkv.gate.agreement", "layer_split"),
    "window_attention": ("certkv.model.window_attention", "window_attention"),
    "window_attention_mean": ("certkv.model.window_attention", "window_attention_mean"),
}


__getattr__ = lazy_getattr('certkv.gate', _LAZY)

__all__ = list(_LAZY)
