"""certkv: certified KV-cache eviction.

Importing this package is cheap and has no side effects: torch, transformers and kvpress are
imported only when a function that needs them is called.
"""

from __future__ import annotations

from certkv._lazy import lazy_getattr

__version__ = "0.1.0"

_LAZY = {
    "load_model": ("certkv.models", "load_model"),
    "certify": ("certkv.certifier", "certify"),
    "CertificationSpec": ("certkv.certifier", "CertificationSpec"),
    "load_operating_point": ("certkv.certifier", "load_operating_point"),
    "LossTable": ("certkv.loss_table", "LossTable"),
    "read_loss_table": ("certkv.loss_table", "read_loss_table"),
    "validate": ("certkv.validation", "validate"),
    "certification_spec": ("certkv.contract_spec", "certification_spec"),
    "CertifiedRuntime": ("certkv.runtime", "CertifiedRuntime"),
    "Decision": ("certkv.runtime", "Decision"),
}


__getattr__ = lazy_getattr('certkv', _LAZY)

__all__ = ["__version__", *_LAZY]
