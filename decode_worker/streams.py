"""The token streams of a decode worker: one record per request that a caller reads (or will read)
its chunks from, keyed by the request id here.

    generate() ─▶ STARTING ──start──▶ STREAMING ──close──▶ ENDED
                     │                    ▲
                     └──cancel──▶ ENDED   │attach
                                          │
    migrate_in() ─▶ UNATTACHED ───────────┘
                     └──drop──▶ ENDED

STARTING    generate() took the id and reaches the prefill worker; nothing runs yet, and a caller
            that goes away now leaves nothing to abort (cancel).
STREAMING   the request runs (prefill, KV transfer, decode) and a caller reads its chunks from
            the queue, until the last one (a finish reason, an error, or `Moved`) or until the
            caller goes away, which aborts the request (close).
UNATTACHED  migrated in: the request decodes here and its chunks wait in the queue for the router
            to `attach`, until `until`; nobody will once the migration failed (an error chunk),
            the request was aborted, or `until` passed (drop).
ENDED       the record left the table; the id is free again.

Only the worker's event loop moves records; every move checks its source state and raises
`IllegalTransition` otherwise. What a stream's request is doing meanwhile (awaiting its KV, in the
engine, migrating out) is Inbound's, the engine's and Outbound's.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from worker_runtime.wire import TokenChunk


class IllegalTransition(RuntimeError):
    """A stream was asked to move from a state that has no such move."""


class Phase(enum.Enum):
    STARTING = "starting"
    STREAMING = "streaming"
    UNATTACHED = "unattached"
    ENDED = "ended"


P = Phase
# event → {from: to}; anything else raises IllegalTransition
MOVES: dict[str, dict[Phase, Phase]] = {
    "start": {P.STARTING: P.STREAMING},
    "cancel": {P.STARTING: P.ENDED},
    "attach": {P.UNATTACHED: P.STREAMING},
    "close": {P.STREAMING: P.ENDED},
    "drop": {P.UNATTACHED: P.ENDED},
}


@dataclass(eq=False)
class Stream:
    request_id: str
    state: Phase
    until: float = 0.0  # UNATTACHED: unix s after which nobody will attach (source resumed it, router lost it)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # chunks not read yet


class Streams:
    def __init__(self):
        self._by_id: dict[str, Stream] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, request_id: str) -> Stream | None:
        return self._by_id.get(request_id)

    def live(self) -> list[Stream]:
        return list(self._by_id.values())

    # --- transitions ------------------------------------------------------------------------
    def open(self, request_id: str) -> Stream:
        """generate() → STARTING. Raises ValueError if the id is in use (ids key all state here)."""
        return self._add(Stream(request_id, P.STARTING))

    def migrated_in(self, request_id: str, until: float) -> Stream:
        """migrate_in() → UNATTACHED until `until`. Raises ValueError if the id is in use."""
        return self._add(Stream(request_id, P.UNATTACHED, until))

    def start(self, s: Stream) -> None:
        self._move(s, "start")

    def cancel(self, s: Stream) -> None:
        self._move(s, "cancel")

    def attach(self, s: Stream) -> None:
        self._move(s, "attach")

    def close(self, s: Stream) -> None:
        self._move(s, "close")

    def drop(self, s: Stream) -> None:
        self._move(s, "drop")

    def deliver(self, chunk: TokenChunk) -> None:
        """Queue `chunk` for its stream's reader; an error ends an unattached stream (nobody will
        attach to a failed migration in, or an aborted one), its chunks unread."""
        s = self._by_id.get(chunk.request_id)
        if s is None:
            return
        s.queue.put_nowait(chunk)
        if chunk.error is not None and s.state is P.UNATTACHED:
            self.drop(s)

    async def read(self, s: Stream, abandoned: Callable[[str], None]) -> AsyncIterator[TokenChunk]:
        """Yield a STREAMING record's chunks up to its last (a finish reason, an error, `Moved`),
        then close it. A reader that goes away first closes it too, and `abandoned(request_id)`
        is called: nobody will read the rest."""
        finished = False
        try:
            while True:
                chunk = await s.queue.get()
                yield chunk
                if chunk.finish_reason or chunk.error or chunk.moved:
                    finished = True
                    return
        finally:
            self.close(s)
            if not finished:
                abandoned(s.request_id)

    def overdue(self, now: float) -> list[Stream]:
        """Unattached streams nobody attached to by their `until`."""
        return [s for s in self._by_id.values() if s.state is P.UNATTACHED and now > s.until]

    def _add(self, s: Stream) -> Stream:
        if s.request_id in self._by_id:
            raise ValueError(f"request id {s.request_id!r} already in progress")
        self._by_id[s.request_id] = s
        return s

    def _move(self, s: Stream, event: str) -> None:
        to = MOVES[event].get(s.state)
        if to is None or self._by_id.get(s.request_id) is not s:
            raise IllegalTransition(f"{s.request_id}: no {event!r} from {s.state.name}")
        s.state = to
        if to is P.ENDED:
            del self._by_id[s.request_id]
