"""The shared monitor of `certkv serve --replicas`, in one process (no Ray: the actor's body itself).

Two replicas' clients feed one :class:`SharedMonitor`; its state must be exactly what one
:class:`RiskMonitor` computes from the same calls in the order they were applied. A monitor closed
(as a killed actor) and reopened on its store replays its journal into the same state, and a
client that could not reach it meanwhile kept serving, kept its events and sends them once it can:
nothing lost, nothing applied twice. The shadows' records land in the one store, under ids unique
across replicas.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_main
from test_shadow import _pair, _write_contract

from certkv.core.monitor import RiskMonitor
from certkv.errors import CertkvError
from certkv.serve.monitor_client import SharedMonitorClient
from certkv.serve.monitor_journal import Event
from certkv.serve.shadow_store import ShadowStore
from certkv.serve.shared_monitor import SharedMonitor

RISK, CONFIDENCE, RATE = 0.1, 0.9, 0.5
DELTA = 0.1  # delta_of(CONFIDENCE), as the operating point reads it


def _point(risk=RISK):
    from certkv.core.operating_point import ContractSummary, OperatingPoint

    return OperatingPoint(
        policy="snapkv@0.50", base_policy="snapkv@0.50", press="snapkv", kv_retained=0.5, mean_kv_retained=0.5,
        fallback=False, contract=ContractSummary(tolerance=0.0, risk=risk, confidence=CONFIDENCE,
                                                 procedure="fixed_sequence", utility="agreement"),
        n=4, violations=0, empirical_risk=0.0, risk_upper_bound=risk, p_value=0.01, candidates=[], sequences=[],
        guarantee="test", created="now", certkv_version="test", gate=None, max_new_tokens=8,
    )


def _records(request_id: str, violated: bool) -> list[dict]:
    """A shadow's record pair in the store's format (a full record and the base policy's record)."""
    return _pair(request_id, "t", "snapkv@0.50", 0.5, loss=float(violated))


class _Holder:
    """Where the clients reach the monitor: the monitor now running, or none (down: calls fail as a
    dead actor's do)."""

    def __init__(self, monitor):
        self.monitor = monitor

    def send(self, replica, events):
        if self.monitor is None:
            raise ConnectionError("the shared monitor is down")
        return self.monitor.apply(replica, events)


def _client(holder, name):
    return SharedMonitorClient(holder.send, risk=RISK, shadow_rate=RATE, streams={"all": DELTA},
                               replica=name, seed=7, start=False)


def _serve(client, reference, rng, n, p_violate, applied):
    """`n` requests on `client` (every one evicted; shadows drawn by its coin, verdicts at rate
    `p_violate` right after); the same calls are queued in `applied` for the reference monitor."""
    for _ in range(n):
        shadowed = client.draw_shadow()
        ticket = client.record("all", evicted=True, shadowed=shadowed)
        applied.append(("record", client.replica, ticket, shadowed))
        if shadowed:
            violated = bool(rng.random() < p_violate)
            client.complete(ticket, violated, records=_records(f"{client.replica}-req-{ticket}", violated))
            applied.append(("verdict", client.replica, ticket, violated))


def _replay_reference(calls):
    """One RiskMonitor fed the calls in order: the independent computation the shared one must equal."""
    monitor, tickets = RiskMonitor(RISK, DELTA, RATE), {}
    for kind, replica, ticket, flag in calls:
        if kind == "record":
            t = monitor.record("all", evicted=True, shadowed=flag)
            if flag:
                tickets[replica, ticket] = t
        else:
            monitor.complete(tickets.pop((replica, ticket)), flag)
    return monitor.snapshot()


def test_two_replicas_feed_one_test_that_restarts_from_its_store(tmp_path):
    op, rng = _point(), np.random.default_rng(3)
    holder = _Holder(SharedMonitor(op, tmp_path / "shadow", RATE))
    a, b = _client(holder, "ra"), _client(holder, "rb")
    applied_a, applied_b = [], []
    _serve(a, None, rng, 30, 0.05, applied_a)
    _serve(b, None, rng, 20, 0.05, applied_b)
    assert a.flush() and b.flush()  # a's batch applied first, then b's
    assert a.buffered() == b.buffered() == 0
    expected = _replay_reference(applied_a + applied_b)
    assert holder.monitor.snapshot() == expected
    assert {k: v for k, v in b.snapshot()["all"].items() if not k.startswith("monitor_")} == expected["all"]  # b sent last

    # the monitor dies: the replicas keep serving, their events buffered
    holder.monitor.close()
    holder.monitor = None
    more_a, more_b = [], []
    _serve(a, None, rng, 15, 0.05, more_a)
    assert not a.flush() and a.buffered() == len([c for c in more_a])  # one event per call
    assert a.snapshot()["all"]["monitor_reachable"] is False
    # restarted on its store: the same state, from the journal alone
    holder.monitor = SharedMonitor(op, tmp_path / "shadow", RATE)
    assert holder.monitor.snapshot() == expected and holder.monitor.restored == len(applied_a + applied_b)
    # a batch sent twice (a reply lost after it was applied) is applied once
    _serve(b, None, rng, 10, 0.05, more_b)
    batch = list(b._buffer)
    assert b.flush() and holder.monitor.apply("rb", batch)["acked"] == batch[-1].seq
    assert a.flush() and a.buffered() == 0
    final = holder.monitor.snapshot()
    assert final == _replay_reference(applied_a + applied_b + more_b + more_a)
    # every shadow's pair is in the one store, none twice
    holder.monitor.close()
    shadows = sum(1 for c in applied_a + applied_b + more_a + more_b if c[0] == "verdict")
    with ShadowStore(tmp_path / "shadow", op) as store:
        assert store.count() == shadows == final["all"]["shadowed"]
        assert {r["request_id"][:2] for r in store.records()} == {"ra", "rb"}
    # ... and they re-certify: the live violations are the verdicts the one test counted
    csv = tmp_path / "live.csv"
    assert run_main("export", str(tmp_path / "shadow"), "-o", str(csv)) == 0
    contract = _write_contract(tmp_path, policies=[{"press": "snapkv", "kv_retained": [0.5]}],
                               store=str(tmp_path / "unused"))
    (tmp_path / "requests.jsonl").write_text("")
    assert run_main("certify", str(contract), "--records", str(csv), "-o", str(tmp_path / "op.json")) == 0
    result = json.loads((tmp_path / "op.json").read_text())
    assert result["n"] == shadows and result["candidates"][0]["violations"] == final["all"]["violations"]


def test_a_drift_seen_by_two_replicas_trips_the_one_test_and_both_switch(tmp_path):
    holder = _Holder(SharedMonitor(_point(), tmp_path / "shadow", RATE))
    a, b = _client(holder, "ra"), _client(holder, "rb")
    rng, calls = np.random.default_rng(5), []
    for _ in range(100):  # the two replicas alternate, each half of the traffic
        _serve(a, None, rng, 1, 0.6, calls)
        _serve(b, None, rng, 1, 0.6, calls)
        a.flush()
        b.flush()
        if holder.monitor.snapshot()["all"]["tripped"]:
            break
    assert holder.monitor.snapshot() == _replay_reference(calls)
    assert holder.monitor.snapshot()["all"]["tripped"]
    b.flush()
    a.flush()
    assert a.tripped("all") and b.tripped("all")


def test_events_the_monitor_cannot_apply_are_skipped_and_acknowledged(tmp_path):
    monitor = SharedMonitor(_point(), tmp_path / "shadow", RATE)
    reply = monitor.apply("rx", [Event("verdict", 1, 99, violated=True), Event("record", 2, 1, "nope", True, False),
                                 Event("record", 3, 2, "all", True, True), Event("abandon", 4, 2),
                                 Event("abandon", 5, 2)])
    assert reply["acked"] == 5 and reply["monitor"]["all"]["requests"] == 1
    assert reply["monitor"]["all"]["abandoned"] == 1
    monitor.close()


def test_the_journal_refuses_another_deployment(tmp_path):
    SharedMonitor(_point(), tmp_path / "shadow", RATE).close()
    with pytest.raises(CertkvError, match="belongs to another deployment .*shadow_rate"):
        SharedMonitor(_point(), tmp_path / "shadow", 0.25)
    with pytest.raises(CertkvError, match="another operating point"):
        SharedMonitor(_point(risk=0.2), tmp_path / "shadow", RATE)


def test_the_client_refuses_what_one_monitor_refuses(tmp_path):
    client = _client(_Holder(None), "ra")
    with pytest.raises(CertkvError, match="unknown monitor stream"):
        client.record("nope", evicted=True, shadowed=False)
    with pytest.raises(CertkvError, match="never shadowed"):
        client.record("all", evicted=False, shadowed=True)
    ticket = client.record("all", evicted=True, shadowed=False)
    with pytest.raises(CertkvError, match="not a pending shadow"):
        client.complete(ticket, True)


def test_replica_flags_are_checked_in_one_line_before_ray_starts(tmp_path, capsys):
    op = _point().write_json(tmp_path / "op.json")
    for args, needle in ((["--ray-address", "auto"], "--ray-address needs --replicas"),
                         (["--replicas", "0"], "--replicas must be at least 1")):
        code = run_main("serve", str(op), *args)
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and needle in lines[0], (args, lines)


def test_a_stratified_point_shares_one_stream_per_stratum_and_one_store_each(tmp_path):
    from certkv.core.operating_point import StrataResult

    entries = {task: _point() for task in ("multi_key", "single_needle")}
    op = _point().model_copy(update={"policy": "stratified", "base_policy": "stratified",
                                     "strata": StrataResult(by="task", simultaneous=False, confidence=CONFIDENCE,
                                                            entries=entries)})
    monitor = SharedMonitor(op, tmp_path / "shadow", RATE)
    client = SharedMonitorClient(lambda r, e: monitor.apply(r, e), risk=RISK, shadow_rate=RATE,
                                 streams={"multi_key": DELTA, "single_needle": DELTA}, replica="ra", start=False)
    for i, task in enumerate(["multi_key", "single_needle", "single_needle"]):
        ticket = client.record(task, evicted=True, shadowed=True)
        client.complete(ticket, i == 2, records=_pair(f"ra-req-{i}", task, "snapkv@0.50", 0.5, loss=float(i == 2)))
    assert client.flush() and client.flush()  # the second sends nothing and applies nothing
    state = monitor.snapshot()
    assert (state["multi_key"]["shadowed"], state["single_needle"]["shadowed"]) == (1, 2)
    assert state["single_needle"]["violations"] == 1 and client.snapshot()["single_needle"]["violations"] == 1
    assert [len(monitor.store.records(t)) for t in ("multi_key", "single_needle")] == [2, 4]
    monitor.close()


def test_a_new_deployment_refuses_a_running_monitor_started_with_another_rate_or_store(tmp_path):
    """A detached monitor outlives the deployment that started it: the next one checks its settings."""
    from certkv.serve.replicas import ReplicaOptions, _check_running_monitor

    op_path = tmp_path / "op.json"
    op_path.write_text(json.dumps(_point().to_dict()))
    monitor = SharedMonitor(_point(), (tmp_path / "shadow").resolve(), RATE)
    running = monitor.settings()
    monitor.close()
    same = ReplicaOptions(operating_point=str(op_path), shadow_rate=RATE, shadow_store=str(tmp_path / "shadow"))
    _check_running_monitor(running, same)  # the same settings: served on
    for other in ({"shadow_rate": 0.2}, {"shadow_store": str(tmp_path / "elsewhere")}):
        with pytest.raises(CertkvError, match="already running with shadow rate 0.5"):
            _check_running_monitor(running, same.model_copy(update=other))
