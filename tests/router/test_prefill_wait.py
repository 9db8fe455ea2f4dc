"""The cluster backend holds a request while every prefill worker's queue is past
PlacementConfig.max_prefill_queue_tokens: it is placed once a queue drains to the bound, and
refused with DEADLINE_EXCEEDED when its deadline passes first. The backend's view is set as its
registry refresh sets it; the registry itself is never reached."""

import asyncio
import time

from router.cluster_backend import ClusterBackend
from router.config import PlacementConfig
from router.metrics import RouterMetrics
from worker_runtime.registry import Registry
from worker_runtime.wire import ErrorCode, GenerateRequest, WorkerLoad

CFG = PlacementConfig(page_size=4, remote_prefill_threshold=8, max_prefill_queue_tokens=1000)


def backend(prefill_queued: int) -> ClusterBackend:
    b = ClusterBackend(Registry("redis://127.0.0.1:1"), None, "tiny", 4096, CFG, RouterMetrics(), refresh_s=0.02)
    b.loads = {"d1": WorkerLoad("d1", "decode", free_pages=100, total_pages=100),
               "p1": WorkerLoad("p1", "prefill", queued_prefill_tokens=prefill_queued)}
    return b


def request(deadline_s: float) -> GenerateRequest:
    return GenerateRequest("r1", tuple(range(1, 21)), 4, deadline=time.time() + deadline_s)


def test_a_request_waits_for_a_prefill_queue_under_the_bound_then_is_placed_there():
    b = backend(5000)

    async def run():
        async def drain():
            await asyncio.sleep(0.2)
            b.loads["p1"] = WorkerLoad("p1", "prefill", queued_prefill_tokens=800)

        t0 = time.perf_counter()
        (where, refused), _ = await asyncio.gather(b._place(request(30.0), set()), drain())
        return where, refused, time.perf_counter() - t0

    where, refused, waited = asyncio.run(run())
    assert refused is None and where.prefill_id == "p1" and not where.wait and waited >= 0.2
    assert b.metrics.sample("v4serve_prefill_waits_total") == 1.0


def test_a_request_whose_deadline_passes_while_every_queue_is_full_is_refused():
    b = backend(5000)
    t0 = time.perf_counter()
    where, refused = asyncio.run(b._place(request(0.15), set()))
    assert where is None and refused.error.code is ErrorCode.DEADLINE_EXCEEDED
    assert time.perf_counter() - t0 >= 0.15


def test_this_routers_own_placed_prompt_tokens_count_before_the_workers_report_them():
    b = backend(0)
    b.own_prefill["p1"] = 1200  # placed here, not yet in p1's report
    assert b._view("prefill")[0].queued_prefill_tokens == 1200
    where, refused = asyncio.run(b._place(request(0.05), set()))
    assert where is None and refused.error.code is ErrorCode.DEADLINE_EXCEEDED
