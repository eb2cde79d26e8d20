"""`certkv calibrate --executor ray` on a local Ray cluster started here (``ray.init(num_cpus=2)``).

The records of a Ray run equal a local run's (timings aside), with its workers, with workers
killed mid-run (Ray restarts them and their requests run again: none lost, none duplicated) and
after the driver itself is killed and rerun; with a worker Ray cannot place (the others do the run)
and with workers killed for good (the others take their requests; none left: one line). A worker
whose model or device differs from the store's is refused. The tests that need Ray are marked
``ray`` and skipped without it; the missing-extra error and the option checks run everywhere (they
need no Ray).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_here

#: Enough for every kill below to land mid-run (the last after the 8th write, with requests still
#: to hand out); each request more is compute on every Ray run of the module, and none checks more.
N_REQUESTS = 12
#: Timing columns differ between runs; everything a certificate reads must not.
VOLATILE = {"seconds", "seconds_breakdown"}

CONTRACT = {
    "name": "raytest",
    "model": "embedded",
    "requests": {"source": "requests.jsonl"},
    "protocol": {"max_new_tokens": 8, "device": "cpu"},
    "utility": "exact_match",
    "tolerance": 0.0,
    "risk": 0.2,
    "confidence": 0.9,
    "policies": [
        {"press": "snapkv", "kv_retained": [0.5, 0.3]},
        {"press": "streaming_llm", "kv_retained": [0.4]},
    ],
    "gate": {"agreement_drop": [0.05]},  # the gate signal travels back from the workers too
    "store": "store",
}

ray_test = pytest.mark.ray


def _setup(folder: Path) -> Path:
    from certkv.requests.request_set import generate_requests, write_jsonl

    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(generate_requests("demo", N_REQUESTS, seed=515, context_length="200-320"), folder / "requests.jsonl")
    path = folder / "contract.yaml"
    path.write_text(yaml.safe_dump(CONTRACT))
    return path


def _records(folder: Path) -> list[dict]:
    from certkv.calibration.store import CalibrationStore

    with CalibrationStore.read(folder / "store") as store:
        rows = [{k: v for k, v in r.items() if k not in VOLATILE} for r in store.records()]
    return sorted(rows, key=lambda r: (r["request_id"], r["policy"]))


def _assert_same(got: list[dict], expected: list[dict]) -> None:
    keys = [(r["request_id"], r["policy"]) for r in got]
    assert len(keys) == len(set(keys)), "a request's rows were written twice"
    assert len({r["request_id"] for r in got}) == N_REQUESTS, "requests are missing"
    if got != expected:  # name the first difference: a long diff is unreadable
        diff = next((g, e) for g, e in zip(got, expected) if g != e)
        raise AssertionError(f"Ray records differ from the local run's: {diff}")


def _threads(n: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def local_records(tmp_path_factory):
    """The local executor's records, on one thread as every Ray worker (float rounding depends on it)."""
    from certkv.calibration.run import calibrate
    from certkv.contract.loading import load_contract

    folder = tmp_path_factory.mktemp("local")
    before = _threads(1)
    try:
        summary = calibrate(load_contract(_setup(folder)), quiet=True)
    finally:
        _threads(before)
    assert summary.calibrated == N_REQUESTS
    return _records(folder)


def _ray_calibrate(contract_path: Path, on_written=None, **options):
    from certkv.calibration.ray_executor import RayExecutor, RayOptions
    from certkv.calibration.run import calibrate
    from certkv.contract.loading import load_contract

    return calibrate(load_contract(contract_path), executor=RayExecutor(RayOptions(**options)), quiet=True,
                     on_written=on_written)


@ray_test
def test_killed_workers_are_restarted_or_leave_their_requests_nothing_lost_or_duplicated(cluster, local_records,
                                                                                        tmp_path):
    """Three kills while requests are in flight, each right after a given write (the run's
    `on_written` hook): one through Ray (ray.kill, restart allowed) and one a SIGKILL of the
    worker's process, which Ray restarts and whose requests run again; then the first worker killed
    for good (ray.kill, no restart), whose requests the other takes."""
    from certkv.calibration.ray_executor import WORKER_NAME

    ray = cluster
    kills = {2: "ray.kill", 5: "SIGKILL", 8: "for good"}  # after this many writes: 4 left for the survivor
    done = []

    def kill_after_write(summary, request_id):
        how = kills.get(summary.calibrated + len(summary.skipped))
        if how is None:
            return
        names = sorted(n for n in ray.util.list_named_actors() if n.startswith(WORKER_NAME))
        actor = ray.get_actor(names[len(done) % len(names)])
        if how == "SIGKILL":
            os.kill(ray.get(actor.ping.remote()), signal.SIGKILL)
        else:
            ray.kill(actor, no_restart=how == "for good")
        done.append(how)

    summary = _ray_calibrate(_setup(tmp_path), on_written=kill_after_write, workers=2)
    assert done == ["ray.kill", "SIGKILL", "for good"], "every kill must land mid-run"
    assert summary.calibrated == N_REQUESTS
    assert summary.worker_restarts >= 1, "a killed worker came back (a new pid answered)"
    _assert_same(_records(tmp_path), local_records)


