"""The contract: a pre-registered deployment requirement, validated and hashed.

:mod:`~certkv.contract.schema` holds the pydantic schema (validation, the hash, paths),
:mod:`~certkv.contract.loading` reads YAML, :mod:`~certkv.contract.spec` turns a contract into the
core's inputs: its candidates, their sequences and the :class:`~certkv.core.spec.CertificationSpec`.
Torch-free.
"""

from __future__ import annotations

from certkv._lazy import lazy_getattr

_LAZY = {
    "Contract": ("certkv.contract.schema", "Contract"),
    "load_contract": ("certkv.contract.loading", "load_contract"),
    "parse_contract": ("certkv.contract.loading", "parse_contract"),
    "certification_spec": ("certkv.contract.spec", "certification_spec"),
}

__getattr__ = lazy_getattr("certkv.contract", _LAZY)

__all__ = list(_LAZY)
