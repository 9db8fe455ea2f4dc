"""Requests cancelled at random points (queued, prefilling, transferring, decoding) through the
router's cluster backend leave every pool on every worker at its idle page count: 400 in the CI
subset (~40 s on a 2-core machine), 1000 in the full suite."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
import ray

from cluster.launcher import ClusterOptions, LocalCluster
from cluster.settings import Environment
from model.tokenizer import ByteTokenizer
from router.cluster_backend import ClusterBackend
from router.config import PlacementConfig
from worker_runtime.options import WorkerOptions
from worker_runtime.registry import Registry
from worker_runtime.wire import GenerateRequest

pytestmark = pytest.mark.cluster  # starts Ray

pytest.importorskip("nixl")


@pytest.fixture(scope="module")
def cluster(tiny_official_ckpt):
    options = WorkerOptions(str(tiny_official_ckpt), "", max_tokens=512, max_seqs=16, lease_s=5.0,
                            prefill_token_budget=256)
    c = LocalCluster(ClusterOptions(options, prefill=1, decode=1), Environment(None, None, Path("/tmp"))).start()
    yield c
    c.stop()


# exhaustive: a cluster of its own and ~65 s; CI checks abort bookkeeping in tests/router and the chaos subset
@pytest.mark.parametrize("n_requests", [pytest.param(400, marks=pytest.mark.exhaustive),
                                        pytest.param(1000, marks=pytest.mark.exhaustive)])
def test_abort_storm_leaves_no_pages(cluster, n_requests):
    rng = random.Random(7)

    async def one(backend, i):
        req = GenerateRequest(f"storm{i}", tuple(rng.randrange(256) for _ in range(rng.randrange(1, 300))),
                              max_tokens=rng.randrange(1, 30))
        # the client goes away after a few chunks, or after a random time (possibly before the
        # first token: while queued, prefilling or transferring)
        stop_after = rng.choice([1, 2, 5, 100])
        patience = rng.choice([None, 0.0, 0.01, 0.05, 0.2])
        gen = backend.generate(req)
        seen = 0
        try:
            async with asyncio.timeout(patience):
                async for chunk in gen:
                    assert chunk.error is None, chunk.error
                    seen += 1
                    if seen >= stop_after or chunk.finish_reason:
                        break
        except TimeoutError:
            pass
        finally:
            await gen.aclose()  # the client disconnects: the backend aborts the request

    async def run():
        backend = ClusterBackend(Registry(cluster.registry_url), ByteTokenizer(320), "tiny", 512,
                                 PlacementConfig(remote_prefill_threshold=64))
        await backend.start()
        await backend.wait_for_workers(prefill=1, decode=1)
        pending = set()
        for i in range(n_requests):
            pending.add(asyncio.ensure_future(one(backend, i)))
            if len(pending) >= 48:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for d in done:
                    d.result()
        for d in await asyncio.gather(*pending, return_exceptions=True):
            assert not isinstance(d, Exception), d
        await backend.stop()

    asyncio.run(run())
    deadline = time.time() + 30  # aborted reservations are fenced, at worst at lease + grace
    while True:
        accounts = [ray.get(a.page_accounting.remote(drop_cache=True)) for a in cluster.prefill]
        accounts += [ray.get(a.page_accounting.remote()) for a in cluster.decode]
        if all(a["free"] == a["idle"] for a in accounts) or time.time() > deadline:
            break
        time.sleep(0.5)
    for a in accounts:
        assert a["free"] == a["idle"], a
