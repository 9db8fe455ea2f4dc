"""Supervision: a prefill and a decode worker whose processes are killed (SIGKILL) under load are
replaced under their names by new incarnations, back in the registry (and the router's /health
count) within 30 s; the requests they held end with exactly the tokens `generate` gives, or with
a reason code, within their deadline; new requests are served by the replacements; every
worker's pages return to idle. Workers the autoscaler drains and removes stay removed."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import time
from pathlib import Path

import pytest
import ray

from cluster.autoscale_actuator import ActuatorOptions, RayActuator
from cluster.launcher import ClusterOptions, LocalCluster
from cluster.settings import Environment
from cluster.supervisor import Supervisor
from model.checkpoint import load_checkpoint
from model.generate import generate
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from router.cluster_backend import ClusterBackend
from router.config import PlacementConfig
from router.metrics import RouterMetrics
from worker_runtime.options import WorkerOptions
from worker_runtime.registry import Registry
from worker_runtime.wire import ErrorCode, GenerateRequest

pytestmark = pytest.mark.cluster  # starts Ray

pytest.importorskip("nixl")

BACK_WITHIN_S = 30.0
DEADLINE_S = 120.0


def kill9(actor) -> None:
    """SIGKILL the actor's process: no stop(), no deregistration, Ray learns it from the OS."""
    os.kill(ray.get(actor.__ray_call__.remote(lambda _self: os.getpid())), signal.SIGKILL)


def requests(seed: int, n: int, prefix: str) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [GenerateRequest(f"{prefix}{i}", tuple(rng.randrange(256) for _ in range(rng.randrange(80, 250))),
                            max_tokens=rng.randrange(24, 40), ignore_eos=True,
                            sampling=SamplingParams(temperature=0.8 * (i % 2), seed=i)) for i in range(n)]


def reference(ckpt: Path, reqs: list[GenerateRequest]) -> dict[str, list[int]]:
    cfg, model = load_checkpoint(ckpt)
    return {r.request_id: generate(model, KVPools(cfg, "fp32", max_tokens=512, max_seqs=1), list(r.prompt_ids),
                                   r.max_tokens, r.sampling).token_ids for r in reqs}


