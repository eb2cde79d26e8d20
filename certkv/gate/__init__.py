"""Runtime gate signals (DESIGN.md, "Gate signals").

Importing this package is cheap and has no side effects: torch and kvpress are imported only when
a function that needs them is called.
"""

from __future__ import annotations

_LAZY = {
    "AgreementRecorder": ("certkv.gate.agreement", "AgreementRecorder"),
    "agreement_drop": ("certkv.gate.agreement", "agreement_drop"),
    "layer_agreement": ("certkv.gate.agreement", "layer_agreement"),
    "layer_agreements": ("certkv.gate.agreement", "layer_agreements"),
    "layer_split": ("certkv.gate.agreement", "layer_split"),
    "window_attention": ("certkv.gate.agreement", "window_attention"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'certkv.gate' has no attribute {name!r}")


__all__ = list(_LAZY)
