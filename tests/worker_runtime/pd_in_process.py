"""One prefill worker, one decode worker and an HTTP router in this process, over the in-process
transport and a real Valkey registry (no Ray, no NIXL): the request path of `v4serve up` for tests
that drive it through the router (`pd_in_process`) and inspect the workers afterwards. The
registry is the `registry_url` fixture's (tests/conftest.py)."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass

from decode_worker.actor import DecodeWorker
from prefill_worker.actor import PrefillWorker
from router.app import RouterHandle, serve
from router.cluster_backend import ClusterBackend
from router.config import PlacementConfig, RouterConfig
from router.metrics import RouterMetrics
from worker_runtime.in_process import InProcess
from worker_runtime.options import WorkerOptions
from worker_runtime.registry import Registry


@dataclass
class PD:
    router: RouterHandle
    backend: ClusterBackend
    prefill: PrefillWorker
    decode: DecodeWorker


@asynccontextmanager
async def pd_in_process(options: WorkerOptions, tokenizer, metrics: RouterMetrics | None = None,
                        placement: PlacementConfig | None = None):
    """Start prefill-0, decode-0, a ClusterBackend and an HTTP router (no gRPC) on the running
    loop; every prompt goes through the prefill worker by default (threshold 0). Stops them all on
    exit, in reverse order."""
    local = InProcess()
    prefill = PrefillWorker("prefill-0", options, local)
    decode = DecodeWorker("decode-0", options, local)
    local.add("prefill-0", prefill)
    local.add("decode-0", decode)
    await prefill.start()
    await decode.start()
    backend = ClusterBackend(Registry(options.registry_url, options.cluster), tokenizer, "tiny", options.max_tokens,
                             placement or PlacementConfig(remote_prefill_threshold=0), metrics,
                             get_actor=local.get_actor)
    try:
        await backend.start()
        await backend.wait_for_workers(prefill=1, decode=1, timeout_s=30)
        router = await serve(RouterConfig(http_port=0, grpc_port=None), backend, metrics)
        try:
            yield PD(router, backend, prefill, decode)
        finally:
            await router.stop()
    finally:
        await backend.stop()
        await prefill.stop()
        await decode.stop()
