"""certkv: certified KV-cache eviction.

Importing this package is cheap and has no side effects: torch, transformers and kvpress are
imported only when a function that needs them is called.
"""

from __future__ import annotations

from certkv._lazy import lazy_getattr
from certkv._version import __version__

_LAZY = {
    "load_model": ("certkv.model.loading", "load_model"),
    "certify": ("certkv.core.certify", "certify"),
    "CertificationSpec": ("certkv.core.spec", "CertificationSpec"),
    "load_operating_point": ("certkv.core.operating_point", "load_operating_point"),
    "LossTable": ("certkv.core.loss_table", "LossTable"),
    "read_loss_table": ("certkv.core.loss_table", "read_loss_table"),
    "validate": ("certkv.core.validation", "validate"),
    "certification_spec": ("certkv.contract.spec", "certification_spec"),
    "CertifiedRuntime": ("certkv.runtime.certified_runtime", "CertifiedRuntime"),
    "Decision": ("certkv.runtime.certified_runtime", "Decision"),
}


__getattr__ = lazy_getattr('certkv', _LAZY)

__all__ = ["__version__", *_LAZY]
