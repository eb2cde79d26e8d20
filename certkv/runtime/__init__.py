"""Serving a certified operating point: the certified press behind its gate, full cache otherwise."""

from __future__ import annotations

from certkv._lazy import lazy_getattr

_LAZY = {
    "CertifiedRuntime": ("certkv.runtime.certified_runtime", "CertifiedRuntime"),
    "Decision": ("certkv.runtime.certified_runtime", "Decision"),
    "RuntimeAnswer": ("certkv.runtime.certified_runtime", "RuntimeAnswer"),
}

__getattr__ = lazy_getattr("certkv.runtime", _LAZY)

__all__ = list(_LAZY)
