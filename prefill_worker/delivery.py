"""Where each request's KV is on its way out of a prefill worker: one record per request, from the
prefill() that brought it until its pages are freed.

    prefill(asker) ─▶ QUEUED ──ask──▶ ASKING ──targeted──┐   (a prefill() that brings no target)
                        ▲                │               │
                        └────no room─────┘               │
                                                         ▼
    prefill(target) ─────────────────────────────────▶ COMPUTING ───computed───▶ SHIPPING ──acked──▶ ACKED
                                                  │    ▲                    │  ▲ │ └─receiver gave up─▶ RELEASED
                                     stream failed│    │re-pull         lost│  │ └─abort─▶ ABORTING ─answer─▶ ABORTED
                                                  ▼    │                    ▼  │re-pull
                                                 DETACHED ───computed───▶ PARKED ──held a lease──▶ EXPIRED

    abort      QUEUED, ASKING, COMPUTING, DETACHED, PARKED ──▶ ABORTED;  SHIPPING, ABORTING ──▶ ABORTING
    re-pull    QUEUED, ASKING, COMPUTING, DETACHED ──▶ COMPUTING;  SHIPPING, PARKED ──▶ SHIPPING (written again)

QUEUED     waits here for its turn, holding nothing: no page here, none reserved at its decode
           worker (so it cannot outlive a lease however long the queue). The worker asks the
           decode worker for a target when the engine is about to start the request.
ASKING     the decode worker was asked for a target: it reserves the pages then and answers with
           the target (→ COMPUTING), or "no room" (→ QUEUED again, asked later), or that it no
           longer wants the request (→ aborted).
COMPUTING  queued or prefilling in the engine; the compressed pages that became final are written
           to the target while the next chunks compute (`streamed`).
DETACHED   still computing, but writing to its decode worker failed (the worker is lost): the KV
           is parked once computed, unless a re-pull gives it a new target first.
SHIPPING   computed; its pages are written (or being written) into the target and the sender's
           answer decides: acked → ACKED; the decode side lost (`LOST`) → PARKED; the decode side
           gave up by itself (it recomputes) → RELEASED. A write that failed with writes still
           in flight stays here, its caller already answered, until that answer.
ABORTING   aborted while writes were in flight: its pages are freed at the sender's answer.
PARKED     its decode worker is lost: the KV is held one more lease for a re-pull.
ACKED, RELEASED, ABORTED, EXPIRED   ended: the record leaves the table, its pages are freed.

Records are keyed by the engine id (the id the first prefill() came with). A re-pull's target
carries the new decode worker's request id: an alias of the same record. Only the worker loop
moves records (the event loop thread); every transition checks its source state and raises
`IllegalTransition` otherwise. The table does the bookkeeping and answers the callers; the
worker does what a transition means for the engine and the sender.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtransfer.protocol import TransferTarget
from prefill_worker.engine import Prefilled
from worker_runtime.wire import GenerateRequest


class TransferFailed(RuntimeError):
    """The KV of a request could not be delivered; the decode side recomputes it."""


class IllegalTransition(RuntimeError):
    """A delivery was asked to move from a state that has no such move."""


# Sender outcomes after which the decode side is gone rather than giving up by itself (it said
# "expired" / "aborted" / "rejected" then, and recomputes): the KV is parked for a re-pull.
LOST = ("lease_expired", "xfer_error", "peer_restarted", "cancelled")


class State(enum.Enum):
    QUEUED = "queued"
    ASKING = "asking"
    COMPUTING = "computing"
    DETACHED = "detached"
    SHIPPING = "shipping"
    ABORTING = "aborting"
    PARKED = "parked"
    ACKED = "acked"
    RELEASED = "released"
    ABORTED = "aborted"
    EXPIRED = "expired"


ENDED = frozenset({State.ACKED, State.RELEASED, State.ABORTED, State.EXPIRED})
HOLDING = (State.SHIPPING, State.ABORTING, State.PARKED)  # computed KV held here

S = State
# event → {from: to}; anything else raises IllegalTransition
MOVES: dict[str, dict[State, State]] = {
    "ask": {S.QUEUED: S.ASKING},
    "targeted": {S.ASKING: S.COMPUTING},
    "no_room": {S.ASKING: S.QUEUED},
    "detach": {S.COMPUTING: S.DETACHED},
    "computed": {S.COMPUTING: S.SHIPPING, S.DETACHED: S.PARKED},
    "acked": {S.SHIPPING: S.ACKED, S.ABORTING: S.ABORTED},
    "lost": {S.SHIPPING: S.PARKED, S.ABORTING: S.ABORTED},
    "gave_up": {S.SHIPPING: S.RELEASED, S.ABORTING: S.ABORTED},
    "abort": {S.QUEUED: S.ABORTED, S.ASKING: S.ABORTED, S.COMPUTING: S.ABORTED, S.DETACHED: S.ABORTED, S.PARKED: S.ABORTED,
              S.SHIPPING: S.ABORTING, S.ABORTING: S.ABORTING},
    "repull": {S.QUEUED: S.COMPUTING, S.ASKING: S.COMPUTING, S.COMPUTING: S.COMPUTING, S.DETACHED: S.COMPUTING, S.SHIPPING: S.SHIPPING, S.PARKED: S.SHIPPING},
    "expire": {S.PARKED: S.EXPIRED},
}


@dataclass(frozen=True)
class Asker:
    """Where a request that came without a target gets one: its decode worker (by worker id, which
    is its actor's name) and what it takes to write there once it has reserved."""

    decode_id: str
    metadata: bytes  # its NIXL agent metadata
    layout: bytes  # its layout descriptor


@dataclass(frozen=True)
class Destination:
    """A decode worker's reservation and what it takes to write into it."""

    target: TransferTarget
    metadata: bytes  # its NIXL agent metadata
    layout: bytes  # its layout descriptor

    @property
    def request_id(self) -> str:
        return self.target.request_id


@dataclass(eq=False)
class Delivery:
    request_id: str  # the engine id
    req: GenerateRequest
    state: State = State.COMPUTING
    dest: Destination | None = None  # where the KV goes now; None while queued, or once its decode worker is lost
    asker: Asker | None = None  # QUEUED / ASKING: whom to ask for the target
    asks: int = 0  # targets asked for so far: an answer to an earlier ask is stale
    retry_at: float = 0.0  # QUEUED after "no room": not asked again before this (unix s)
    caller: asyncio.Future | None = None  # the prefill() / repull() waiting for the outcome
    done: Prefilled | None = None  # once computed: the KV held here
    streamed: dict[str, int] = field(default_factory=dict)  # kind → leading pages written while computing
    held_until: float = 0.0  # PARKED: unix s after which the KV is freed


class Deliveries:
    def __init__(self, hold_s: float, clock: Callable[[], float] = time.time):
        self.hold_s, self.clock = hold_s, clock  # how long a parked KV waits for a re-pull
        self._records: dict[str, Delivery] = {}  # engine id → record
        self._alias: dict[str, str] = {}  # a re-pull target's request id → engine id

    def __len__(self) -> int:
        return len(self._records)

    def find(self, request_id: str) -> Delivery | None:
        """The record of `request_id`: an engine id, or a re-pull target's id."""
        return self._records.get(self._alias.get(request_id, request_id))

    def in_state(self, *states: State) -> list[Delivery]:
        return [d for d in self._records.values() if d.state in states]

    # --- transitions ------------------------------------------------------------------------
    def open(self, req: GenerateRequest, dest: Destination | Asker, caller: asyncio.Future) -> Delivery:
        """A new prefill() → COMPUTING with a target, QUEUED with an `Asker` to get one from.
        Raises ValueError if the id is in use (ids key all state here)."""
        if self.find(req.request_id) is not None:
            raise ValueError(f"request {req.request_id!r} is already being prefilled")
        if isinstance(dest, Asker):
            d = Delivery(req.request_id, req, S.QUEUED, asker=dest, caller=caller)
        else:
            d = Delivery(req.request_id, req, dest=dest, caller=caller)
        self._records[req.request_id] = d
        return d

    def ask(self, d: Delivery) -> int:
        """Its turn came: the decode worker is asked for the target → ASKING. Returns the ask's
        number (the answer is applied only while it is the latest)."""
        self._move(d, "ask")
        d.asks += 1
        return d.asks

    def targeted(self, d: Delivery, dest: Destination) -> None:
        """The decode worker reserved: → COMPUTING (the worker submits it to the engine)."""
        self._move(d, "targeted")
        d.dest, d.asker, d.retry_at = dest, None, 0.0

    def no_room(self, d: Delivery, retry_s: float) -> None:
        """The decode worker has no pages for it now: → QUEUED, asked again after `retry_s`."""
        self._move(d, "no_room")
        d.retry_at = self.clock() + retry_s

    def due(self) -> list[Delivery]:
        """QUEUED records that may be asked now, oldest first."""
        now = self.clock()
        return [d for d in self._records.values() if d.state is S.QUEUED and d.retry_at <= now]

    def detach(self, d: Delivery, error: Exception) -> None:
        """Writing to its decode worker failed while it computes: that worker is lost."""
        self._move(d, "detach")
        d.dest = None
        self.answer(d, error)

    def computed(self, d: Delivery, done: Prefilled) -> None:
        """The engine finished it: → SHIPPING (the worker writes the rest), or PARKED if detached."""
        self._move(d, "computed")
        d.done = done
        if d.state is S.PARKED:
            d.held_until = self.clock() + self.hold_s

    def lost(self, d: Delivery, error: Exception) -> None:
        """Its decode worker is lost (a write failed with nothing in flight, or the sender said so)."""
        self._move(d, "lost")
        if d.state is S.PARKED:
            d.dest, d.held_until = None, self.clock() + self.hold_s
        self.answer(d, error)

    def settle(self, d: Delivery, reason: str) -> None:
        """The sender's answer (a `SenderEvent.reason`) for the writes to `d.dest`."""
        if reason == "acked":
            self._move(d, "acked")
            self.answer(d, {"first_token": d.done.first_token})
        elif reason in LOST:
            self.lost(d, TransferFailed(reason))
        else:  # the decode side gave up on it (it recomputes)
            self._move(d, "gave_up")
            self.answer(d, TransferFailed(reason))

    def abort(self, d: Delivery, error: Exception) -> None:
        """Aborted (its decode side's abort, or an expert-parallel group failure)."""
        self._move(d, "abort")
        self.answer(d, error)

    def repull(self, d: Delivery, dest: Destination, caller: asyncio.Future) -> None:
        """Another decode worker takes it over: every page goes again, to `dest`; the previous
        caller is answered. The worker stops the writes to the previous target first."""
        self._move(d, "repull")
        self.answer(d, TransferFailed("re-pulled by another decode worker"))
        d.dest, d.caller, d.streamed, d.held_until, d.asker = dest, caller, {}, 0.0, None
        self._alias[dest.request_id] = d.request_id

    def expire(self) -> list[Delivery]:
        """Parked KV whose lease is over → EXPIRED; returns them (their pages are to be freed)."""
        now = self.clock()
        out = [d for d in self.in_state(S.PARKED) if now > d.held_until]
        for d in out:
            self._move(d, "expire")
        return out

    def answer(self, d: Delivery, result) -> None:
        """Answer the caller waiting for `d` (once; a caller that went away is skipped)."""
        fut, d.caller = d.caller, None
        if fut is None or fut.done():
            return
        if isinstance(result, Exception):
            fut.set_exception(result)
        else:
            fut.set_result(result)

    def _move(self, d: Delivery, event: str) -> None:
        to = MOVES[event].get(d.state)
        if to is None or self._records.get(d.request_id) is not d:
            raise IllegalTransition(f"{d.request_id}: no {event!r} from {d.state.name}")
        d.state = to
        if to in ENDED:
            del self._records[d.request_id]
            self._alias = {a: e for a, e in self._alias.items() if e != d.request_id}

    # --- invariants (tests) -----------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError unless every record is in exactly one live state with the fields
        that state needs, and every alias names a live record."""
        needs = {S.QUEUED: (False, False), S.ASKING: (False, False), S.COMPUTING: (True, False), S.DETACHED: (False, False), S.SHIPPING: (True, True),
                 S.ABORTING: (True, True), S.PARKED: (False, True)}  # state → (has dest, has done)
        for eid, d in self._records.items():
            assert d.request_id == eid and d.state in needs, (eid, d.state)
            assert (d.dest is not None, d.done is not None) == needs[d.state], (eid, d.state, d.dest, d.done)
            assert d.state not in (S.DETACHED, S.PARKED, S.ABORTING) or d.caller is None, (eid, d.state)
            assert (d.asker is not None) == (d.state in (S.QUEUED, S.ASKING)), (eid, d.state, d.asker)
        for alias, eid in self._alias.items():
            assert eid in self._records, (alias, eid)
