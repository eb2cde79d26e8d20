"""Ctrl-C and SIGTERM end a command cleanly, never in the middle of a store transaction.

Why. Python raises :class:`KeyboardInterrupt` between any two bytecodes of the main thread, so a
Ctrl-C can land after SQLite's ``COMMIT`` returned but before the code that follows it ran, or
between ``BEGIN`` and the first insert. SQLite itself keeps the file whole in every such case, but
the code around the transaction would then misreport what happened (a rollback of a transaction
that is no longer open used to surface as "is another certkv process using this store?"). And
without a handler SIGTERM kills the process by the signal, with no word of what was kept.

What. :func:`interruptible` is entered once around a command (the CLI does it): while it is
active, SIGINT raises :class:`KeyboardInterrupt` and SIGTERM raises :class:`Terminated` (a
KeyboardInterrupt, so every cleanup that handles Ctrl-C handles it), except inside
:func:`critical`: a signal that arrives there is held and raised the moment the outermost critical
block ends, so a store transaction (begin, records, commit or rollback) always runs to its end. The
exit code of an interrupted command is :func:`exit_code` (130 for SIGINT, 143 for SIGTERM).

Nothing is installed at import; outside :func:`interruptible` (a library caller, a worker thread)
:func:`critical` changes nothing, and the store's own rollback still copes with an interrupt at
any instant.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: The signals a command turns into an orderly stop.
HANDLED = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be, so that the same cleanup runs."""

    signum = signal.SIGTERM


def exit_code(exc: BaseException) -> int:
    """The shell's code for a command stopped by `exc`: 128 + the signal's number."""
    return 128 + int(getattr(exc, "signum", signal.SIGINT))


class _State:
    """The process-wide handler state (signal handlers are process-wide too)."""

    def __init__(self) -> None:
        self.active = 0  # nesting depth of interruptible()
        self.depth = 0  # nesting depth of critical() in the main thread
        self.pending: int | None = None  # the first signal held inside a critical block


_state = _State()


def _raise_for(signum: int) -> None:
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _handler(signum: int, frame) -> None:
    if _state.depth:
        if _state.pending is None:
            _state.pending = signum
        return
    _state.pending = None
    _raise_for(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def interruptible() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into exceptions for the block (main thread only; re-entrant)."""
    if not _in_main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in HANDLED}
    _state.active += 1
    try:
        reclaim()
        yield
    finally:
        try:
            if _state.active == 1:  # the outermost block: the previous handlers back before the count drops
                for sig, handler in previous.items():
                    if handler is not None:  # None: a handler not set from Python, nothing to restore
                        signal.signal(sig, handler)
                _state.pending = None
        finally:
            _state.active -= 1


def reclaim() -> None:
    """Install certkv's handlers again inside :func:`interruptible` (a library such as Ray replaces
    the SIGTERM handler when it starts); outside it, nothing."""
    if _state.active and _in_main_thread():
        for sig in HANDLED:
            signal.signal(sig, _handler)


@contextmanager
def critical() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends, then raise the first one that came.

    A no-op outside :func:`interruptible` and in other threads (signals are delivered to the main
    thread only). The counter changes in one bytecode each, so a signal lands either before the
    block (raised at once) or inside it (held)."""
    if not (_state.active and _in_main_thread()):
        yield
        return
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if not _state.depth and _state.pending is not None:
            signum, _state.pending = _state.pending, None
            _raise_for(signum)
