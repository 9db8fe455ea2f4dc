"""The cluster registry on Redis: membership with heartbeats, transfer metadata, load, KV events.

Keys (all under `v4s:<cluster>:`):

* `worker:<id>` — a hash {role, actor, agent, epoch, layout, metadata, load}, with a TTL that
  each worker's heartbeat refreshes; a worker that stops heart-beating disappears by expiry.
  After a Redis restart the next heartbeat re-creates the key, so the registry rebuilds itself.
* `router:<id>` — a router's lease, renewed on each of its registry refreshes and gone
  `ROUTER_LEASE_S` after the last: decode workers abort the requests of a router whose lease
  lapsed (a crashed router's streams are not ended by Ray; decode_worker/router_leases.py).
* `kvevents` — a stream of prefill prefix-cache events (stored / evicted page hashes); router
  replicas each read it from the start so they all build the same prefix index.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import redis

from worker_runtime.wire import KVEvent, WorkerInfo, WorkerLoad

HEARTBEAT_TTL_S = 6.0
ROUTER_LEASE_S = 6.0
EVENT_STREAM_MAXLEN = 200_000


class Registry:
    def __init__(self, url: str, cluster: str = "default"):
        self.url = url
        self.prefix = f"v4s:{cluster}:"
        self.redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)

    # --- workers ------------------------------------------------------------------------
    def heartbeat(self, info: WorkerInfo) -> None:
        key = f"{self.prefix}worker:{info.worker_id}"
        fields = {"role": info.role, "actor": info.actor, "agent": info.agent, "epoch": info.epoch,
                  "layout": info.layout, "metadata": info.metadata, "load": json.dumps(asdict(info.load))}
        with self.redis.pipeline() as pipe:
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, int(HEARTBEAT_TTL_S * 1000))
            pipe.execute()

    def deregister(self, worker_id: str) -> None:
        self.redis.delete(f"{self.prefix}worker:{worker_id}")

    def workers(self, role: str | None = None) -> list[WorkerInfo]:
        out = []
        for key in self.redis.scan_iter(match=f"{self.prefix}worker:*", count=500):
            raw = self.redis.hgetall(key)
            if not raw:
                continue  # expired between scan and read
            f = {k.decode(): v for k, v in raw.items()}
            if role is not None and f["role"].decode() != role:
                continue
            out.append(WorkerInfo(
                worker_id=key.decode().rsplit(":", 1)[1], role=f["role"].decode(), actor=f["actor"].decode(),
                agent=f["agent"].decode(), epoch=f["epoch"].decode(), layout=f["layout"].decode(),
                metadata=f["metadata"], load=WorkerLoad(**json.loads(f["load"]))))
        return sorted(out, key=lambda w: w.worker_id)

    # --- router leases -------------------------------------------------------------------
    def renew_router(self, router_id: str, lease_s: float = ROUTER_LEASE_S) -> None:
        self.redis.set(f"{self.prefix}router:{router_id}", b"1", px=int(lease_s * 1000))

    def routers_alive(self, router_ids: set[str]) -> set[str]:
        """The routers among `router_ids` whose lease key exists now."""
        ids = sorted(router_ids)
        with self.redis.pipeline(transaction=False) as pipe:
            for r in ids:
                pipe.exists(f"{self.prefix}router:{r}")
            found = pipe.execute()
        return {r for r, n in zip(ids, found) if n}

    # --- KV events ----------------------------------------------------------------------
    def publish(self, event: KVEvent) -> None:
        self.redis.xadd(f"{self.prefix}kvevents",
                        {"worker": event.worker_id, "kind": event.kind,
                         "hashes": ",".join(map(str, event.page_hashes))},
                        maxlen=EVENT_STREAM_MAXLEN, approximate=True)

    def read_events(self, after: str = "0-0", block_ms: int | None = None, count: int = 1000) -> tuple[str, list[KVEvent]]:
        """Events after stream id `after` → (last id, events); blocks up to `block_ms` if given."""
        got = self.redis.xread({f"{self.prefix}kvevents": after}, count=count, block=block_ms)
        events, last = [], after
        for _stream, entries in got or []:
            for entry_id, f in entries:
                last = entry_id.decode()
                hashes = tuple(int(h) for h in f[b"hashes"].decode().split(",") if h)
                events.append(KVEvent(f[b"worker"].decode(), f[b"kind"].decode(), hashes))
        return last, events

    def ping(self) -> bool:
        try:
            return bool(self.redis.ping())
        except redis.RedisError:
            return False
