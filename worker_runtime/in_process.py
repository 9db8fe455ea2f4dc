"""Workers of one process, reached the way Ray reaches actors: the fast request path for tests and
single-process tools, with nothing of Ray and no NIXL.

    local = InProcess()
    prefill = PrefillWorker("prefill-0", options, local)
    decode = DecodeWorker("decode-0", options, local)
    await prefill.start(); await decode.start()
    backend = ClusterBackend(registry, ..., get_actor=local.get_actor)

- KV moves between the workers' pools as real bytes, through each worker's `LocalAgent` on the
  process's `AgentDirectory` (kvtransfer/local_agent.py): the same Sender / Receiver protocol,
  checksums and leases as between processes.
- `get_actor(name)` answers as `ray.get_actor` does (ValueError for a name nobody holds) with an
  `ActorHandle`, whose `handle.method.remote(...)` runs the worker's method on the caller's event
  loop: a coroutine method as a task (an awaitable, and it runs even if nobody awaits it, as a Ray
  call does), an async generator as a stream of awaitables (Ray's `num_returns="streaming"`), a
  plain method at once.
- Arguments are passed by reference, not copied: every message in the wire contract is frozen.

The registry stays the real one (a Redis-protocol server): membership, load and KV events reach
the router as they do between processes.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from kvtransfer.local_agent import AgentDirectory, LocalAgent


class InProcess:
    """The workers of this process, by name, and the directory their KV agents share."""

    def __init__(self) -> None:
        self.agents = AgentDirectory()
        self._workers: dict[str, Any] = {}

    def agent(self, name: str, pools: Mapping[str, torch.Tensor]) -> LocalAgent:
        return LocalAgent(name, pools, self.agents)

    def add(self, name: str, worker: Any) -> None:
        if name in self._workers:
            raise ValueError(f"a worker named {name!r} is already in this process")
        self._workers[name] = worker

    def remove(self, name: str) -> None:
        self._workers.pop(name, None)

    def get_actor(self, name: str) -> "ActorHandle":
        worker = self._workers.get(name)
        if worker is None:
            raise ValueError(f"no worker named {name!r} in this process")
        return ActorHandle(worker)


class ActorHandle:
    """A worker called as a Ray actor handle is: `handle.method.remote(*args)`."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker

    def __getattr__(self, name: str) -> "_Method":
        return _Method(getattr(self._worker, name))


class _Method:
    def __init__(self, fn) -> None:
        self._fn = fn

    def options(self, **_) -> "_Method":
        """Ray's call options (e.g. num_returns="streaming"): an async generator streams anyway."""
        return self

    def remote(self, *args, **kwargs):
        if inspect.isasyncgenfunction(self._fn):
            return _Stream(self._fn(*args, **kwargs))
        if inspect.iscoroutinefunction(self._fn):
            return asyncio.ensure_future(self._fn(*args, **kwargs))
        done = asyncio.get_running_loop().create_future()
        try:
            done.set_result(self._fn(*args, **kwargs))
        except Exception as e:  # the caller's, when it awaits the result (as with Ray)
            done.set_exception(e)
        return done


class _Stream:
    """An async generator's items as already-resolved awaitables, as a Ray streaming call yields
    object refs; closing it (the caller stopped reading) closes the generator, as Ray cancels it."""

    def __init__(self, gen) -> None:
        self._gen = gen

    def __aiter__(self) -> "_Stream":
        return self

    async def __anext__(self) -> asyncio.Future:
        item = await self._gen.__anext__()
        ref = asyncio.get_running_loop().create_future()
        ref.set_result(item)
        return ref

    async def aclose(self) -> None:
        await self._gen.aclose()
