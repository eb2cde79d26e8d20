"""Shared fixtures. Tests run offline: the embedded model ships inside the package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `certkv ARGS` in a fresh interpreter, as a user would."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "certkv.cli.app", *args],
        cwd=cwd or REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_main(*args: str) -> int:
    """Run `certkv ARGS` in this process (fast, no interpreter start); returns the exit code."""
    from certkv.cli.app import main

    old = sys.argv
    sys.argv = ["certkv", *args]
    try:
        main()
        return 0
    except SystemExit as exc:
        return 0 if exc.code is None else int(exc.code)
    finally:
        sys.argv = old


@pytest.fixture(scope="session")
def embedded():
    """The embedded model and tokenizer, loaded once per test session."""
    import torch

    from certkv.model.loading import load_model

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return load_model("embedded", device="cpu")
