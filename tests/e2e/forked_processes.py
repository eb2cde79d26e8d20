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

The zygote (tests/e2e/zygote_main.py) is their parent, so it reaps them and reports each exit
status on its stdout; :class:`ForkedProcess` is the tests' ``Popen``-like handle. Should the
zygote end early, every process it forked and not yet reported is taken as ended (code -1), so a
test fails instead of waiting forever. ``CERTKV_TEST_NO_FORK=1`` turns it off (every process then
starts as a fresh interpreter).
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

ZYGOTE_MAIN = Path(__file__).resolve().parent / "zygote_main.py"
#: A zygote that ended early leaves the processes it did not report with this code.
LOST = -1


class ForkedProcess:
    """What the tests use of ``subprocess.Popen`` for a process the zygote forked: its ``pid``,
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
            raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout or 0)
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
    """The zygote of this test process (module docstring), started with environment `env`."""

    def __init__(self, env: dict[str, str]) -> None:
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed with the zygote
        self.proc = subprocess.Popen([sys.executable, str(ZYGOTE_MAIN)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, cwd=ZYGOTE_MAIN.parents[2], env=env, text=True, bufsize=1)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        line = self.proc.stdout.readline()
        if not line.startswith('{"ready"'):
            self._stderr.seek(0)
            raise AssertionError(f"the zygote did not start (exit {self.proc.wait()}): {self._stderr.read()[-3000:]}")
        self._spawning = threading.Lock()  # one job at a time: pids come back in the jobs' order
        self._lock = threading.Condition()
        self._given: list[int] = []
        self._started: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before their handle was made
        self._ended = False
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                with self._lock:
                    if "pid" in msg:
                        self._given.append(msg["pid"])
                        self._lock.notify_all()
                    elif msg.get("exit") in self._started:
                        self._started.pop(msg["exit"])._exit(msg["code"])
                    elif "exit" in msg:
                        self._early[msg["exit"]] = msg["code"]
        finally:
            with self._lock:
                self._ended = True
                for handle in self._started.values():
                    handle._exit(LOST)
                self._started.clear()
                self._lock.notify_all()

    def spawn(self, argv: list[str], cwd: Path, env: dict[str, str], stdout: Path, stderr: Path,
              script: Path | None = None) -> ForkedProcess:
        """Fork a process running ``certkv ARGV`` (or `script` with arguments `argv`) in `cwd` with
        exactly `env`, its output appended to `stdout` and `stderr` (which exist)."""
        assert self.proc.stdin is not None
        job = {"argv": [str(script) if script else "certkv", *argv], "script": str(script) if script else None,
               "cwd": str(cwd), "env": env, "stdout": str(stdout), "stderr": str(stderr)}
        with self._spawning:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            with self._lock:
                if not self._lock.wait_for(lambda: self._given or self._ended, timeout=60) or not self._given:
                    raise AssertionError("the zygote forked nothing (it ended, or took over 60 s)")
                handle = ForkedProcess(self._given.pop(0))
                if handle.pid in self._early:
                    handle._exit(self._early.pop(handle.pid))
                else:
                    self._started[handle.pid] = handle
        return handle

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(60)
        self.proc.stdout.close()
        self._stderr.close()


_zygote: Zygote | None = None
_environment: dict[str, str] | None = None


def prepare() -> None:
    """Fix the zygote's environment now (the session's start), not at its first use, when a test
    may have changed ``os.environ``: what the imports read once is read from this."""
    global _environment
    _environment = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")


def _the_zygote() -> Zygote | None:
    global _zygote
    if os.environ.get("CERTKV_TEST_NO_FORK"):
        return None
    if _zygote is None:
        if _environment is None:
            prepare()
        assert _environment is not None
        _zygote = Zygote(_environment)
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
    """Stop this test process's zygote (its processes were stopped by their tests)."""
    global _zygote
    if _zygote is not None:
        _zygote.close()
        _zygote = None
