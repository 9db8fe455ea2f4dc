"""`v4serve up` and `v4serve router`: serve the pools, owning them or joining them.

    v4serve up       starts the registry server and Ray unless REDIS_URL / RAY_ADDRESS name them,
                     creates the prefill and decode pools (named actors in the Ray namespace of
                     the cluster name, cluster/launcher.py), runs their autoscaler if asked, and
                     serves, supervising the pools (cluster/supervisor.py: a worker that dies is
                     replaced under its name, an expert-parallel group that breaks as a whole);
                     on SIGINT/SIGTERM stops the router, the actors, Ray and the registry
                     server it started, leaving no processes behind
    v4serve router   joins the Ray cluster at RAY_ADDRESS and the registry at REDIS_URL and serves
                     the pools a `v4serve up` owns there; on SIGINT/SIGTERM stops only itself

Any number of routers serve one set of pools and place requests alike: each reads the workers'
loads and the whole KV-event stream (the prefix index) from the registry. So routers can be
replicated and restarted freely, while the one process that owns the pools stays.

Both print one line containing `ready` and the addresses once they can serve. `up` listens only
once its workers registered; a router listens at once (its /health answers 503 until a decode
worker is registered, which is what a readiness probe wants) and prints the line when one is.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, replace

import ray
from prometheus_client.core import GaugeMetricFamily

from cluster.autoscale_actuator import ActuatorOptions, RayActuator, follow_ray_resources
from cluster.autoscaler import Autoscaler, AutoscalerConfig
from cluster.launcher import ClusterOptions, LocalCluster, join_ray
from cluster.settings import Environment
from cluster.startup import StartupError
from cluster.supervisor import Supervisor
from model.checkpoint import read_config
from model.tokenizer import load_tokenizer
from router.app import serve
from router.cluster_backend import ClusterBackend
from router.config import RouterConfig
from router.metrics import RouterMetrics
from worker_runtime.registry import Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpOptions:
    cluster: ClusterOptions
    router: RouterConfig
    autoscale: str = "off"  # "off" | "policy" (queue-depth autoscaler) | "follow" (one worker per Ray slot)
    autoscale_config: AutoscalerConfig | None = None
    start_timeout_s: float = 120.0

    def __post_init__(self):
        for role in ("prefill", "decode"):
            if self.autoscale != "off" and self.cluster.ep_size(role) > 1:
                raise ValueError(f"autoscaling resizes the pools one worker at a time: it cannot be used with "
                                 f"expert-parallel {role} ({role}_ep.size > 1)")


@dataclass(frozen=True)
class RouterOptions:
    """A router of pools owned elsewhere: the settings it must share with their `v4serve up`."""

    model_dir: str  # the same checkpoint (tokenizer, config)
    router: RouterConfig
    cluster: str = "default"  # registry prefix and Ray namespace of the pools
    max_tokens: int = 4096  # the workers' longest request (their --max-model-len)
    page_size: int = 256  # the workers' KV page size (prefix hashes are computed per page)


async def run(options: UpOptions, env: Environment, ready_line=print) -> None:
    worker = options.cluster.worker
    cluster = LocalCluster(options.cluster, env)
    backend = handle = actuator = supervisor = None
    try:
        # On the main thread, and before our handlers: Ray installs signal handlers of its own.
        began = time.monotonic()
        cluster.start(options.start_timeout_s)
        stop = _stop_on_signals()
        backend = await _backend(cluster.registry_url, worker.model_dir, worker.cluster, worker.max_tokens,
                                 worker.page_size, options.router)
        left = max(1.0, options.start_timeout_s - (time.monotonic() - began))
        try:
            await backend.wait_for_workers(options.cluster.prefill, options.cluster.decode, left)
        except TimeoutError as e:
            raise StartupError(f"the workers serve but did not register in the registry at {cluster.registry_url} "
                               f"within --start-timeout {options.start_timeout_s:g} s: {e}") from None
        actuator = _actuator(options, cluster)
        backend.metrics.registry.register(_PoolSizes(cluster, actuator))
        supervisor = Supervisor(cluster).start()
        handle = await serve(options.router, backend, backend.metrics)
        ready_line(f"v4serve ready http={handle.http_url} grpc={handle.grpc_target} "
                   f"prefill={options.cluster.prefill} decode={options.cluster.decode} registry={cluster.registry_url} "
                   f"ray={ray.get_runtime_context().gcs_address} cluster={worker.cluster}")
        await stop.wait()
    finally:
        if supervisor is not None:
            await supervisor.stop()
        if actuator is not None:
            await actuator.stop()
        if handle is not None:
            await handle.stop()
        if backend is not None:
            await backend.stop()
        await asyncio.to_thread(cluster.stop)


async def run_router(options: RouterOptions, env: Environment, ready_line=print) -> None:
    """Serve the pools of `options.cluster` that another process owns (env names Ray and Redis)."""
    if not (env.ray_address and env.redis_url):
        raise ValueError("v4serve router serves pools that `v4serve up` owns: set RAY_ADDRESS (their Ray "
                         "cluster) and REDIS_URL (their registry)")
    backend = handle = None
    try:
        join_ray(env.ray_address, options.cluster)  # main thread, before our signal handlers
        stop = _stop_on_signals()
        backend = await _backend(env.redis_url, options.model_dir, options.cluster, options.max_tokens,
                                 options.page_size, options.router)
        handle = await serve(options.router, backend, backend.metrics)
        waiting = asyncio.create_task(backend.wait_for_workers(0, 1, timeout_s=float("inf")))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if waiting.done():
            health = backend.health()
            ready_line(f"v4serve router ready http={handle.http_url} grpc={handle.grpc_target} "
                       f"prefill={health['prefill']} decode={health['decode']} registry={env.redis_url} "
                       f"cluster={options.cluster}")
        else:
            waiting.cancel()
        await stopping
    finally:
        if handle is not None:
            await handle.stop()
        if backend is not None:
            await backend.stop()
        ray.shutdown()  # disconnects; the pools belong to their owner


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    return stop


async def _backend(registry_url: str, model_dir: str, cluster: str, max_tokens: int, page_size: int,
                   router: RouterConfig) -> ClusterBackend:
    """The router's view of the pools (registry loads, prefix index), started; its metrics are
    the router's, with the pool gauges the autoscalers read."""
    cfg = read_config(model_dir)
    tokenizer = load_tokenizer(router.tokenizer_dir or model_dir, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    metrics = RouterMetrics()
    backend = ClusterBackend(Registry(registry_url, cluster), tokenizer, router.model_name or "v4serve",
                             min(cfg.max_position_embeddings, max_tokens),
                             replace(router.placement, page_size=page_size), metrics)
    metrics.watch_pools(lambda: backend.loads.values(),
                        lambda: {w: backend.index.pages(w) for w in backend.index.workers()})
    await backend.start()
    return backend


class _PoolSizes:
    """v4serve_pool_workers{pool}: the workers the pools owner keeps per pool (the autoscaler's
    current decision, starting and serving workers; else the fixed size). Only the pools owner
    exports it, so no sum over routers counts it twice."""

    def __init__(self, cluster: LocalCluster, actuator: RayActuator | None):
        self.cluster, self.actuator = cluster, actuator

    def collect(self):
        sizes = (self.actuator.counts() if self.actuator is not None else
                 {"prefill": len(self.cluster.prefill), "decode": len(self.cluster.decode)})
        family = GaugeMetricFamily("v4serve_pool_workers", "Workers the pools owner keeps per pool (the "
                                   "autoscaler's decision).", labels=["pool"])
        for pool, n in sorted(sizes.items()):
            family.add_metric([pool], n)
        yield family


def _actuator(options: UpOptions, cluster: LocalCluster) -> RayActuator | None:
    """The pools' autoscaler, if asked for: it drains a worker before removing it."""
    if options.autoscale == "off":
        return None
    registry = Registry(cluster.registry_url, options.cluster.worker.cluster)
    if options.autoscale == "policy":
        config = options.autoscale_config or AutoscalerConfig()
        desired = Autoscaler(config, {"prefill": options.cluster.prefill, "decode": options.cluster.decode}).step
        return RayActuator(cluster, registry, desired, ActuatorOptions(interval_s=config.interval_s)).start()
    return RayActuator(cluster, registry, follow_ray_resources, ActuatorOptions(scale_down=False)).start()
