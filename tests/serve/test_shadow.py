"""Shadows of served answers: the loss calibration would record, the monitor's verdict, the store.

A tiny contract is calibrated into a real store; an operating point built from its candidates
serves every calibration request with CertifiedRuntime, and each evicted answer is shadowed. The
shadow's full answer, utilities and loss must be the calibration store's record for that request and
policy; the monitor must get the verdict ``loss > τ``; a failing shadow abandons its ticket; the
shadow store survives SIGKILLs (whole shadows or none) and its export certifies under a contract
naming the deployed base policy, gated or not.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_main

N_REQUESTS = 10
POLICY = "snapkv@0.30"
DROPS = [-1.0, 0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4]


def _write_contract(folder: Path, *, policies: list[dict], gate: dict | None = None, store: str = "store",
                    name: str = "shadow") -> Path:
    contract = {
        "name": name,
        "model": "embedded",
        "requests": {"source": "requests.jsonl"},
        "protocol": {"max_new_tokens": 8, "device": "cpu"},
        "utility": "exact_match",
        "tolerance": 0.0,
        "risk": 0.6,  # lenient: the point is the plumbing, not power
        "confidence": 0.6,
        "policies": policies,
        "store": store,
    }
    if gate:
        contract["gate"] = gate
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(contract))
    return path


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, embedded):
    """A calibrated store of snapkv@0.30 with an agreement-drop grid, and its records by (id, policy)."""
    from certkv.calibration.run import calibrate
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract
    from certkv.requests.request_set import generate_requests, read_jsonl, write_jsonl

    folder = tmp_path_factory.mktemp("shadow")
    write_jsonl(generate_requests("demo", N_REQUESTS, seed=515, context_length="200-320"), folder / "requests.jsonl")
    path = _write_contract(folder, policies=[{"press": "snapkv", "kv_retained": [0.3]}],
                           gate={"agreement_drop": DROPS})
    contract = load_contract(path)
    summary = calibrate(contract, quiet=True)
    assert summary.calibrated == N_REQUESTS and not summary.skipped
    with CalibrationStore.read(folder / "store") as store:
        records = {(r["request_id"], r["policy"]): r for r in store.records()}
    drops = [records[(r, POLICY)]["agreement_drop"] for r, p in records if p == POLICY]
    threshold = min(DROPS, key=lambda t: abs(t - statistics.median(drops)))
    return folder, read_jsonl(folder / "requests.jsonl"), records, threshold


def _operating_point(gate: dict | None = None):
    from certkv.core.operating_point import ContractSummary, OperatingPoint
    from certkv.core.spec import GateSettings

    policy = POLICY if not gate else f"{POLICY}+drop{format(gate['agreement_drop'], 'g')}"
    return OperatingPoint(
        policy=policy, base_policy=POLICY, press="snapkv", kv_retained=0.3, mean_kv_retained=0.3, fallback=False,
        gate=GateSettings(**gate) if gate else None, max_new_tokens=8,
        contract=ContractSummary(tolerance=0.0, risk=0.6, confidence=0.6, procedure="fixed_sequence",
                                 utility="exact_match"),
        n=N_REQUESTS, violations=0, empirical_risk=0.0, risk_upper_bound=0.6, p_value=0.1, candidates=[],
        sequences=[], guarantee="test", created="now", certkv_version="test", contract_sha256="c" * 64,
    )


class StubMonitor:
    """Records what the runner tells it (the real RiskMonitor is tested in test_monitor.py)."""

    def __init__(self):
        self.completed: dict[int, bool] = {}
        self.abandoned: list[int] = []

    def complete(self, ticket: int, violated: bool) -> None:
        assert ticket not in self.completed and ticket not in self.abandoned
        self.completed[ticket] = violated

    def abandon(self, ticket: int) -> None:
        assert ticket not in self.completed and ticket not in self.abandoned
        self.abandoned.append(ticket)


def _serve_and_shadow(embedded, requests, op, store, monitor, *, answers: bool = True):
    """Serve every request; shadow each evicted answer. Returns [(request, served, record)]."""
    from certkv.runtime.certified_runtime import CertifiedRuntime
    from certkv.serve.shadow import ShadowJob, ShadowRunner

    model, tok = embedded
    runtime = CertifiedRuntime(model, tok, op)
    runner = ShadowRunner(runtime, monitor, store)
    out = []
    for ticket, request in enumerate(requests):
        served = runtime.generate(request.context, request.question, request.task)
        if served.decision.mode != "evicted":
            out.append((request, served, None))
            continue
        job = ShadowJob(request_id=request.id, stream="all", stratum=request.task, context=request.context,
                        question=request.question, answers=list(request.answers) if answers else None,
                        served=served, ticket=ticket)
        out.append((request, served, runner.run(job)))
    return out


@pytest.fixture(scope="module")
def shadowed(calibrated, embedded, tmp_path_factory):
    """The ungated point served and shadowed into a shadow store (closed afterwards)."""
    from certkv.serve.shadow_store import ShadowStore

    folder, requests, records, _ = calibrated
    shadow_dir = tmp_path_factory.mktemp("live") / "shadows"
    monitor = StubMonitor()
    with ShadowStore(shadow_dir, _operating_point()) as store:
        results = _serve_and_shadow(embedded, requests, _operating_point(), store, monitor)
        assert store.count() == N_REQUESTS
    return shadow_dir, results, monitor


def test_shadow_loss_is_the_calibration_loss(calibrated, shadowed):
    _, _, records, _ = calibrated
    _, results, monitor = shadowed
    violations = 0
    for ticket, (request, served, record) in enumerate(results):
        full, base = records[(request.id, "full")], records[(request.id, POLICY)]
        assert served.answer == base["answer"]
        assert record["full_answer"] == full["answer"]
        assert record["utility_full"] == pytest.approx(full["utility"])
        assert record["utility"] == pytest.approx(base["utility"])
        assert record["loss"] == pytest.approx(base["loss"])
        assert record["violated"] is (base["loss"] > 0.0 + 1e-9)
        assert monitor.completed[ticket] is record["violated"]
        violations += record["violated"]
    assert not monitor.abandoned
    assert 0 < violations < N_REQUESTS, "snapkv@0.30 should break some requests and not others"


def test_without_references_the_loss_is_agreement(calibrated, embedded, tmp_path):
    from certkv.calibration.utility import agreement
    from certkv.serve.shadow_store import ShadowStore

    _, requests, records, _ = calibrated
    monitor = StubMonitor()
    with ShadowStore(tmp_path / "s", _operating_point()) as store:
        results = _serve_and_shadow(embedded, requests[:4], _operating_point(), store, monitor, answers=False)
    for request, _, record in results:
        full, base = records[(request.id, "full")], records[(request.id, POLICY)]
        assert record["utility_name"] == "agreement" and record["utility_full"] == 1.0
        assert record["loss"] == 1.0 - agreement(base["answer"], full["answer"])


def test_store_rows_follow_the_record_rule(calibrated, shadowed):
    from certkv.calibration.store import COLUMNS, CalibrationStore

    _, _, records, _ = calibrated
    shadow_dir, results, _ = shadowed
    with CalibrationStore.read(shadow_dir) as store:
        meta = store.meta()
        live = {(r["request_id"], r["policy"]): r for r in store.records()}
    assert meta["kind"] == "shadow" and meta["contract_sha256"].startswith("shadow:")
    assert meta["base_policy"] == POLICY and meta["calibration_contract_sha256"] == "c" * 64
    assert len(live) == 2 * N_REQUESTS
    for request, served, _ in results:
        full, base = live[(request.id, "full")], live[(request.id, POLICY)]
        calib = records[(request.id, POLICY)]
        for column in ("task", "utility", "utility_full", "loss", "answer", "press", "kv_retained"):
            assert base[column] == pytest.approx(calib[column]) if isinstance(calib[column], float) \
                else base[column] == calib[column], column
        assert base["kv_retained_actual"] == pytest.approx(calib["kv_retained_actual"])
        assert base["memory"] == 0.3 and full["memory"] == 1.0 and full["loss"] == 0.0
        assert full["context_tokens"] == records[(request.id, "full")]["context_tokens"]
        assert base["deployed_policy"] == POLICY and base["mode"] == "evicted" and base["stream"] == "all"
        assert base["confidence_min"] == pytest.approx(served.decision.confidence_min)
        assert list(base)[: len(COLUMNS)] == list(COLUMNS)


def test_gated_point_records_under_its_base_policy(calibrated, embedded, tmp_path):
    """A gated point's shadows are records of its base policy with the gate's signal; the requests the
    gate sent to the full cache were not shadowed."""
    from certkv.core.operating_point import load_operating_point
    from certkv.serve.shadow_store import ShadowStore

    folder, requests, records, threshold = calibrated
    op = _operating_point({"agreement_drop": threshold})
    monitor = StubMonitor()
    with ShadowStore(tmp_path / "gated", op) as store:
        results = _serve_and_shadow(embedded, requests, op, store, monitor)
        live = {(r["request_id"], r["policy"]): r for r in store.records()}
    gated = [r for r, served, rec in results if rec is None]
    assert 0 < len(gated) < N_REQUESTS
    for request, served, record in results:
        base = records[(request.id, POLICY)]
        if record is None:
            assert served.decision.reason == "gate" and (request.id, POLICY) not in live
            continue
        record = live[(request.id, POLICY)]
        assert record["loss"] == pytest.approx(base["loss"]) and record["deployed_policy"] == op.policy
        assert record["agreement_drop"] == pytest.approx(base["agreement_drop"], abs=1e-6)
        assert live[(request.id, "full")]["agreement_drop"] == record["agreement_drop"]
    # a contract with the deployed gate derives the gated candidate from the live records: every
    # shadowed request passed the gate, so it equals the base policy there
    csv = tmp_path / "gated.csv"
    assert run_main("export", str(tmp_path / "gated"), "-o", str(csv)) == 0
    contract = _write_contract(folder, policies=[{"press": "snapkv", "kv_retained": [0.3]}],
                               gate={"agreement_drop": [threshold]}, name="live_gated", store=str(tmp_path / "u"))
    assert run_main("certify", str(contract), "--records", str(csv), "-o", str(tmp_path / "op.json")) == 0
    result = {c.policy: c for c in load_operating_point(tmp_path / "op.json").candidates}
    shadowed = [rec for _, _, rec in results if rec is not None]
    assert result[op.policy].n == len(shadowed) and result[op.policy].gated_share == 0.0
    assert result[op.policy].violations == result[POLICY].violations == sum(r["violated"] for r in shadowed)


def test_an_exception_abandons_the_ticket(calibrated, embedded, tmp_path, monkeypatch):
    from certkv.errors import CertkvError
    from certkv.runtime.certified_runtime import CertifiedRuntime
    from certkv.serve.shadow import ShadowJob, ShadowRunner
    from certkv.serve.shadow_store import ShadowStore

    _, requests, _, _ = calibrated
    model, tok = embedded
    runtime = CertifiedRuntime(model, tok, _operating_point())
    monitor = StubMonitor()
    request = requests[0]
    served = runtime.generate(request.context, request.question)
    with ShadowStore(tmp_path / "s", _operating_point()) as store:
        runner = ShadowRunner(runtime, monitor, store)

        def boom(*args, **kwargs):
            raise RuntimeError("CUDA error: device lost")

        monkeypatch.setattr(runtime, "answer_from_full_cache", boom)
        job = ShadowJob(request.id, "all", None, request.context, request.question, None, served, ticket=7)
        with pytest.raises(CertkvError, match="abandoned: CUDA error") as info:
            runner.run(job)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert monitor.abandoned == [7] and not monitor.completed and store.count() == 0
        monkeypatch.undo()
        # the same job once the model works: completed and written; a second write of it is refused
        # after its verdict, which stays (a store failure never un-completes a ticket)
        job.ticket = 8
        assert runner.run(job)["request_id"] == request.id and 8 in monitor.completed
        job.ticket = 9
        with pytest.raises(CertkvError, match="verdict recorded, store write failed"):
            runner.run(job)
        assert 9 in monitor.completed and monitor.abandoned == [7] and store.count() == 1


def test_the_real_monitor_completes_the_ticket(calibrated, embedded, tmp_path):
    from certkv.core.monitor import RiskMonitor
    from certkv.runtime.certified_runtime import CertifiedRuntime
    from certkv.serve.shadow import ShadowJob, ShadowRunner

    _, requests, records, _ = calibrated
    model, tok = embedded
    runtime = CertifiedRuntime(model, tok, _operating_point())
    monitor = RiskMonitor(0.6, 0.4, 1.0)
    runner = ShadowRunner(runtime, monitor, None)
    for request in requests[:3]:
        served = runtime.generate(request.context, request.question)
        ticket = monitor.record("all", evicted=True, shadowed=True)
        assert monitor.snapshot()["all"]["pending"] == 1
        runner.run(ShadowJob(request.id, "all", None, request.context, request.question, list(request.answers),
                             served, ticket))
    snap = monitor.snapshot()["all"]
    assert snap["pending"] == 0 and snap["shadowed"] == 3
    assert snap["violations"] == sum(records[(r.id, POLICY)]["loss"] > 1e-9 for r in requests[:3])


def test_export_certifies_under_a_contract_naming_the_base_policy(calibrated, shadowed, tmp_path):
    """`certkv export` of the shadow store, then `certkv certify --records` under a contract listing
    the deployed (base) policy: the live violations are the shadows' verdicts."""
    from certkv.core.binomial import count_violations
    from certkv.core.operating_point import load_operating_point

    folder, _, _, _ = calibrated
    shadow_dir, results, monitor = shadowed
    csv = tmp_path / "live.csv"
    assert run_main("export", str(shadow_dir), "-o", str(csv)) == 0
    contract = _write_contract(folder, policies=[{"press": "snapkv", "kv_retained": [0.3]}], name="live",
                               store=str(tmp_path / "unused"))
    out = tmp_path / "live.json"
    assert run_main("certify", str(contract), "--records", str(csv), "-o", str(out)) == 0
    op = load_operating_point(out)
    result = next(c for c in op.candidates if c.policy == POLICY)
    assert result.n == N_REQUESTS
    assert result.violations == count_violations([rec["loss"] for _, _, rec in results], 0.0)
    assert result.violations == sum(monitor.completed.values())


