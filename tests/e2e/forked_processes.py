"""Model-loading test processes forked from one interpreter that has imported the model stack already.

A process that loads a model spends about 7 CPU-seconds importing torch, transformers and kvpress
before it does anything, and the suite starts dozens on two cores. So a test worker starts one
*zygote* once: a fresh interpreter (the tests' environment, nothing computed, no model loaded)
that imports what ``certkv serve`` and ``certkv calibrate`` import, and then waits. Each process
is a fork of it that takes its own working folder, environment, output files, thread count and
arguments and runs either the CLI's ``main()`` (the ``certkv serve`` servers, :func:`forked`),
exactly as ``python -m certkv.cli.app …`` does after its imports, or a test's script as
``__main__`` (the children the tests kill mid-calibration, :func:`run_script`). Each is a real
process, signalled, killed and restarted as the tests do to any. Only the import phase is shared;
what importing costs or leaves behind is tested where it matters (the wheel's demo, the console
script's usage errors, the torch-free checks, a copied package's signal), which never use this.

The zygote is their parent, so it reaps them and reports each exit status on its stdout;
:class:`ForkedProcess` is the tests' ``Popen``-like handle. ``CERTKV_TEST_NO_FORK=1`` turns it off
(every process then starts as a fresh interpreter).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

#: The zygote: imports, then forks one process per request line until its stdin closes.
ZYGOTE = r"""
import json, os, runpy, select, signal, sys, traceback
import torch, transformers, kvpress  # noqa: F401  (what every server imports first)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
import certkv.cli.app, certkv.cli.serve, certkv.serve.app, certkv.model.loading  # noqa: F401
import certkv.runtime.certified_runtime, uvicorn, fastapi, prometheus_client  # noqa: F401

wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.signal(signal.SIGCHLD, lambda *_: None)
signal.set_wakeup_fd(wake_w)
out = os.fdopen(os.dup(1), "w", buffering=1)
children = set()


def reap():
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        out.write(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")


def run(job):
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in (wake_r, wake_w, out.fileno()):
        os.close(fd)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        out_fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(out_fd, fd)
        os.close(out_fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if "OMP_NUM_THREADS" in job["env"]:  # what a fresh interpreter's torch would read at its start
        torch.set_num_threads(int(job["env"]["OMP_NUM_THREADS"]))
    sys.argv = job["argv"]
    code = 0
    try:
        if job["script"]:
            sys.path[0] = os.path.dirname(os.path.abspath(job["script"]))
            runpy.run_path(job["script"], run_name="__main__")
        else:
            certkv.cli.app.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


out.write('{"ready": true}\n')
pending = b""
while True:
    ready, _, _ = select.select([0, wake_r], [], [])
    if wake_r in ready:
        os.read(wake_r, 4096)
    reap()
    if 0 not in ready:
        continue
    chunk = os.read(0, 65536)
    if not chunk:
        break
    pending += chunk
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run(job)
        children.add(pid)
        out.write(json.dumps({"pid": pid}) + "\n")
"""


class ForkedProcess:
    """What the tests use of ``subprocess.Popen`` for a server the zygote forked: its ``pid``,
    ``returncode`` (None while it runs; ``-N`` for signal N, as Popen), ``poll``, ``wait``,
    ``send_signal``, ``terminate`` and ``kill``."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None
        self._exited = threading.Event()

    def _exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked server {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # exited; the zygote's report is on its way
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The zygote of this test process, started on first use (module docstring)."""

    def __init__(self) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=Path(__file__).resolve().parents[2], env=env, text=True, bufsize=1)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        line = self.proc.stdout.readline()
        assert json.loads(line or "{}").get("ready"), f"the server zygote did not start (exit {self.proc.wait()})"
        self._lock = threading.Lock()
        self._started: dict[int, ForkedProcess] = {}
        self._pid_given = threading.Condition(self._lock)
        self._given: list[int] = []
        self._early: dict[int, int] = {}  # exits reported before their handle was made
        threading.Thread(target=self._read, name="server-zygote", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._lock:
                if "pid" in msg:
                    self._given.append(msg["pid"])
                    self._pid_given.notify_all()
                elif msg["exit"] in self._started:
                    self._started.pop(msg["exit"])._exit(msg["code"])
                else:
                    self._early[msg["exit"]] = msg["code"]

    def spawn(self, argv: list[str], cwd: Path, env: dict[str, str], stdout: Path, stderr: Path,
              script: Path | None = None) -> ForkedProcess:
        """Fork a process running ``certkv ARGV`` (or `script` with arguments `argv`) in `cwd` with
        exactly `env`, its output appended to `stdout` and `stderr` (which exist)."""
        assert self.proc.stdin is not None
        job = {"argv": [str(script) if script else "certkv", *argv], "script": str(script) if script else None,
               "cwd": str(cwd), "env": env, "stdout": str(stdout), "stderr": str(stderr)}
        with self._lock:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            if not self._pid_given.wait_for(lambda: self._given, timeout=60):
                raise AssertionError("the zygote forked nothing within 60 s")
            handle = ForkedProcess(self._given.pop(0))
            if handle.pid in self._early:
                handle._exit(self._early.pop(handle.pid))
            else:
                self._started[handle.pid] = handle
        return handle

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


_zygote: Zygote | None = None


def _the_zygote() -> Zygote | None:
    global _zygote
    if os.environ.get("CERTKV_TEST_NO_FORK"):
        return None
    if _zygote is None:
        _zygote = Zygote()
    return _zygote


def forked(argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> ForkedProcess | None:
    """A forked ``certkv ARGV`` server writing to `log`, or None where forking is off (``CERTKV_TEST_NO_FORK``)."""
    zygote = _the_zygote()
    return None if zygote is None else zygote.spawn(argv, cwd, env, log, log)


def run_script(script: Path, args: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([python, SCRIPT, *ARGS], capture_output=True, text=True)``, forked from the
    zygote unless forking is off: the script's code, which loads a model, runs as ``__main__``."""
    zygote = _the_zygote()
    if zygote is None:
        return subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        out.touch()
        err.touch()
        proc = zygote.spawn(args, cwd, env, out, err, script=script)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess([str(script), *args], code, out.read_text(), err.read_text())


def close() -> None:
    """Stop this test process's zygote (its servers were stopped by their tests)."""
    global _zygote
    if _zygote is not None:
        _zygote.close()
        _zygote = None
