"""Fault injection for tests and the chaos suite.

A frozen FaultPlan is passed explicitly to a Sender or Receiver (never read from the
environment), at construction or later with `set_faults(plan)` (a worker under test turns a fault
on at a random moment and off again). With no plan (the normal case) every injection point is a
single `is None` check. Each fault that fires is counted in the owner's `metrics.injected`.

Which side honours what:
    sender:   drop / delay / duplicate of the messages it sends (Begin, TransferDone, Fenced),
              truncate_write, stall_before_write_s, kill_at "sender.*"
    receiver: drop / delay / duplicate of the messages it sends (Ack),
              corrupt_after_write, kill_at "receiver.*"
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

# Kill points (FaultPlan.kill_at). The process exits with KILL_EXIT_CODE at that point.
SENDER_BEFORE_WRITE = "sender.before_write"      # checks passed, nothing posted or sent yet
SENDER_AFTER_POST = "sender.after_post"          # writes posted, possibly still in flight
SENDER_BEFORE_DONE = "sender.before_done"        # writes complete, TransferDone not sent
RECEIVER_AFTER_RESERVE = "receiver.after_reserve"
RECEIVER_BEFORE_VERIFY = "receiver.before_verify"
KILL_POINTS = (SENDER_BEFORE_WRITE, SENDER_AFTER_POST, SENDER_BEFORE_DONE,
               RECEIVER_AFTER_RESERVE, RECEIVER_BEFORE_VERIFY)
KILL_EXIT_CODE = 86

MESSAGE_NAMES = ("Begin", "TransferDone", "Ack", "Fenced")


@dataclass(frozen=True)
class FaultPlan:
    """What to break. Message names: "Begin", "TransferDone", "Ack", "Fenced".

    drop:       messages of these names are never sent.
    duplicate:  messages of these names are sent twice.
    delay:      messages of these names are held for delay_s seconds, then sent (by poll()).
    truncate_write: fraction in [0, 1) of each send()'s bytes actually written (a prefix).
    corrupt_after_write: receiver flips one byte of the landed pages before verifying.
    stall_before_write_s: sender sleeps this long before posting each write (lease check after).
    kill_at:    one of KILL_POINTS: os._exit(KILL_EXIT_CODE) when reached.
    """

    drop: frozenset[str] = frozenset()
    duplicate: frozenset[str] = frozenset()
    delay: frozenset[str] = frozenset()
    delay_s: float = 0.0
    truncate_write: float | None = None
    corrupt_after_write: bool = False
    stall_before_write_s: float = 0.0
    kill_at: str | None = None

    def __post_init__(self) -> None:
        for name in self.drop | self.duplicate | self.delay:
            if name not in MESSAGE_NAMES:
                raise ValueError(f"unknown message name {name!r} (use {MESSAGE_NAMES})")
        if self.kill_at is not None and self.kill_at not in KILL_POINTS:
            raise ValueError(f"unknown kill point {self.kill_at!r} (use {KILL_POINTS})")
        if self.truncate_write is not None and not 0 <= self.truncate_write < 1:
            raise ValueError("truncate_write must be in [0, 1)")


def kill_point(plan: FaultPlan | None, point: str) -> None:
    """Exit the process right here if the plan says so (simulates a crash at `point`)."""
    if plan is not None and plan.kill_at == point:
        os._exit(KILL_EXIT_CODE)


class Notifier:
    """Sends protocol messages through an agent, applying a plan's message faults.

    Owned by one Sender or Receiver; holds the delayed messages until pump() finds them due
    (also after the plan was replaced: a delayed message is late, never lost).
    """

    def __init__(self, agent, plan: FaultPlan | None, metrics=None):
        self._agent = agent
        self._plan = plan
        self._metrics = metrics
        self._delayed: list[tuple[float, str, bytes]] = []   # (due unix s, peer, payload)

    def send(self, peer: str, msg) -> bool:
        """Send `msg` (a protocol message) to NIXL agent `peer`; False if the peer is unknown."""
        data = msg.to_bytes()
        plan = self._plan
        if plan is None:
            return self._agent.notify(peer, data)
        name = type(msg).__name__
        if name in plan.drop:
            self._count(f"drop_{name}")
            return True
        if name in plan.delay:
            self._count(f"delay_{name}")
            self._delayed.append((time.time() + plan.delay_s, peer, data))
            return True
        ok = self._agent.notify(peer, data)
        if name in plan.duplicate:
            self._count(f"duplicate_{name}")
            self._agent.notify(peer, data)
        return ok

    def set_plan(self, plan: FaultPlan | None) -> None:
        self._plan = plan

    def _count(self, fault: str) -> None:
        if self._metrics is not None:
            self._metrics.inject(fault)

    def pump(self) -> None:
        """Send the delayed messages that are due."""
        if not self._delayed:
            return
        now = time.time()
        due = [d for d in self._delayed if d[0] <= now]
        self._delayed = [d for d in self._delayed if d[0] > now]
        for _, peer, data in due:
            self._agent.notify(peer, data)
