"""User-facing errors.

Anything a user can fix (a bad contract, a missing file, a model that is not available offline)
raises :class:`CertkvError` with a one-line message that names what is wrong and how to fix it.
The CLI prints that line and exits with code 2; it never shows a traceback for these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # every certkv module imports this one; pydantic only where something is validated
    from pydantic import ValidationError


class CertkvError(Exception):
    """An error caused by the user's input, with a one-line, actionable message."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def format_validation_error(exc: ValidationError, source: str) -> str:
    """Turn a pydantic ValidationError into one line: `source: field.path: problem`."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ())) or "(top level)"
        msg = err.get("msg", "invalid value")
        if err.get("type") == "extra_forbidden":
            msg = "unknown key; remove it or check its spelling"
        parts.append(f"{loc}: {msg}")
    return f"{source}: " + "; ".join(parts)