def test_a_stratified_point_gets_one_store_per_stratum(tmp_path):
    """Strata deploy different policies, which one loss table cannot hold: one store each."""
    from certkv.calibration.store import CalibrationStore
    from certkv.core.operating_point import OperatingPoint, StrataResult
    from certkv.errors import CertkvError
    from certkv.serve.shadow_store import STRATA_INDEX, ShadowStore

    a = _operating_point()
    b = a.model_copy(update={"policy": "knorm@0.50", "base_policy": "knorm@0.50", "press": "knorm",
                             "kv_retained": 0.5})
    c = a.model_copy(update={"policy": "full", "base_policy": "full", "fallback": True})
    op = a.model_copy(update={"policy": "stratified", "strata": StrataResult(
        by="task", simultaneous=False, confidence=0.6, entries={"alpha": a, "beta": b, "../odd": c})})
    assert isinstance(op, OperatingPoint)
    with ShadowStore(tmp_path / "s", op) as store:
        assert store.strata == ["alpha", "beta"]
        for stratum, policy, kv in (("alpha", POLICY, 0.3), ("beta", "knorm@0.50", 0.5)):
            store.write(_pair("r-" + stratum, stratum, policy, kv))
        with pytest.raises(CertkvError, match="no shadow store"):
            store.write(_pair("r-odd", "../odd", "full@x", 1.0))
        assert store.count() == 2
    assert json.loads((tmp_path / "s" / STRATA_INDEX).read_text())["strata"] == {"alpha": "alpha", "beta": "beta"}
    for stratum, policy in (("alpha", POLICY), ("beta", "knorm@0.50")):
        with CalibrationStore.read(tmp_path / "s" / stratum) as sub:
            assert [r["policy"] for r in sub.records()] == ["full", policy]
    with pytest.raises(CertkvError, match="another operating point"):
        ShadowStore(tmp_path / "s" / "alpha", b)
    with ShadowStore(tmp_path / "s", op) as again:  # same point: resumes
        assert again.count() == 2
    # a stratum's store of another format version is refused, by the server and by export
    alpha = tmp_path / "s" / "alpha" / "records.sqlite"
    conn = sqlite3.connect(alpha, isolation_level=None)
    conn.execute("UPDATE meta SET value = '2' WHERE key = 'format_version'")
    conn.close()
    message = (f"{alpha}: format_version 2, this certkv reads 1; "
               "re-run `certkv serve OPERATING_POINT --shadow-store NEW_FOLDER` to write it again")
    for opening in (lambda: ShadowStore(tmp_path / "s", op), lambda: CalibrationStore.read(tmp_path / "s" / "alpha")):
        with pytest.raises(CertkvError) as err:
            opening()
        assert str(err.value) == message


