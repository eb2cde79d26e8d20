"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Every file certkv writes for a user (operating points, validation results, request sets,
exported records, report pages and figures, the demo's copies, training checkpoints) goes through
:func:`atomic_write`: the content is written to a temporary file in the target's folder, flushed
to disk, then renamed over the target, so a process killed mid-write leaves the previous file
intact and no temporary file behind. The file gets the mode a plain ``open()`` would give it
(0666 less the umask), not the temporary file's private 0600.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


@contextmanager
def atomic_write(path: str | Path, mode: str = "w", *, encoding: str | None = "utf-8",
                 newline: str | None = None) -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; on a clean exit it replaces `path`.

    `mode` is ``"w"`` (text, with `encoding` and `newline`) or ``"wb"``. Parent folders are
    created. On any exception the temporary file is removed and `path` is left as it was.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes whole files: mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())
        text: dict[str, Any] = {} if mode == "wb" else {"encoding": encoding, "newline": newline}
        with os.fdopen(fd, mode, **text) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """The process's umask: from /proc on Linux (reading it does not change it, so other threads
    creating files meanwhile are unaffected), else by setting and restoring it."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically; returns the path."""
    with atomic_write(path) as fh:
        fh.write(text)
    return Path(path)
