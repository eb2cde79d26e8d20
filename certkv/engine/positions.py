"""Where a pruned cache's question starts: the context's length, or the compressed cache's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpress import FinchPress, KeyRerotationPress, RestoreKVPress

if TYPE_CHECKING:
    from kvpress import BasePress


def continues_from_compressed_length(press: BasePress) -> bool:
    """Presses after which kvpress continues positions from the compressed cache's length (they
    re-rotate or restore keys), not from the context length."""
    return isinstance(press, (KeyRerotationPress, RestoreKVPress)) or (isinstance(press, FinchPress) and press.rerotate_keys)


__all__ = ["continues_from_compressed_length"]
