"""A worker restarted under the same name is a new peer: a new NIXL incarnation (epoch), a new
handshake, and nothing addressed to its previous incarnation is ever written into it.

Through the cluster: the prefill worker is streaming a long prompt's pages into decode-0 when
decode-0 is killed and started again under the same name. The new incarnation serves a request
through the same prefill worker (which handshakes it). A late request carrying the old
incarnation's target and metadata is refused as stale — it neither swaps the new incarnation's
handshake out nor writes anything — the new incarnation keeps serving, and the only pages of it
that ever held data are the ones it reserved itself."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace
from pathlib import Path

import pytest
import ray

from cluster.launcher import ClusterOptions, LocalCluster
from cluster.settings import Environment
from decode_worker.actor import DecodeWorker
from kvtransfer.faults import FaultPlan
from kvtransfer.protocol import TransferTarget
from model.checkpoint import load_checkpoint
from model.generate import generate
from model.kv_pool import KVPools
from worker_runtime.kv_link import layout_of
from worker_runtime.options import WorkerOptions
from worker_runtime.wire import GenerateRequest

pytestmark = pytest.mark.cluster  # starts Ray

pytest.importorskip("nixl")


def test_restarted_decode_worker_is_a_new_peer(tiny_official_ckpt):
    options = WorkerOptions(str(tiny_official_ckpt), "", max_tokens=1024, max_seqs=4, lease_s=4.0,
                            prefill_token_budget=32, prefix_cache=False)
    cluster = LocalCluster(ClusterOptions(options, prefill=1, decode=1), Environment(None, None, Path("/tmp"))).start()
    rng = random.Random(3)
    x = GenerateRequest("x", tuple(rng.randrange(256) for _ in range(1000)), max_tokens=4)
    y = GenerateRequest("y", tuple(rng.randrange(256) for _ in range(100)), max_tokens=1)
    late = GenerateRequest("late", tuple(rng.randrange(256) for _ in range(100)), max_tokens=1)
    z = GenerateRequest("z", tuple(rng.randrange(256) for _ in range(100)), max_tokens=1)
    p, old = cluster.prefill[0], cluster.decode[0]
    try:
        old_epoch = ray.get(old.start.remote())["epoch"]
        old_name, _, old_metadata = ray.get(old.peer_info.remote())
        # slow every write down so that x is still streaming when the new incarnation is up
        ray.get(p.set_faults.remote(FaultPlan(stall_before_write_s=0.15)))
        x_stream = old.generate.options(num_returns="streaming").remote(x, p)
        deadline = time.time() + 60
        while ray.get(p.page_accounting.remote())["streamed_pages"] == 0:
            assert time.time() < deadline, "x never started streaming"
            time.sleep(0.05)
        ray.kill(old)
        del x_stream
        worker = replace(options, registry_url=cluster.registry_url)
        new = ray.remote(DecodeWorker).options(name="decode-0", resources={"decode": 1}, num_cpus=0,
                                               max_concurrency=10_000, max_restarts=0).remote("decode-0", worker)
        cluster.decode = [new]
        started = ray.get(new.start.remote())
        assert started["agent"] == "decode-0" and started["epoch"] != old_epoch

        async def collect(req):
            out = []
            async for ref in new.generate.options(num_returns="streaming").remote(req, p):
                chunk = await ref
                assert chunk.error is None, chunk.error
                out.extend(chunk.token_ids)
            return out

        cfg, model = load_checkpoint(tiny_official_ckpt)
        pools = KVPools(cfg, "fp32", max_tokens=1024, max_seqs=4)

        def reference(req):
            return generate(model, KVPools(cfg, "fp32", max_tokens=512, max_seqs=1), list(req.prompt_ids), 1,
                            req.sampling).token_ids

        assert asyncio.run(collect(y)) == reference(y)
        acct = ray.get(p.page_accounting.remote())["transfers"]
        # x's writes into the dead incarnation failed, or were refused once the new one was handshaken
        assert acct["failures"].get("xfer_error", 0) + acct["failures"].get("stale_target", 0) >= 1, acct
        # a late request of the old incarnation (its target, its metadata) is refused, nothing written
        counts = pools.resume_page_counts(len(late.prompt_ids))
        target = TransferTarget("late", old_name, old_epoch, layout_of(pools).layout_id,
                                tuple((k, tuple(range(n))) for k, n in counts.items() if n), time.time() + 10)
        with pytest.raises(ray.exceptions.RayTaskError, match="StaleTarget|restarted since"):
            ray.get(p.prefill.remote(late, target.to_bytes(), old_metadata, layout_of(pools).to_bytes()))
        assert ray.get(p.page_accounting.remote())["transfers"]["failures"].get("stale_target", 0) >= 1
        assert asyncio.run(collect(z)) == reference(z)  # the new incarnation's handshake is intact
        assert "peer_restarted" not in ray.get(p.page_accounting.remote())["transfers"]["failures"]
        ray.get(p.set_faults.remote(None))
        # the new incarnation's pages that ever held data are exactly y's, which it reserved first
        y_pages = pools.resume_page_counts(len(y.prompt_ids))  # z reused y's pages (freed first)
        written = ray.get(new.written_pages.remote())
        for kind, pages in written.items():
            assert set(pages) <= set(range(y_pages.get(kind, 0))), (kind, pages, y_pages)
        new_acct = ray.get(new.page_accounting.remote())
        assert new_acct["transfers"]["failures"] == {} and new_acct["free"] == new_acct["idle"]
        deadline = time.time() + 30  # x's KV was parked for a re-pull nobody made: freed after a lease
        while True:
            acct = ray.get(p.page_accounting.remote(drop_cache=True))
            if acct["free"] == acct["idle"] or time.time() > deadline:
                break
            time.sleep(0.5)
        assert acct["free"] == acct["idle"], acct
    finally:
        cluster.stop()
