"""`certkv serve --replicas`: two replicas on Ray Serve, one shared monitor, on a local Ray cluster started here.

One cluster and one deployment for the module (starting them costs most of its time): two replicas
of snapkv@0.10 under a tiny ε, every evicted answer shadowed, so that the shadows drift from the
full cache's answers and the one shared test trips (as the single-process server B of
test_serve.py). Driven with the official `openai` client through Ray Serve's HTTP proxy; the
``x-certkv-replica`` header says which replica answered. Waits are for events (answers, the
monitor's state), each bounded; none is a fixed delay.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import httpx
import pytest
from endpoint_servers import free_port
from test_shared_monitor import _point

from certkv.requests.request_set import generate_requests

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    ray = pytest.importorskip("ray")
    from ray import serve

    from certkv.serve.replicas import ReplicaOptions, replica_app
    from certkv.serve.shared_monitor import NAMESPACE, monitor_actor_name

    root = tmp_path_factory.mktemp("replicas")
    op = _point(risk=0.01).model_copy(update={"policy": "snapkv@0.10", "base_policy": "snapkv@0.10",
                                              "kv_retained": 0.1, "mean_kv_retained": 0.1})
    op_path = op.write_json(root / "operating_point.json")
    offline = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # the replicas inherit it from the cluster started here
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    if offline is None:
        del os.environ["HF_HUB_OFFLINE"]
    else:
        os.environ["HF_HUB_OFFLINE"] = offline
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = ReplicaOptions(operating_point=str(op_path), shadow_rate=1.0, seed=3, device="cpu",
                                 shadow_store=str(root / "shadow"))
        serve.run(replica_app(options, num_replicas=2, ray_actor_options={"num_cpus": 0.5}), name="certkv",
                  route_prefix="/")
        monitor = ray.get_actor(monitor_actor_name(op), namespace=NAMESPACE)
        yield {"url": f"http://127.0.0.1:{port}", "op": op, "monitor": monitor, "store": root / "shadow", "ray": ray}
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def requests():
    return generate_requests("demo", n=8, seed=4243, context_length=(200, 320))


def _client(url):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(client, r):
    """One completion through the official client: (replica, certkv object, text)."""
    raw = client.completions.with_raw_response.create(model="embedded", prompt=r.context,
                                                      extra_body={"question": r.question})
    out = raw.parse()
    return raw.headers["x-certkv-replica"], out.model_extra["certkv"], out.choices[0].text


def _until(check, what, limit=180.0):
    """Call `check` until it returns a truthy value (each call an HTTP or actor round trip), at most `limit` s."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
    raise AssertionError(f"gave up waiting for {what}")


def test_two_replicas_answer_as_the_runtime_in_process(deployment, requests, embedded):
    from certkv.runtime.certified_runtime import CertifiedRuntime

    client, seen = _client(deployment["url"]), {}
    first = _ask(client, requests[0])
    assert first[1]["decision"]["mode"] == "evicted"  # nothing can have tripped before the first answer
    assert first[2] == CertifiedRuntime(*embedded, deployment["op"]).generate(requests[0].context,
                                                                                requests[0].question).answer
    for i in range(40):  # requests until both replicas have answered
        replica, info, _ = _ask(client, requests[i % len(requests)])
        seen[replica] = info
        if len(seen) == 2:
            break
    assert len(seen) == 2, seen
    assert all(info["monitor"]["monitor_reachable"] for info in seen.values())
    with pytest.raises(Exception, match="is not served here"):  # the single server's errors, as they are
        client.completions.create(model="gpt-9", prompt=requests[0].context + requests[0].question)