def _pair(rid: str, task: str | None, policy: str, kv: float, loss: float = 0.0) -> list[dict]:
    full = {"request_id": rid, "task": task, "policy": "full", "press": "full", "kv_retained": 1.0, "memory": 1.0,
            "utility": 1.0, "utility_full": 1.0, "loss": 0.0, "answer": "a", "context_tokens": 200}
    press = policy.split("@")[0]
    return [full, {**full, "policy": policy, "press": press, "kv_retained": kv, "memory": kv,
                   "utility": 1.0 - loss, "loss": loss, "answer": "a" if loss == 0 else "b"}]


CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path
    from certkv.calibration.store import CalibrationStore
    from certkv.core.operating_point import OperatingPoint
    from certkv.serve.shadow_store import ShadowStore
    from tests.serve.test_shadow import _pair

    folder, op = Path(sys.argv[1]), OperatingPoint.model_validate_json(sys.argv[2])
    at, nth = sys.argv[3], int(sys.argv[4])  # SIGKILL after this run's nth "record" inserted or "write" committed
    insert, inserted = CalibrationStore._insert, [0]

    def insert_then_hook(self, sql, values):  # a shadow is two records in one transaction
        insert(self, sql, values)
        inserted[0] += 1
        if at == "record" and inserted[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)

    CalibrationStore._insert = insert_then_hook
    store = ShadowStore(folder, op)
    start = store.count()
    print("ready", start, flush=True)
    for i in range(start, 10_000):
        store.write(_pair("live-%05d" % i, "t", "snapkv@0.30", 0.3, loss=float(i % 3 == 0)))
        if at == "write" and i - start + 1 == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        print("wrote", i, flush=True)
    """
)
# (hook, nth) per run: a record inserted is inside a transaction (the 5th: a shadow's first record;
# the 8th: its last, before COMMIT), a write returned is between two.
KILLS = [("record", 5), ("write", 3), ("record", 8), ("write", 2)]


def _stored_shadows(folder: Path) -> int:
    if not (folder / "records.sqlite").is_file():
        return 0
    with sqlite3.connect(folder / "records.sqlite") as conn:
        return conn.execute("SELECT COUNT(DISTINCT request_id) FROM records").fetchone()[0]


def test_the_shadow_store_survives_sigkill(tmp_path):
    """Kill a writer at hooks inside and between its transactions: reopened, the store holds whole
    shadows only, at least every shadow the writer reported written, and it still exports and
    certifies."""
    from certkv.serve.shadow_store import ShadowStore

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    op = _operating_point()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    reported = -1
    for at, nth in KILLS:
        before = _stored_shadows(tmp_path / "s")
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "s"), op.model_dump_json(), at, str(nth)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        line = proc.stdout.readline()
        if not line.startswith("ready"):
            proc.wait(timeout=30)
            pytest.fail(f"child failed: {proc.stderr.read()}")
        assert int(line.split()[1]) >= reported + 1
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, err
        # killed at its nth record: the shadows before that record's are committed; after its nth write: n
        assert _stored_shadows(tmp_path / "s") == before + ((nth - 1) // 2 if at == "record" else nth), (at, nth)
        written = [int(x.split()[1]) for x in out.splitlines() if x.startswith("wrote")]
        reported = max([reported, *written])
    conn = sqlite3.connect(tmp_path / "s" / "records.sqlite")
    by_request: dict[str, list[str]] = {}
    for rid, policy in conn.execute("SELECT request_id, policy FROM records"):
        by_request.setdefault(rid, []).append(policy)
    conn.close()
    assert reported >= 4, "the writer should have committed several shadows"
    assert all(sorted(p) == ["full", POLICY] for p in by_request.values()), "a partial shadow survived"
    assert sorted(by_request) == [f"live-{i:05d}" for i in range(len(by_request))]
    assert len(by_request) >= reported + 1
    with ShadowStore(tmp_path / "s", op) as store:
        assert store.count() == len(by_request)
    csv = tmp_path / "live.csv"
    assert run_main("export", str(tmp_path / "s"), "-o", str(csv)) == 0
    contract = _write_contract(tmp_path, policies=[{"press": "snapkv", "kv_retained": [0.3]}],
                               store=str(tmp_path / "unused"))
    (tmp_path / "requests.jsonl").write_text("")
    assert run_main("certify", str(contract), "--records", str(csv), "-o", str(tmp_path / "op.json")) == 0
    result = json.loads((tmp_path / "op.json").read_text())
    assert result["n"] == len(by_request)
    assert result["candidates"][0]["violations"] == sum(int(r.split("-")[1]) % 3 == 0 for r in by_request)
