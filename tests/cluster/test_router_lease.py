"""A router that stops renewing its registry lease (as a crashed router does) loses its requests
on the decode workers: they are aborted and their pages freed, instead of decoding for nobody
until their length. Requests of a router that is alive go on untouched.

The crash is the lease lapsing while the router's streaming calls stay open and unread: Ray does
not end a streaming call whose caller died, so that is what the workers see of a real crash."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import ray

from cluster.launcher import ClusterOptions, LocalCluster
from cluster.settings import Environment
from model.checkpoint import load_checkpoint
from model.generate import generate
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from router.cluster_backend import ClusterBackend
from router.config import PlacementConfig
from worker_runtime.options import WorkerOptions
from worker_runtime.registry import Registry
from worker_runtime.wire import GenerateRequest

pytestmark = pytest.mark.cluster  # starts Ray

pytest.importorskip("nixl")

GRACE_S = 1.0  # the decode worker's grace; the routers' lease is as long


def test_requests_of_a_router_whose_lease_lapsed_are_aborted(tiny_official_ckpt):
    options = WorkerOptions(str(tiny_official_ckpt), "", max_tokens=512, max_seqs=4, router_grace_s=GRACE_S)
    cluster = LocalCluster(ClusterOptions(options, prefill=0, decode=1), Environment(None, None, Path("/tmp"))).start()
    decode = cluster.decode[0]
    # ~480 steps: far longer than lease + grace + a check, however fast the machine
    orphan = GenerateRequest("orphan", tuple(range(30, 60)), max_tokens=480, ignore_eos=True)
    kept = GenerateRequest("kept", tuple(range(40, 90)), max_tokens=24,
                           sampling=SamplingParams(temperature=0.7, seed=3), ignore_eos=True)
    try:
        async def run():
            def backend():
                return ClusterBackend(Registry(cluster.registry_url), ByteTokenizer(320), "tiny", 512,
                                      PlacementConfig(), lease_s=GRACE_S)
            crashed, alive = backend(), backend()
            for b in (crashed, alive):
                await b.start()
                await b.wait_for_workers(prefill=0, decode=1)
            stream = crashed.generate(orphan)
            first = await stream.__anext__()
            assert first.error is None and first.token_ids
            await crashed.stop()  # its lease is no longer renewed; the call stays open, unread
            t0 = time.time()
            tokens = [t async for c in alive.generate(kept) for t in c.token_ids]
            while ray.get(decode.page_accounting.remote())["router_lost"] == 0 and time.time() - t0 < 30:
                await asyncio.sleep(0.2)
            acct = ray.get(decode.page_accounting.remote())
            await alive.stop()
            await stream.aclose()
            return tokens, acct, time.time() - t0

        tokens, acct, waited = asyncio.run(run())
        assert acct["router_lost"] == 1, acct  # the orphan, not the live router's request
        cfg, model = load_checkpoint(tiny_official_ckpt)
        pools = KVPools(cfg, "fp32", max_tokens=512, max_seqs=1)
        assert tokens == generate(model, pools, list(kept.prompt_ids), kept.max_tokens, kept.sampling).token_ids
        deadline = time.time() + 10
        while (acct["running"] or acct["free"] != acct["idle"]) and time.time() < deadline:
            time.sleep(0.2)
            acct = ray.get(decode.page_accounting.remote())
        assert acct["running"] == 0 and acct["free"] == acct["idle"], acct
        assert acct["finished"] == 1  # only the live router's request ran to its end
    finally:
        cluster.stop()
