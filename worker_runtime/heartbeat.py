"""The registry heartbeat every worker runs: re-publish membership, metadata and load."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import redis

from worker_runtime.registry import Registry
from worker_runtime.wire import WorkerInfo

log = logging.getLogger(__name__)


async def heartbeat_loop(registry: Registry, info: Callable[[], WorkerInfo], interval_s: float) -> None:
    """Runs until cancelled. A Redis outage is logged and retried: when Redis comes back the next
    beat re-creates the worker's key, which is how the registry rebuilds after a restart."""
    while True:
        try:
            await asyncio.to_thread(registry.heartbeat, info())
        except redis.RedisError as e:
            log.warning("heartbeat failed: %s", e)
        await asyncio.sleep(interval_s)
