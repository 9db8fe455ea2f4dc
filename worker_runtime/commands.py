"""The command queue of a worker loop.

Actor methods run on the event loop while the model step runs in a thread; so that only the
loop ever touches the engine, methods queue their changes as commands and the loop applies them
between steps. An idle loop sleeps until a command arrives (or a timeout: leases need checking).
"""

from __future__ import annotations

import asyncio
from typing import Callable, TypeVar

T = TypeVar("T")


class Commands:
    def __init__(self):
        self._pending: list[Callable[[], None]] = []
        self._wakeup = asyncio.Event()

    def put(self, command: Callable[[], None]) -> None:
        self._pending.append(command)
        self._wakeup.set()

    async def call(self, command: Callable[[], T]) -> T:
        """Queue `command` and wait for the loop to apply it; its result (or exception) is ours."""
        done = asyncio.get_running_loop().create_future()

        def run() -> None:
            if done.cancelled():
                return
            try:
                done.set_result(command())
            except Exception as e:  # the caller's to handle, not the loop's
                done.set_exception(e)

        self.put(run)
        return await done

    def run(self) -> None:
        """Apply every queued command, oldest first (commands queued meanwhile wait a turn)."""
        pending, self._pending = self._pending, []
        for command in pending:
            command()

    def __bool__(self) -> bool:
        return bool(self._pending)

    async def wait(self, timeout_s: float = 0.05) -> None:
        self._wakeup.clear()
        if not self._pending:
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
