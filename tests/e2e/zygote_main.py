"""The zygote of tests/e2e/forked_processes.py: import the model stack, then fork one process per job.

Run as a script by :class:`forked_processes.Zygote`. It reads one JSON job a line on stdin and
answers on the pipe it was given as stdout: ``{"ready": true}`` once imported, ``{"pid": P}``
for each fork, in the order of the jobs, and ``{"exit": P, "code": C}`` when it reaps one (C as
``Popen.returncode``: ``-N`` for signal N). Its own fd 1 then points at /dev/null, so nothing a
library prints can garble those lines. Its stdin closing ends it.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import sys
import threading
import traceback

import torch
import transformers  # noqa: F401  (what every forked process imports first)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

import certkv.cli.app
import certkv.cli.serve  # noqa: F401
import certkv.model.loading  # noqa: F401
import certkv.runtime.certified_runtime  # noqa: F401
import certkv.serve.app  # noqa: F401


def _redirect(job: dict) -> None:
    """The child's working folder, environment, thread count and fds 0-2 (the job's files, appended)."""
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own streams
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    if "OMP_NUM_THREADS" in job["env"]:  # what a fresh interpreter's torch reads when it starts
        torch.set_num_threads(int(job["env"]["OMP_NUM_THREADS"]))
    sys.argv = job["argv"]


def _child(job: dict, inherited: tuple[int, ...]) -> None:
    """Run `job` in the forked child and leave as a fresh interpreter would: atexit handlers and
    non-daemon threads finished, SystemExit's code, 1 after a traceback, killed by SIGINT after an
    uncaught KeyboardInterrupt. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        _redirect(job)
        try:
            if job["script"]:
                sys.path[0] = os.path.dirname(os.path.abspath(job["script"]))
                runpy.run_path(job["script"], run_name="__main__")
            else:
                certkv.cli.app.main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except KeyboardInterrupt:
            code = -signal.SIGINT
        except BaseException:  # noqa: BLE001 - printed as the interpreter would, then exit 1
            traceback.print_exc()
        threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as at exit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - leaving regardless
                pass
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _reap(children: set[int], out) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        out.write(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")


def main() -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    children: set[int] = set()
    out.write('{"ready": true}\n')
    pending = b""
    while True:
        ready, _, _ = select.select([0, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(children, out)
        if 0 not in ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            job = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(job, (wake_r, wake_w, out.fileno()))
            children.add(pid)
            out.write(json.dumps({"pid": pid}) + "\n")


if __name__ == "__main__":
    main()
