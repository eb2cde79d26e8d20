"""Real ``certkv serve`` upstreams of the embedded model and a ``certkv gateway`` in front of them.

What the endpoint and gateway tests (tests/e2e/test_endpoints.py) and the
gateway benchmark (benchmarks/gateway.py) both start: a full-cache point and a snapkv point of the
embedded model, each a ``certkv serve`` process on a port of its own, an endpoint contract naming
them, and the gateway process. Kept here, beside the benchmarks (on pytest's ``pythonpath``), so a
benchmark need not import test files and the tests and the benchmark start the same servers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]

#: The endpoint contract's terms (the tests' small risk budget: a handful of requests certify a point).
TERMS = {"requests": {"source": "requests.jsonl"}, "utility": "exact_match", "tolerance": 0.0, "risk": 0.5,
         "confidence": 0.6}


#: Where the tests start ``certkv serve`` instead of a fresh interpreter (their forked servers,
#: tests/e2e/forked_processes.py): ``FORK(argv, cwd, env, log)`` gives a Popen-like handle, or None
#: to start it as usual. Unset here: the benchmarks start every process fresh.
FORK: Callable[[list[str], Path, dict[str, str], Path], Any] | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_point():
    """The embedded model's full cache as a fallback point (what the full upstream serves)."""
    from certkv.core.certify import full_cache_point
    from certkv.core.coverage import Coverage
    from certkv.core.spec import CertificationSpec

    spec = CertificationSpec(tolerance=0.0, risk=0.5, confidence=0.6, sequences=[["p@0.50"]], max_new_tokens=8)
    return full_cache_point(spec, n=1, reason="the reference", guarantee="test", notes=[], per_task={},
                            coverage=Coverage(), contract_sha256=None, records_sha256="test")


def snapkv_point(kv: float = 0.5, risk: float = 0.5, confidence: float = 0.9):
    """SnapKV keeping `kv` of the cache, ungated, 8 new tokens (what the candidate upstream serves)."""
    from certkv.core.operating_point import ContractSummary, OperatingPoint

    policy = f"snapkv@{kv:.2f}"
    return OperatingPoint(
        policy=policy, base_policy=policy, press="snapkv", kv_retained=kv, mean_kv_retained=kv, fallback=False,
        contract=ContractSummary(tolerance=0.0, risk=risk, confidence=confidence, procedure="fixed_sequence",
                                 utility="agreement"),
        n=4, violations=0, empirical_risk=0.0, risk_upper_bound=risk, p_value=0.01, candidates=[], sequences=[],
        guarantee="test", created="now", certkv_version="test", gate=None, max_new_tokens=8,
    )


def endpoint_contract(folder: Path, name: str, full_url: str, snap_url: str) -> Path:
    """An endpoint contract comparing the snapkv upstream (label snapkv, memory 0.5) with the full one."""
    data = {"name": name, **TERMS, "model": {"endpoint": full_url, "name": "embedded"},
            "protocol": {"max_new_tokens": 8, "route": "chat"},
            "policies": [{"endpoint": {"url": snap_url, "name": "embedded"}, "label": "snapkv", "memory": 0.5}]}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Process:
    """A server process (``python -m MODULE ARGS --port PORT``, certkv's CLI by default) logging to
    `folder`/`log_name`; :meth:`wait` until its :attr:`ready_path` answers 200. `command` replaces
    ``python -m MODULE`` (a launcher), `env` adds to the environment, `pass_fds` are inherited."""

    #: The route that answers 200 once the server is up.
    ready_path = "/health"

    def __init__(self, folder: Path, log_name: str, args: list[str], port: int, module: str = "certkv.cli.app", *,
                 command: list[str] | None = None, env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.log = open(folder / log_name, "w+")  # noqa: SIM115 - closed with the process
        environment = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", **(env or {}))
        argv = [*args, "--port", str(port)]
        forkable = command is None and not pass_fds and module == "certkv.cli.app" and args[0] == "serve"
        forked = FORK(argv, REPO, environment, folder / log_name) if FORK is not None and forkable else None
        self.proc = forked or subprocess.Popen([*(command or [sys.executable, "-m", module]), *argv], cwd=REPO,
                                               env=environment, stdout=self.log, stderr=subprocess.STDOUT, pass_fds=pass_fds)

    def wait(self, timeout: float = 180.0):
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(self.base + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError("server did not start: " + self.output())

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def kill(self) -> None:
        """SIGKILL, as a crash: no graceful shutdown."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Upstream(Process):
    """``certkv serve POINT`` on `port` (a free one by default), no shadows; ``url`` ends in /v1."""

    def __init__(self, folder: Path, op, port: int | None = None, *args: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        point = str(op.write_json(folder / "operating_point.json"))
        super().__init__(folder, "server.log", ["serve", point, "--shadow-rate", "0", *args], port or free_port())
        self.url = self.base + "/v1"


class Gateway(Process):
    """``certkv gateway POINT ARGS`` on a free port; ``url`` is its base (no /v1)."""

    def __init__(self, folder: Path, point: Path, *args: str) -> None:
        super().__init__(folder, "gateway.log", ["gateway", str(point), *args], free_port())
        self.url = self.base

    def health(self) -> dict:
        import httpx

        return httpx.get(self.url + "/health", timeout=10).json()