def test_a_drift_trips_the_one_monitor_and_every_replica_switches(deployment, requests, embedded):
    from certkv.runtime.certified_runtime import CertifiedRuntime

    ray, monitor, client = deployment["ray"], deployment["monitor"], _client(deployment["url"])
    full = CertifiedRuntime(*embedded, deployment["op"].model_copy(update={"fallback": True}))
    switched: dict[str, str] = {}

    def both_switched():
        r = requests[len(switched) % len(requests)]
        replica, info, text = _ask(client, r)
        if info["decision"]["reason"] == "monitor":
            assert text == full.generate(r.context, r.question).answer
            switched[replica] = text
        return len(switched) == 2

    _until(both_switched, "both replicas to answer from the full cache")
    state = ray.get(monitor.snapshot.remote())["all"]
    assert state["tripped"] and state["requests"] >= state["tripped_after"]
    # /health and /metrics of each replica say so
    health: dict[str, dict] = {}

    def both_healthy_tripped():
        resp = httpx.get(deployment["url"] + "/health", timeout=30)
        health[resp.headers["x-certkv-replica"]] = resp.json()
        return len(health) == 2

    _until(both_healthy_tripped, "/health from both replicas")
    assert all(h["status"] == "tripped" and h["tripped"] == ["all"] for h in health.values()), health
    metrics: set[str] = set()

    def both_metrics():
        resp = httpx.get(deployment["url"] + "/metrics", timeout=30)
        assert 'certkv_monitor_tripped{stream="all"} 1.0' in resp.text and "certkv_monitor_shared 1.0" in resp.text
        metrics.add(resp.headers["x-certkv-replica"])
        return len(metrics) == 2

    _until(both_metrics, "/metrics from both replicas")


def _quiet(deployment, replicas=2):
    """Wait until `replicas` replicas in a row hold no shadow and no unsent event, and no shadow is pending at
    the monitor."""
    ray, quiet = deployment["ray"], set()

    def check():
        resp = httpx.get(deployment["url"] + "/health", timeout=30)
        health, replica = resp.json(), resp.headers["x-certkv-replica"]
        if health["monitor"]["all"]["monitor_buffered"] or health["queue"]["shadow_pending"]:
            quiet.clear()
            return False
        quiet.add(replica)
        return len(quiet) >= replicas and ray.get(deployment["monitor"].snapshot.remote())["all"]["pending"] == 0

    _until(check, "the shadows to settle")


def test_the_monitor_restarts_from_its_store_and_a_killed_replica_loses_nothing(deployment, requests):
    from certkv.serve.shadow_store import ShadowStore

    ray, monitor, client = deployment["ray"], deployment["monitor"], _client(deployment["url"])
    _quiet(deployment)
    before = ray.get(monitor.snapshot.remote())
    ray.kill(monitor, no_restart=False)  # Ray restarts it; the restart replays the journal
    assert ray.get(monitor.snapshot.remote()) == before
    # a replica killed under load: the other answers; the monitor's test goes on from where it was
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]]
    assert len(replicas) == 2
    victim = ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"])
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_status, client, requests[i % len(requests)]) for i in range(8)]
        ray.kill(victim, no_restart=True)
        statuses = [f.result() for f in futures]
    assert statuses.count(200) >= 4, statuses  # at most the requests in flight on the killed one failed
    after = ray.get(monitor.snapshot.remote())["all"]
    assert after["requests"] >= before["all"]["requests"] and after["tripped"]
    _quiet(deployment, replicas=1)  # the survivor (the killed one's replacement may still be loading its model)
    state = ray.get(monitor.snapshot.remote())["all"]
    with ShadowStore(deployment["store"], deployment["op"]) as store:
        assert store.count() == state["shadowed"] - state["abandoned"] - state["pending"] > 0


def _status(client, r) -> int:
    import openai

    try:
        client.completions.create(model="embedded", prompt=r.context, extra_body={"question": r.question})
        return 200
    except openai.APIStatusError as exc:
        return exc.status_code
    except openai.APIConnectionError:
        return 0


def test_replicas_serve_on_without_the_monitor_and_send_their_events_later(deployment, requests):
    """The monitor gone for good (not restarted by Ray): the replicas answer and keep their events; an
    operator starts the monitor anew, it replays its journal, and every answer of the outage reaches it."""
    from certkv.serve.shared_monitor import monitor_actor

    ray, client = deployment["ray"], _client(deployment["url"])
    _quiet(deployment, replicas=1)
    before = ray.get(deployment["monitor"].snapshot.remote())["all"]
    ray.kill(deployment["monitor"], no_restart=True)
    outage = [_ask(client, requests[i % len(requests)]) for i in range(6)]
    assert all(info["decision"]["reason"] == "monitor" for _, info, _ in outage)  # still tripped, as last heard
    monitor = monitor_actor(deployment["op"], deployment["store"], 1.0)
    deployment["monitor"] = monitor
    state = _until(lambda: (s := ray.get(monitor.snapshot.remote())["all"])["requests"] >= before["requests"] + 6
                   and s, "the outage's events to reach the new monitor")
    assert state["requests"] == before["requests"] + 6 and state["tripped_after"] == before["tripped_after"]
