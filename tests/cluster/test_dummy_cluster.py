"""A P/D cluster serving dummy weights (`--load-format dummy`, config.json alone), both pools
expert-parallel groups of 2, as the full-size V4-Flash benchmark runs it (real Ray actors, Valkey
registry, NIXL transfers; tiny shapes on CPU here).

Checked: each rank made only its own slice of the routed experts (its parameter count is half of
a whole dummy model's), the same slice at the same rank of either pool; so a request's tokens are
the same whether its KV was prefilled by the prefill group and shipped, or prefilled by the
decode worker itself; and every page comes back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import ray

from cluster.launcher import ClusterOptions, LocalCluster
from cluster.settings import Environment
from model.checkpoint import write_config
from model.dummy_weights import dummy_model
from tests.cluster.test_ep_prefill import requests
from tests.cluster.test_pd_cluster import assert_idle, collect
from worker_runtime.options import ExpertParallelOptions, WorkerOptions

pytestmark = [pytest.mark.cluster, pytest.mark.exhaustive]  # starts Ray; ~50 s, the GPU serve runs load dummy weights

pytest.importorskip("nixl")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_ckpt_cfg):
    model_dir = tmp_path_factory.mktemp("dummy")
    write_config(model_dir, tiny_ckpt_cfg)  # no weights
    ep = ExpertParallelOptions(size=2, timeout_s=10.0)
    options = WorkerOptions(str(model_dir), "", load_format="dummy", kv_dtype="fp8_pack", max_tokens=256,
                            max_seqs=4, prefill_token_budget=64, lease_s=5.0, prefill_ep=ep, decode_ep=ep)
    c = LocalCluster(ClusterOptions(options, prefill=2, decode=2), Environment(None, None, Path("/tmp"))).start()
    yield c
    c.stop()


def test_each_rank_makes_only_its_slice(cluster, tiny_ckpt_cfg):
    whole = dummy_model(tiny_ckpt_cfg, "torch", "cpu")
    full = sum(t.numel() for b in whole.layers for t in b.ffn.experts.buffers())
    E = tiny_ckpt_cfg.n_routed_experts
    for pool in (cluster.prefill, cluster.decode):
        got = ray.get([a.ep_status.remote() for a in pool])
        assert [s["experts"] for s in got] == [(0, E // 2), (E // 2, E // 2)]
        assert all(s["expert_params"] * 2 == full for s in got)


def test_remote_and_local_prefill_give_the_same_tokens(cluster, tiny_ckpt_cfg):
    reqs = requests("dummy", 4, seed=4, max_tokens=(4, 9))

    async def run(remote: bool):
        return await asyncio.gather(*(collect(cluster.decode[i % 2], r, cluster.prefill[i // 2] if remote else None)
                                      for i, r in enumerate(reqs)))

    shipped, local = asyncio.run(run(True)), asyncio.run(run(False))
    assert shipped == local
    assert all(len(t) == r.max_tokens or t[-1] == tiny_ckpt_cfg.eos_token_id for t, r in zip(shipped, reqs))
    for actor in cluster.decode:
        acct = ray.get(actor.page_accounting.remote())
        assert acct["fallbacks"] == 0, acct  # every shipped KV arrived
        assert_idle(actor)
    for actor in cluster.prefill:
        assert_idle(actor, prefill=True)