class _Hung(Exception):
    """Raised by :func:`_fails_if_hung`'s alarm: its own type, so no ``except TimeoutError`` of the
    code under test swallows it."""


@contextlib.contextmanager
def _fails_if_hung(seconds: int, what: str):
    """Fail (not hang) when the block has not returned after `seconds`: the regression this guards
    against is a run that waits forever. The limit is far above a healthy run's few seconds; it
    is a deadline for a failure, not a timing the test asserts."""

    def alarm(signum, frame):
        raise _Hung(f"{what} did not finish in {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    except _Hung as exc:
        pytest.fail(str(exc))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@ray_test
def test_workers_write_the_local_runs_records_and_one_ray_cannot_place_holds_nothing_up(cluster, local_records,
                                                                                       tmp_path):
    """Three workers of one CPU each on the two CPUs of the cluster: the third stays pending for as
    long as the other two live, so the run must be done by the workers that have loaded; their
    records are the local run's, and the store binds the model and device they reported."""
    from certkv.calibration.store import CalibrationStore
    from certkv.model.loading import model_fingerprint

    with _fails_if_hung(seconds=600, what="a run with a worker Ray cannot place"):
        summary = _ray_calibrate(_setup(tmp_path), workers=3, threads_per_worker=1)
    assert summary.executor == "ray" and summary.workers == 3
    assert summary.calibrated == N_REQUESTS and not summary.skipped
    _assert_same(_records(tmp_path), local_records)
    with CalibrationStore.read(tmp_path / "store") as store:
        meta = store.meta()
    assert meta["model_fingerprint"] == model_fingerprint("embedded") and meta["device_type"] == "cpu"


def _kill_for_good(ray, after: int, how_many: int, done: list):
    """An `on_written` hook: right after the `after`-th write, kill `how_many` workers through Ray
    with no restart (their in-flight calls then fail with ActorDiedError)."""
    from certkv.calibration.ray_executor import WORKER_NAME

    def hook(summary, request_id):
        if summary.calibrated + len(summary.skipped) != after:
            return
        names = sorted(n for n in ray.util.list_named_actors() if n.startswith(WORKER_NAME))
        for name in names[:how_many]:
            ray.kill(ray.get_actor(name), no_restart=True)
            done.append(name)

    return hook


@ray_test
def test_every_worker_killed_for_good_stops_the_run_with_one_line(cluster, local_records, tmp_path):
    from certkv.calibration.ray_executor import ALL_DIED
    from certkv.errors import CertkvError

    done: list[str] = []
    with pytest.raises(CertkvError) as info:
        _ray_calibrate(_setup(tmp_path), on_written=_kill_for_good(cluster, 3, 2, done), workers=2)
    assert len(done) == 2 and str(info.value) == ALL_DIED
    stored = _records(tmp_path)
    ids = {r["request_id"] for r in stored}
    assert 3 <= len(ids) < N_REQUESTS, "the requests written before the kills are kept"
    assert stored == [r for r in local_records if r["request_id"] in ids], "what is stored is the local run's"


#: The driver is stopped right after this many requests were written.
STOP_AFTER = 2
#: `certkv calibrate --executor ray` in a child interpreter that sends itself `signum` the moment
#: its STOP_AFTER-th request's write returns: a trace hook on the store write, as
#: tests/e2e/test_interrupts.py raises its signals at traced instants, so the stop lands mid-run
#: whatever the machine's speed.
STOPPED_DRIVER = """
import os, sys
import certkv.calibration.run as run
from certkv.cli.app import main

contract, signum, after, address = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
code = run.record_request.__code__
writes = 0

def on_return(frame, event, arg):
    global writes
    if event == "return":
        writes += 1
        if writes == after:
            os.kill(os.getpid(), signum)
    return on_return

sys.settrace(lambda frame, event, arg: on_return if frame.f_code is code else None)
sys.argv = ["certkv", "calibrate", contract, "--quiet", "--executor", "ray", "--workers", "1", "--address", address]
main()
"""


def _stop_driver(contract: Path, signum: int, address: str) -> tuple[int, str]:
    """Run :data:`STOPPED_DRIVER` on `contract` in its own process, a driver of the Ray cluster at
    `address` (``certkv calibrate --address``), stopped by `signum` right after its STOP_AFTER-th
    write; its exit code and stderr."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(
        [sys.executable, "-c", STOPPED_DRIVER, str(contract), str(int(signum)), str(STOP_AFTER), address],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it started that outlived it
        except ProcessLookupError:
            pass
    return proc.returncode, err.decode()


def _wait_until_no_worker(ray, seconds: float = 120.0) -> None:
    """Return once the cluster lists no certkv worker; fail after `seconds` (a deadline for a
    failure: Ray ends a gone driver's actors within moments)."""
    import time

    from certkv.calibration.ray_executor import WORKER_NAME

    def workers() -> list[str]:  # the driver ran as a job of its own, in a namespace of its own
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(WORKER_NAME)]

    deadline = time.monotonic() + seconds
    while workers():
        assert time.monotonic() < deadline, "the stopped driver's workers outlived it"
        time.sleep(0.2)


@ray_test
def test_stopped_driver_resumes_to_the_local_runs_records(cluster, local_records, tmp_path):
    """The driver stopped mid-run, right after its second write (:data:`STOPPED_DRIVER`), by
    SIGTERM, which it must turn into exit 143 and certkv's one line (Ray's own SIGTERM handler would
    exit 15), with its workers ended (it is a driver of the module's cluster, ``--address``, and Ray
    ends the actors of a driver that is gone); the rerun resumes where it stopped and
    completes the store to the local run's records. (Ctrl-C reaches the same interrupt path as on a
    local run, tests/cli/test_cli_usage_errors.py; a killed driver leaves the store as a killed
    local run does: the driver alone writes, one transaction per request, and SIGKILL at every
    point of a write is tested on the local run, tests/e2e/test_calibrate_cli.py.)"""
    from certkv.calibration.store import CalibrationStore

    contract = _setup(tmp_path)
    for stops, signum in enumerate((signal.SIGTERM,), start=1):
        code, err = _stop_driver(contract, signum, cluster.get_runtime_context().gcs_address)
        assert code == 128 + signum, (signum, code, err[-2000:])
        assert "Traceback" not in err, err[-2000:]
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines and lines[-1] == "certkv: interrupted; everything stored so far is kept (rerun to resume)", err
        with CalibrationStore.read(tmp_path / "store") as store:
            partial = store.request_count()
        # nothing is written after a stop, and each run resumed after the last one's writes
        assert partial == stops * STOP_AFTER, f"{partial} stored after stop {stops} ({signum!r}; {err[-500:]})"
    assert partial < N_REQUESTS, "the stops must land mid-run"
    _wait_until_no_worker(cluster)
    summary = _ray_calibrate(contract, workers=1)  # one worker: the resume is what is checked
    assert summary.already_done == partial and summary.calibrated == N_REQUESTS - partial
    _assert_same(_records(tmp_path), local_records)


@ray_test
def test_a_worker_whose_model_differs_from_the_store_is_refused(cluster, tmp_path):
    """The store binds the model fingerprint and the device type (one check for both, the first
    test shows both bound): a worker that reports another model is refused."""
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract
    from certkv.errors import CertkvError

    fact, value = "model_fingerprint", "embedded#0000000000000000"
    contract = _setup(tmp_path)
    with CalibrationStore.open(tmp_path / "store", load_contract(contract)) as store:
        store.bind({fact: value})
    with pytest.raises(CertkvError) as info:
        _ray_calibrate(contract, workers=1)
    message = str(info.value)
    assert "\n" not in message and "refused" in message and fact in message and value in message
    with CalibrationStore.read(tmp_path / "store") as store:
        assert store.count() == 0 and not store.skipped(), "a refused worker's rows must not be written"


@pytest.mark.parametrize("fact", ["model_fingerprint", "device_type"])
def test_each_fact_a_worker_reports_is_held_to_the_store(tmp_path, fact):
    """The refusal above, for each fact, without Ray: a fresh store binds what the first worker
    reports, a worker that reports the same passes, one that differs in either fact is refused."""
    from certkv.calibration.ray_executor import WORKER_FACTS, _check_facts
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract
    from certkv.errors import CertkvError

    first = {"model_fingerprint": "embedded#0123456789abcdef", "device_type": "cpu"}
    with CalibrationStore.open(tmp_path / "store", load_contract(_setup(tmp_path))) as store:
        bound: dict = {}
        _check_facts(store, bound, first, "worker 0")
        assert bound == first and {k: store.meta()[k] for k in WORKER_FACTS} == first
        _check_facts(store, bound, dict(first), "worker 1")
        with pytest.raises(CertkvError, match=f"worker 2 has {fact} 'other', store .* records '{first[fact]}'"):
            _check_facts(store, bound, {**first, fact: "other"}, "worker 2")


def test_without_the_extra_executor_ray_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """In this process, with ``ray`` made unimportable (certkv imports it only when asked)."""
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    res = run_here(capsys, "calibrate", str(_setup(tmp_path)), "--executor", "ray")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ['certkv: error: --executor ray needs Ray, an optional extra: '
                                               'pip install "certkv[ray]"']
    assert not (tmp_path / "store").exists(), "nothing is created before the extra is found missing"


@pytest.mark.parametrize("args, fragment", [
    (["--workers", "2"], "--workers needs --executor ray"),
    (["--address", "auto", "--gpus-per-worker", "1"], "--address, --gpus-per-worker need --executor ray"),
    (["--executor", "dask"], "--executor must be local or ray"),
])
def test_ray_options_without_the_ray_executor_are_refused(tmp_path, args, fragment, monkeypatch, capsys):
    """Refused before anything runs, so in this process (a child interpreter each would cost seconds)."""
    from certkv.cli.app import main

    monkeypatch.setattr(sys, "argv", ["certkv", "calibrate", str(_setup(tmp_path)), *args])
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err
    assert info.value.code == 2 and fragment in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "store").exists()
