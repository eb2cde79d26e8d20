"""`certkv serve` in a process of its own, with a test's hooks on its service: the launcher
tests/serve/test_serve.py and tests/serve/test_streaming.py start servers with.

    python tests/serve/hooked_serve.py [--hold-fd N] [--step-fd N] serve OPERATING_POINT [options]

The arguments after the hooks are `certkv`'s own. The hooks are pipes the test made and the server
inherited (their read ends, file descriptors above 2):

* ``--hold-fd N``: the scheduler's worker starts only once the pipe's writer has closed it.
  Requests submitted meanwhile wait in the queue, so a test fills the queue (503) and holds a
  request past ``--timeout`` (504) as events, not races.
* ``--step-fd N``: the scheduler reads one byte of the pipe before each batched decode step (the
  service's ``before_step``), and steps freely once the writer has closed it. A test lets a
  streamed answer decode one step at a time and sees its first tokens arrive while the rest is
  provably not decoded yet.

The server is built exactly as `certkv serve` builds it; only its :class:`Service` is this
module's subclass, which adds the hooks.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

from certkv.errors import CertkvError
from certkv.serve import service as service_module


def pipe_fd(value: str, flag: str) -> int:
    """The open file descriptor `value` names for hook `flag`, checked before the server starts
    (one line otherwise: a held scheduler that never starts would look healthy and answer nothing)."""
    try:
        fd = int(value)
        if fd <= 2:
            raise ValueError("standard streams are not a hold pipe")
        os.fstat(fd)
    except (ValueError, OSError):
        raise CertkvError(f"{flag}={value!r} is not an open pipe's file descriptor above 2") from None
    return fd


def stepper(fd: int) -> Callable[[], None]:
    """A ``before_step`` that reads one byte of pipe `fd` per step until its writer closes it."""
    open_ = [True]

    def before_step() -> None:
        if open_[0] and not os.read(fd, 1):
            os.close(fd)
            open_[0] = False

    return before_step


def hooked_service(hold_fd: int | None, step_fd: int | None) -> type[service_module.Service]:
    """The service class `certkv serve` builds, with the hooks."""

    class HookedService(service_module.Service):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, before_step=None if step_fd is None else stepper(step_fd), **kwargs)

        def start(self) -> None:
            if hold_fd is None:
                super().start()
                return
            logging.getLogger("certkv.serve").warning("the scheduler is held until file descriptor %d is closed "
                                                      "(a test's hook)", hold_fd)

            def start_when_released() -> None:
                with os.fdopen(hold_fd, "rb") as pipe:
                    pipe.read()  # returns when the writer has closed its end
                self.scheduler.start()

            threading.Thread(target=start_when_released, name="certkv-test-hold", daemon=True).start()

    return HookedService


def main(argv: list[str]) -> None:
    fds: dict[str, int | None] = {"--hold-fd": None, "--step-fd": None}
    while argv and argv[0] in fds:
        fds[argv[0]] = pipe_fd(argv[1], argv[0])
        argv = argv[2:]
    service_module.Service = hooked_service(fds["--hold-fd"], fds["--step-fd"])  # type: ignore[misc]
    from certkv.cli.app import main as certkv_main

    sys.argv = ["certkv", *argv]
    certkv_main()


if __name__ == "__main__":
    main(sys.argv[1:])