async def until(predicate, timeout_s: float, every_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(every_s)
    return False


async def idle(cluster: LocalCluster) -> list[dict]:
    """Every worker's page accounting once all are idle (or as they are after 45 s)."""
    accounts: list[dict] = []

    async def all_idle() -> bool:
        accounts[:] = ([await a.page_accounting.remote(drop_cache=True) for a in cluster.prefill]
                       + [await a.page_accounting.remote() for a in cluster.decode])
        return all(a["free"] == a["idle"] for a in accounts)

    await until(all_idle, 45.0, every_s=0.5)
    return accounts


async def collect(actor, req: GenerateRequest, prefill) -> list[int]:
    """One request straight through `actor` (a decode worker), its KV shipped by `prefill`."""
    tokens = []
    async for ref in actor.generate.options(num_returns="streaming").remote(req, prefill):
        chunk = await ref
        assert chunk.error is None, chunk.error
        tokens.extend(chunk.token_ids)
    return tokens


def test_killed_workers_are_replaced_and_their_requests_end_well(tiny_official_ckpt, tmp_path):
    options = WorkerOptions(str(tiny_official_ckpt), "", max_tokens=512, max_seqs=16, lease_s=3.0, heartbeat_s=0.5,
                            prefill_token_budget=64)
    cluster = LocalCluster(ClusterOptions(options, prefill=2, decode=2), Environment(None, None, tmp_path)).start()
    first, second = requests(1, 12, "a"), requests(2, 8, "b")
    refs = reference(tiny_official_ckpt, first + second)
    registry = Registry(cluster.registry_url)
    victims = ("prefill-0", "decode-0")
    metrics = RouterMetrics()

    async def run():
        backend = ClusterBackend(registry, ByteTokenizer(320), "tiny", 512,
                                 PlacementConfig(remote_prefill_threshold=64), metrics, refresh_s=0.2, max_retargets=3)
        await backend.start()
        await backend.wait_for_workers(prefill=2, decode=2)
        supervisor = Supervisor(cluster, interval_s=0.5).start()
        try:
            old = {w.worker_id: w.epoch for w in registry.workers()}

            async def one(req):
                req = dataclasses.replace(req, deadline=time.time() + DEADLINE_S)
                tokens, error = [], None

                async def stream():
                    nonlocal error
                    async for chunk in backend.generate(req):
                        tokens.extend(chunk.token_ids)
                        error = chunk.error or error

                try:
                    await asyncio.wait_for(stream(), DEADLINE_S + 5)
                except TimeoutError:
                    error = "hung past its deadline"
                return req.request_id, tokens, error

            tasks = [asyncio.ensure_future(one(r)) for r in first]

            async def decoding() -> bool:  # decode-0 decodes a request with tokens still to go
                return (await cluster.decode[0].page_accounting.remote())["tokens_left"] >= 6

            assert await until(decoding, 60.0, every_s=0.02), "decode-0 never decoded"
            for name in victims:
                kill9(ray.get_actor(name))
            killed_at = time.monotonic()

            async def back() -> bool:
                now = {w.worker_id: w.epoch for w in await asyncio.to_thread(registry.workers)}
                return all(now.get(v) not in (None, old[v]) for v in victims)

            assert await until(back, BACK_WITHIN_S), [(e.kind, e.worker_id, e.detail) for e in supervisor.events]
            back_after = time.monotonic() - killed_at
            assert await until(lambda: _health(backend, 2, 2), 5.0), backend.health()  # what /health counts
            results = await asyncio.gather(*tasks)
            # the replacements serve: a request straight through the new pair (KV shipped
            # prefill-0 → decode-0), then a wave through the router
            direct = await collect(ray.get_actor("decode-0"), second[0], ray.get_actor("prefill-0"))
            wave = await asyncio.gather(*(one(r) for r in second[1:]))
            return results, back_after, direct, wave, list(supervisor.events)
        finally:
            await supervisor.stop()
            await backend.stop()

    try:
        results, back_after, direct, wave, events = asyncio.run(run())
        replaced = sorted(e.worker_id for e in events if e.kind == "replaced")
        assert replaced == sorted(victims), events
        assert back_after < BACK_WITHIN_S
        for rid, tokens, error in results:  # the load the kill hit: same tokens, or a reason code
            if error is None:
                assert tokens == refs[rid], rid
            else:
                assert isinstance(getattr(error, "code", None), ErrorCode), (rid, error)
                assert tokens == refs[rid][:len(tokens)], rid
        moved = sum(metrics.sample("v4serve_retargeted_requests_total", {"path": p}) for p in ("repull", "recompute"))
        assert moved >= 1  # the dead decode worker's requests were moved on, not waited for
        assert direct == refs[second[0].request_id]
        for rid, tokens, error in wave:  # after the replacement: all served, exactly
            assert error is None and tokens == refs[rid], (rid, error)
        p0 = ray.get(ray.get_actor("prefill-0").page_accounting.remote())
        assert p0["transfers"]["transfers"] >= 1  # the new prefill-0 shipped KV
        for account in asyncio.run(idle(cluster)):
            assert account["free"] == account["idle"], account
    finally:
        cluster.stop()


async def _health(backend, prefill: int, decode: int) -> bool:
    h = backend.health()
    return h["prefill"] == prefill and h["decode"] == decode


@pytest.mark.exhaustive  # ~35 s; the replacement itself stays in CI above
def test_workers_removed_on_purpose_are_not_brought_back(tiny_official_ckpt, tmp_path):
    """The autoscaler drains and removes a decode worker; a prefill worker killed and removed at
    once (the supervisor may see it dead first) is not replaced either; a decode worker that just
    dies is."""
    options = WorkerOptions(str(tiny_official_ckpt), "", max_tokens=256, max_seqs=4, heartbeat_s=0.5)
    cluster = LocalCluster(ClusterOptions(options, prefill=1, decode=2), Environment(None, None, tmp_path)).start()
    registry = Registry(cluster.registry_url)

    async def run():
        supervisor = Supervisor(cluster, interval_s=0.3).start()
        actuator = RayActuator(cluster, registry, lambda loads, now: {"prefill": 1, "decode": 1},
                               ActuatorOptions(interval_s=0.3, settle_s=0.5))
        try:
            actuator.start()
            assert await until(lambda: _removed(actuator), 60.0), list(actuator.events)
            await actuator.stop()
            drained = next(e.worker_id for e in actuator.events if e.kind == "removed")
            kill9(cluster.prefill[0])
            await asyncio.to_thread(cluster.remove_worker, "prefill-0")
            survivor = next(f"decode-{i}" for i in range(2) if f"decode-{i}" != drained)
            old = {w.worker_id: w.epoch for w in registry.workers()}
            kill9(ray.get_actor(survivor))

            async def back() -> bool:
                now = {w.worker_id: w.epoch for w in await asyncio.to_thread(registry.workers)}
                return now.get(survivor) not in (None, old[survivor])

            assert await until(back, BACK_WITHIN_S), list(supervisor.events)
            await asyncio.sleep(3.0)  # ten more rounds
            return drained, survivor, list(supervisor.events)
        finally:
            await actuator.stop()
            await supervisor.stop()

    try:
        drained, survivor, events = asyncio.run(run())
        assert [e.worker_id for e in events if e.kind == "replaced"] == [survivor], events
        for gone in (drained, "prefill-0"):
            with pytest.raises(ValueError):
                ray.get_actor(gone)
        assert cluster.prefill == [] and len(cluster.decode) == 1
        time.sleep(7.0)  # past the registry TTL: the removed workers' entries are gone
        assert sorted(w.worker_id for w in registry.workers()) == [survivor]
    finally:
        cluster.stop()


async def _removed(actuator: RayActuator) -> bool:
    return any(e.kind == "removed" for e in actuator.events)
