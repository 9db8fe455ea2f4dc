"""`v4serve up`: the whole cluster on this machine (or joined to Ray / Redis given by env).

Starts the registry server, Ray, the prefill and decode pools and the router; prints one line
containing `ready` and the addresses once it can serve; serves until SIGINT/SIGTERM; then stops
the router, the actors, Ray and the registry server, leaving no processes behind.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass

from cluster.autoscale_actuator import ActuatorOptions, RayActuator, follow_ray_resources
from cluster.autoscaler import Autoscaler, AutoscalerConfig
from cluster.launcher import ClusterOptions, LocalCluster
from cluster.registry import Registry
from cluster.settings import Environment
from model.checkpoint import read_config
from model.tokenizer import load_tokenizer
from router.app import serve
from router.cluster_backend import ClusterBackend
from router.config import PlacementConfig, RouterConfig
from router.metrics import RouterMetrics


@dataclass(frozen=True)
class UpOptions:
    cluster: ClusterOptions
    router: RouterConfig
    autoscale: str = "off"  # "off" | "policy" (queue-depth autoscaler) | "follow" (one worker per Ray slot)
    autoscale_config: AutoscalerConfig | None = None
    start_timeout_s: float = 120.0


async def run(options: UpOptions, env: Environment, ready_line=print) -> None:
    model_dir = options.cluster.worker.model_dir
    cfg = read_config(model_dir)
    tokenizer = load_tokenizer(model_dir, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    cluster = LocalCluster(options.cluster, env)
    backend = handle = actuator = None
    try:
        # On the main thread, and before our handlers: Ray installs signal handlers of its own.
        cluster.start()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        metrics = RouterMetrics()
        placement = PlacementConfig(**{**options.router.placement.__dict__, "page_size": options.cluster.worker.page_size})
        backend = ClusterBackend(Registry(cluster.registry_url, options.cluster.worker.cluster), tokenizer,
                                 options.router.model_name or "v4serve", min(cfg.max_position_embeddings,
                                                                              options.cluster.worker.max_tokens),
                                 placement, metrics)
        await backend.start()
        await backend.wait_for_workers(options.cluster.prefill, options.cluster.decode, options.start_timeout_s)
        actuator = _actuator(options, cluster)
        handle = await serve(options.router, backend, metrics)
        ready_line(f"v4serve ready http={handle.http_url} grpc={handle.grpc_target} "
                   f"prefill={options.cluster.prefill} decode={options.cluster.decode} registry={cluster.registry_url}")
        await stop.wait()
    finally:
        if actuator is not None:
            await actuator.stop()
        if handle is not None:
            await handle.stop()
        if backend is not None:
            await backend.stop()
        await asyncio.to_thread(cluster.stop)


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
