"""Worker failures under load, through the router's cluster backend.

A decode worker killed mid-stream: its requests continue on the other decode worker with exactly
the tokens they would have had (recompute of prompt + generated tokens), in one client stream. A
prefill worker killed mid-prefill: the decode worker prefills its requests itself. Either way the
surviving workers' pages return to idle."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
import ray

from cluster.launcher import ClusterOptions, LocalCluster
from cluster.messages import GenerateRequest
from cluster.options import WorkerOptions
from cluster.registry import Registry
from cluster.settings import Environment
from model.checkpoint import load_checkpoint
from model.generate import generate
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from router.cluster_backend import ClusterBackend
from router.config import PlacementConfig

pytest.importorskip("nixl")


def test_killed_decode_worker_requests_continue_elsewhere(tiny_official_ckpt):
    options = WorkerOptions(str(tiny_official_ckpt), "", max_tokens=512, max_seqs=16, lease_s=3.0)
    cluster = LocalCluster(ClusterOptions(options, prefill=1, decode=2), Environment(None, None, Path("/tmp"))).start()
    rng = random.Random(4)
    reqs = [GenerateRequest(f"f{i}", tuple(rng.randrange(256) for _ in range(rng.randrange(20, 200))),
                            max_tokens=40, sampling=SamplingParams(temperature=0.8 * (i % 2), seed=i),
                            ignore_eos=True) for i in range(12)]
    try:
        async def run():
            backend = ClusterBackend(Registry(cluster.registry_url), ByteTokenizer(320), "tiny", 512,
                                     PlacementConfig(remote_prefill_threshold=64))
            await backend.start()
            await backend.wait_for_workers(prefill=1, decode=2)
            victim_killed = asyncio.Event()

            async def one(req):
                tokens, usage = [], None
                async for chunk in backend.generate(req):
                    assert chunk.error is None, chunk.error
                    tokens.extend(chunk.token_ids)
                    usage = chunk.usage or usage
                    if len(tokens) >= 5 and not victim_killed.is_set():
                        victim_killed.set()
                        ray.kill(cluster.decode[0])  # dies with requests mid-decode
                return tokens, usage

            out = await asyncio.gather(*(one(r) for r in reqs))
            await backend.stop()
            return out

        got = asyncio.run(run())
        cfg, model = load_checkpoint(tiny_official_ckpt)
        for req, (tokens, usage) in zip(reqs, got):
            pools = KVPools(cfg, "fp32", max_tokens=512, max_seqs=1)
            ref = generate(model, pools, list(req.prompt_ids), req.max_tokens, req.sampling).token_ids
            assert tokens == ref, req.request_id
            assert usage.prompt_tokens == len(req.prompt_ids) and usage.completion_tokens == len(ref)
        deadline = time.time() + 30  # writes to the dead worker are given up a lease after the deadline
        while True:
            accounts = [ray.get(cluster.prefill[0].page_accounting.remote(drop_cache=True)),
                        ray.get(cluster.decode[1].page_accounting.remote())]
            if all(a["free"] == a["idle"] for a in accounts) or time.time() > deadline:
                break
            time.sleep(0.5)
        for a in accounts:
            assert a["free"] == a["idle"], a
    finally:
        cluster.decode = cluster.decode[1:]  # the killed actor is gone already
        cluster.stop()


def test_killed_prefill_worker_requests_are_recomputed(tiny_official_ckpt):
    """The prefill worker dies with prompts queued and in flight: the decode worker prefills
    them itself; every request finishes with the tokens it would have had."""
    options = WorkerOptions(str(tiny_official_ckpt), "", max_tokens=512, max_seqs=16, lease_s=3.0,
                            prefill_token_budget=64)
    cluster = LocalCluster(ClusterOptions(options, prefill=1, decode=1), Environment(None, None, Path("/tmp"))).start()
    rng = random.Random(5)
    reqs = [GenerateRequest(f"k{i}", tuple(rng.randrange(256) for _ in range(rng.randrange(100, 300))),
                            max_tokens=6, ignore_eos=True) for i in range(10)]
    try:
        async def run():
            backend = ClusterBackend(Registry(cluster.registry_url), ByteTokenizer(320), "tiny", 512,
                                     PlacementConfig(remote_prefill_threshold=64))
            await backend.start()
            await backend.wait_for_workers(prefill=1, decode=1)

            async def one(req):
                return [t async for chunk in backend.generate(req) for t in chunk.token_ids if chunk.error is None]

            tasks = [asyncio.ensure_future(one(r)) for r in reqs]
            await asyncio.sleep(0.3)  # prompts are queued and prefilling on the prefill worker
            ray.kill(cluster.prefill[0])
            out = await asyncio.gather(*tasks)
            await backend.stop()
            return out

        got = asyncio.run(run())
        cfg, model = load_checkpoint(tiny_official_ckpt)
        for req, tokens in zip(reqs, got):
            pools = KVPools(cfg, "fp32", max_tokens=512, max_seqs=1)
            assert tokens == generate(model, pools, list(req.prompt_ids), req.max_tokens, req.sampling).token_ids
        decode = ray.get(cluster.decode[0].page_accounting.remote())
        assert decode["fallbacks"] > 0  # some prompts really were lost with the prefill worker
        deadline = time.time() + 15
        while decode["free"] != decode["idle"] and time.time() < deadline:
            time.sleep(0.5)
            decode = ray.get(cluster.decode[0].page_accounting.remote())
        assert decode["free"] == decode["idle"], decode
    finally:
        cluster.prefill = []  # killed already
        cluster.stop()
