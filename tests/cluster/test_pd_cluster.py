"""Disaggregated serving through real Ray actors, a real Valkey registry and NIXL transfers:
outputs equal `v4serve generate` for each request alone (invariant 1); pages return to idle."""

import asyncio
import random
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
from worker_runtime.options import WorkerOptions
from worker_runtime.registry import Registry
from worker_runtime.wire import GenerateRequest

pytestmark = pytest.mark.cluster  # starts Ray

pytest.importorskip("nixl")


@pytest.fixture(scope="module", params=["fp32", "fp8_pack"])
def cluster(request, tiny_official_ckpt):
    c = LocalCluster(ClusterOptions(WorkerOptions(str(tiny_official_ckpt), "", kv_dtype=request.param,
                                                  max_tokens=512, max_seqs=16, prefill_token_budget=160),
                                    prefill=1, decode=1),
                     Environment(None, None, Path("/tmp"))).start()
    yield c
    c.stop()


def reference(ckpt, req, kv_dtype="fp32"):
    cfg, model = load_checkpoint(ckpt)
    pools = KVPools(cfg, kv_dtype, max_tokens=512, max_seqs=1)
    return generate(model, pools, list(req.prompt_ids), req.max_tokens, req.sampling,
                    stop_ids=frozenset({cfg.eos_token_id})).token_ids


def assert_idle(actor, timeout=10.0, prefill=False):
    """Page accounting converges to idle once acknowledgements and leases have been processed
    (a prefill worker's prefix cache is dropped first: cached pages are not leaked pages)."""
    deadline = time.time() + timeout
    while True:
        acct = ray.get(actor.page_accounting.remote(drop_cache=True) if prefill else actor.page_accounting.remote())
        if acct["free"] == acct["idle"] or time.time() > deadline:
            break
        time.sleep(0.1)
    assert acct["free"] == acct["idle"], acct


async def collect(decode, req, prefill):
    tokens = []
    async for ref in decode.generate.options(num_returns="streaming").remote(req, prefill):
        chunk = await ref
        assert chunk.error is None, chunk.error
        tokens.extend(chunk.token_ids)
    return tokens


def test_pd_outputs_equal_generate(cluster, tiny_official_ckpt):
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(200)]
    reqs = []
    for i in range(10):
        prompt = (shared if i % 2 else []) + [rng.randrange(256) for _ in range(rng.randrange(1, 180))]
        sampling = SamplingParams() if i % 3 else SamplingParams(temperature=1.0, top_k=40, seed=i)
        reqs.append(GenerateRequest(f"pd{i}", tuple(prompt), max_tokens=rng.randrange(2, 10), sampling=sampling))

    async def run():
        p, d = cluster.prefill[0], cluster.decode[0]
        # odd requests (the long, shared-prefix ones) through the prefill worker, even ones
        # prefilled on the decode worker
        return await asyncio.gather(*(collect(d, r, p if i % 2 else None) for i, r in enumerate(reqs)))

    got = asyncio.run(run())
    for r, tokens in zip(reqs, got):
        assert tokens == reference(tiny_official_ckpt, r, cluster.options.worker.kv_dtype), r.request_id
    for actor in cluster.prefill:
        assert_idle(actor, prefill=True)
    for actor in cluster.decode:
        assert_idle(actor)
    d = ray.get(cluster.decode[0].page_accounting.remote())
    assert d["fallbacks"] == 0 and d["transfers_idle"]
    p = ray.get(cluster.prefill[0].page_accounting.remote())
    assert p["streamed_pages"] > 0  # long prompts shipped finished pages while still prefilling
    assert p["computed_tokens"] == sum(len(r.prompt_ids) for i, r in enumerate(reqs) if i % 2)


def test_workers_registered_with_metadata(cluster):
    reg = Registry(cluster.registry_url)
    deadline = time.time() + 10
    while time.time() < deadline and len(reg.workers()) < 2:
        time.sleep(0.2)
    roles = {w.role for w in reg.workers()}
    assert roles == {"prefill", "decode"}
    for w in reg.workers():
        assert w.metadata and w.layout and w.epoch


def test_repeated_prefix_skips_prefill_through_the_cluster(cluster, tiny_official_ckpt):
    rng = random.Random(9)
    first = [rng.randrange(256) for _ in range(300)]
    second = first + [rng.randrange(256) for _ in range(40)]
    p, d = cluster.prefill[0], cluster.decode[0]
    before = ray.get(p.page_accounting.remote())["computed_tokens"]

    async def run(req):
        return await collect(d, req, p)

    reqs = [GenerateRequest("x1", tuple(first), 4), GenerateRequest("x2", tuple(second), 4)]
    got = [asyncio.run(run(r)) for r in reqs]
    for r, tokens in zip(reqs, got):
        assert tokens == reference(tiny_official_ckpt, r, cluster.options.worker.kv_dtype)
    computed = ray.get(p.page_accounting.remote())["computed_tokens"] - before
    assert computed == 300 + 340 - 256  # the second prompt resumed at the first one's page boundary
    assert_idle(p, prefill=True)
