"""Expert-parallel prefill in the cluster: one group of 2 prefill workers (real Ray actors, gloo
over localhost), one decode worker, a real Valkey registry, NIXL transfers.

Outputs equal `v4serve generate` token for token (invariant 1) whether a group step has work on
one rank (the other joins the MoE exchanges idle) or on both, with each rank's completed prompts
streamed to the decode worker layer by layer; each rank holds half the routed
experts; an idle group costs little CPU. Killing one rank fails the other's in-flight prefill
with a reason code within the group's timeout: the decode worker recomputes it (same tokens), the
survivor leaves the registry and refuses new prefills, and the group restarts under its names.

The tests share one cluster and run in file order (the last one breaks and restarts the group)."""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import psutil
import pytest
import ray

from cluster.launcher import ClusterOptions, LocalCluster
from cluster.settings import Environment
from model.checkpoint import load_checkpoint
from model.sampling import SamplingParams
from tests.cluster.test_pd_cluster import assert_idle, collect, reference
from worker_runtime.options import ExpertParallelOptions, WorkerOptions
from worker_runtime.registry import Registry
from worker_runtime.wire import GenerateRequest

pytestmark = pytest.mark.cluster  # starts Ray

pytest.importorskip("nixl")

TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def cluster(tiny_official_ckpt):
    options = WorkerOptions(str(tiny_official_ckpt), "", max_tokens=512, max_seqs=8, prefill_token_budget=48,
                            lease_s=5.0, prefill_ep=ExpertParallelOptions(size=2, timeout_s=TIMEOUT_S))
    c = LocalCluster(ClusterOptions(options, prefill=2, decode=1), Environment(None, None, Path("/tmp"))).start()
    yield c
    c.stop()


def requests(prefix: str, n: int, seed: int, max_tokens: tuple[int, int] = (2, 5)) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [GenerateRequest(f"{prefix}{i}", tuple(rng.randrange(256) for _ in range(rng.randrange(10, 80))),
                            max_tokens=rng.randrange(*max_tokens),
                            sampling=SamplingParams() if i % 3 else SamplingParams(temperature=1.0, top_k=40, seed=i))
            for i in range(n)]


def serve(cluster, reqs: list[GenerateRequest], ranks: list[int]) -> list[list[int]]:
    """Each request through prefill rank ranks[i] and the decode worker, concurrently."""
    async def run():
        d = cluster.decode[0]
        return await asyncio.gather(*(collect(d, r, cluster.prefill[k]) for r, k in zip(reqs, ranks)))
    return asyncio.run(run())


def status(cluster) -> list[dict]:
    return ray.get([a.ep_status.remote() for a in cluster.prefill])


def test_group_outputs_equal_generate(cluster, tiny_official_ckpt):
    one = requests("one", 2, seed=1)  # all on rank 0: rank 1 joins its steps idle
    both = requests("both", 4, seed=2)  # over both ranks, concurrently
    before = status(cluster)
    got = serve(cluster, one, [0] * len(one))
    after_one = status(cluster)
    got += serve(cluster, both, [i % 2 for i in range(len(both))])
    after = status(cluster)
    for r, tokens in zip(one + both, got):
        assert tokens == reference(tiny_official_ckpt, r), r.request_id
    assert after_one[1]["steps"] == before[1]["steps"] and after_one[1]["idle_steps"] > before[1]["idle_steps"]
    assert all(s["state"] == "active" and s["steps"] > 0 for s in after)
    assert ray.get(cluster.decode[0].page_accounting.remote())["fallbacks"] == 0
    # each rank's completed prompts were written layer by layer as its forward computed them
    streamed = [ray.get(a.page_accounting.remote())["layer_streamed"] for a in cluster.prefill]
    assert streamed[0] > 0 and streamed[1] > 0, streamed
    for actor in cluster.prefill:
        assert_idle(actor, prefill=True)
    assert_idle(cluster.decode[0])


def test_each_rank_holds_its_slice_of_the_experts(cluster, tiny_official_ckpt):
    cfg, model = load_checkpoint(tiny_official_ckpt)
    full = sum(p.numel() for b in [*model.layers, *model.mtp] for p in b.ffn.experts.parameters())
    E = cfg.n_routed_experts
    got = status(cluster)
    assert [s["experts"] for s in got] == [(0, E // 2), (E // 2, E // 2)]
    assert [s["rank"] for s in got] == [0, 1] and all(s["world"] == 2 for s in got)
    assert all(s["expert_params"] * 2 == full for s in got)


def test_idle_group_costs_little_cpu(cluster):
    assert_little_cpu(cluster.prefill)


def assert_little_cpu(actors) -> None:
    """Each actor's process uses well under a core over 2 s (an idle group: no spinning loop)."""
    pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors])
    procs = [psutil.Process(p) for p in pids]
    start = [p.cpu_times() for p in procs]
    time.sleep(2.0)
    used = [(p.cpu_times().user + p.cpu_times().system - s.user - s.system) / 2.0 for p, s in zip(procs, start)]
    assert all(u < 0.25 for u in used), used  # a spinning loop would be ~1.0 (one core)


def test_killed_rank_fails_the_other_ranks_prefill_with_a_reason(cluster, tiny_official_ckpt):
    rng = random.Random(3)
    long = GenerateRequest("long", tuple(rng.randrange(256) for _ in range(320)), max_tokens=3, ignore_eos=True)
    survivor, victim = cluster.prefill
    idle_before = ray.get(victim.ep_status.remote())["idle_steps"]

    async def run():
        task = asyncio.ensure_future(collect(cluster.decode[0], long, survivor))
        while ray.get(victim.ep_status.remote())["idle_steps"] <= idle_before:  # the long prompt is prefilling
            await asyncio.sleep(0.02)
        ray.kill(victim)
        killed = time.monotonic()
        tokens = await task
        return tokens, killed

    tokens, killed = asyncio.run(run())
    assert tokens == reference(tiny_official_ckpt, long)  # recomputed by the decode worker
    assert ray.get(cluster.decode[0].page_accounting.remote())["fallbacks"] == 1
    s = ray.get(survivor.ep_status.remote())
    assert s["state"] == "failed" and s["failure"], s
    assert time.monotonic() - killed < TIMEOUT_S + 10
    with pytest.raises(ray.exceptions.RayTaskError, match="ep_group_failed"):
        ray.get(survivor.prefill.remote(GenerateRequest("late", (1, 2, 3), 1), b"", b"", b""))
    assert "prefill-0" not in {w.worker_id for w in Registry(cluster.registry_url).workers()}
    assert_idle(survivor, prefill=True)

    assert cluster.broken_groups("prefill") == [0]
    cluster.restart_group("prefill", 0)
    assert cluster.broken_groups("prefill") == []
    assert [s["state"] for s in status(cluster)] == ["active", "active"]
    reqs = requests("again", 2, seed=4)
    for r, tokens in zip(reqs, serve(cluster, reqs, [0, 1])):
        assert tokens == reference(tiny_official_ckpt, r), r.request_id
    assert ray.get(cluster.decode[0].page_accounting.remote())["fallbacks"] == 1
