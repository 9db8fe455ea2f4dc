"""The receiving side: reserve pages, hand out a target, verify what lands.

    r = Receiver(agent, allocator, layout)
    target = r.reserve("req-7", {"swa": 1, "c4": 32, "c128": 32}, lease_s=30)   # -> to the sender
    for ev in r.poll():
        if ev.kind == "ready":   pages = r.claim(ev.request_id)    # verified: caller owns pages
        if ev.kind == "corrupt": r.release(ev.request_id)          # or keep and ask for a resend
        if ev.kind == "expired": ...                               # pages are freed by poll()

Reservation states:
    waiting  -> ready     TransferDone arrived and every pool's checksum matched (Ack "ok" sent)
    waiting  -> corrupt   a checksum did not match: nothing is declared usable
    corrupt  -> ready     a resend (higher attempt) verified
    waiting / corrupt -> fencing   lease deadline passed ("expired" event) or abort()
    waiting / corrupt -> freed     the sender gave up and fenced ("expired" event)
    fencing  -> freed     the sender confirmed it writes nothing more (Fenced, or a late
                          TransferDone), or deadline + grace_s passed
    ready    -> (claim: caller owns the pages) | (release/abort: freed)

Pages are never returned to the allocator while a write for them could still land: a sender
posts no write later than deadline - post_margin, and unfenced pages wait until
deadline + grace_s. Page accounting therefore returns to idle after any mix of
reserve / abort / expire / complete + release, once poll() has run past the grace period.

A write posted before the deadline can be held up by the network for longer than any fixed grace
(a partition: the bytes sit in a socket until the link heals). With `fence_wait_s`, a reservation
whose sender had begun (its Begin arrived) waits for the sender's Fenced — which comes after its
last byte on the same connection — until deadline + fence_wait_s, unless the owner learns the
sender is gone (`unfenced_senders()` / `sender_gone()`: a dead process writes nothing more).

Not thread-safe: call from the worker's event-loop thread. poll() must be called regularly.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import faults as F
from .checksum import pool_checksums
from .layout import LayoutDescriptor
from .metrics import TransferMetrics
from .protocol import (ACK_ABORTED, ACK_EXPIRED, ACK_OK, ACK_REJECTED, Ack, Begin, Fenced,
                       TransferDone, TransferTarget, decode)
from .transport import TransferAgent

ACK_RESEND_S = 1.0  # a fencing reservation repeats its Ack this often until Fenced (or free_at)


class OutOfPages(RuntimeError):
    """The allocator cannot satisfy a reservation; nothing was allocated."""


@dataclass(frozen=True)
class ReceiverEvent:
    """kind: "ready" (verified; claim() or release() it), "corrupt" (checksum mismatch; data
    not usable; release() it or keep it for a resend), "expired" (lease over without verified
    data, or the sender gave up; the receiver frees the pages itself)."""

    request_id: str
    kind: str
    pages: tuple[tuple[str, tuple[int, ...]], ...]
    header: bytes = b""
    detail: str = ""
    # "ready": the sender's Begin (sent once its first write was posted) → verified, i.e. the
    # transfer proper, without the reservation's wait for the prefill (0.0 when no Begin came)
    wire_s: float = 0.0


@dataclass
class _Reservation:
    target: TransferTarget
    started: float                     # perf_counter at reserve()
    begun: float = 0.0                 # perf_counter when the sender's Begin arrived
    state: str = "waiting"             # waiting | ready | corrupt | fencing
    sender: str | None = None          # NIXL name of the writing agent, once known
    attempt: int = 0                   # highest TransferDone attempt seen
    header: bytes = b""
    end_status: str = ""               # Ack status sent when fencing
    free_at: float = 0.0               # unix s: fencing without Fenced frees at this time
    answered_at: float = 0.0           # unix s of the last Ack sent (re-sent while fencing)
    pages: dict[str, tuple[int, ...]] = field(default_factory=dict)


class Receiver:
    """Reserves pages in `agent`'s pools through `allocator` and verifies incoming transfers.

    allocator: duck-typed, alloc(kind, n) -> list[int], free(kind, ids), num_free(kind) -> int.
    grace_s: how long past a lease deadline unfenced pages stay quarantined.
    fence_wait_s: if set, how long past the deadline unfenced pages whose sender had begun stay
        quarantined (instead of grace_s), unless sender_gone() says that sender is no more.
    faults: optional FaultPlan (tests only).
    """

    def __init__(self, agent: TransferAgent, allocator, layout: LayoutDescriptor, *,
                 faults: F.FaultPlan | None = None, grace_s: float = 1.0,
                 remember_s: float = 60.0, fence_wait_s: float | None = None):
        layout.check_pools(agent.pools)
        self.agent = agent
        self.allocator = allocator
        self.layout = layout
        self.metrics = TransferMetrics()
        self.grace_s = grace_s
        self.fence_wait_s = fence_wait_s
        self.remember_s = remember_s
        self._faults = faults
        self._notifier = F.Notifier(agent, faults, self.metrics)
        self._res: dict[str, _Reservation] = {}
        self._finished: dict[str, float] = {}   # claimed/released ids -> forget at (dup filter)

    def set_faults(self, plan: F.FaultPlan | None) -> None:
        """Replace the fault plan (tests and the chaos suite); None turns injection off."""
        self._faults = plan
        self._notifier.set_plan(plan)

    # --- reservations

    def reserve(self, request_id: str, pages_per_kind: Mapping[str, int],
                lease_s: float, sender: str | None = None) -> TransferTarget:
        """Allocate pages for every kind (all or nothing) and return the target for the sender.

        pages_per_kind: kind -> page count (kinds with 0 are left out). lease_s: seconds until
        the reservation expires unless a verified transfer arrived. sender: NIXL name of the
        agent that will write, if known (its peer must be loaded): an abort or expiry is then
        told to it even before its Begin arrives, and with fence_wait_s its Fenced (or its
        being gone) frees the pages. Raises OutOfPages.
        """
        if request_id in self._res:
            raise ValueError(f"request {request_id!r} already has a reservation")
        want = {k: int(n) for k, n in pages_per_kind.items() if n}
        for kind, n in want.items():
            self.layout.pool(kind)   # KeyError for unknown kinds
            if n < 0 or self.allocator.num_free(kind) < n:
                self.metrics.failed("out_of_pages")
                raise OutOfPages(f"pool {kind!r}: {n} pages wanted, "
                                 f"{self.allocator.num_free(kind)} free")
        pages: dict[str, tuple[int, ...]] = {}
        try:
            for kind, n in want.items():
                ids = tuple(int(i) for i in self.allocator.alloc(kind, n))
                pages[kind] = ids
                if len(ids) != n:
                    raise OutOfPages(f"pool {kind!r}: allocator gave {len(ids)} of {n} pages")
        except BaseException:
            for kind, ids in pages.items():
                self.allocator.free(kind, list(ids))
            self.metrics.failed("out_of_pages")
            raise
        target = TransferTarget(request_id, self.agent.name, self.agent.epoch,
                                self.layout.layout_id, tuple(pages.items()),
                                time.time() + lease_s)
        self._res[request_id] = _Reservation(target, time.perf_counter(), sender=sender, pages=pages)
        self._finished.pop(request_id, None)
        F.kill_point(self._faults, F.RECEIVER_AFTER_RESERVE)
        return target

    def claim(self, request_id: str) -> dict[str, tuple[int, ...]]:
        """Take ownership of a verified ("ready") request's pages; the receiver forgets them.
        The caller frees them through the allocator when the request ends."""
        res = self._res.get(request_id)
        if res is None or res.state != "ready":
            raise KeyError(f"request {request_id!r} is not ready "
                           f"({res.state if res else 'unknown'})")
        del self._res[request_id]
        self._remember(request_id)
        return dict(res.pages)

    def release(self, request_id: str) -> bool:
        """Free a ready or corrupt reservation now (a corrupt one is rejected to the sender);
        a waiting one is aborted. False if unknown."""
        res = self._res.get(request_id)
        if res is None:
            return False
        if res.state == "ready":
            self._free(res)
        elif res.state == "corrupt":
            self._answer(res, ACK_REJECTED)
            self._free(res)
        else:
            self.abort(request_id)
        return True

    def abort(self, request_id: str) -> bool:
        """Give up the request in any state; every page is freed (at once when no write can
        still land, else once the sender fences or the grace period ends). False if unknown."""
        res = self._res.get(request_id)
        if res is None:
            return False
        if res.state != "fencing":
            self.metrics.failed("aborted")
        if res.state == "ready":
            self._free(res)
        elif res.state == "corrupt":
            self._answer(res, ACK_ABORTED)
            self._free(res)
        elif res.state == "waiting":
            self._fence(res, ACK_ABORTED)
        return True

    # --- progress

    def poll(self) -> list[ReceiverEvent]:
        """Handle notifications, verify arrivals, expire leases, free fenced pages."""
        self._notifier.pump()
        events: list[ReceiverEvent] = []
        for src, data in self.agent.recv(b"B"):
            self._on_begin(src, decode(data))
        for src, data in self.agent.recv(b"D"):
            ev = self._on_done(src, decode(data))
            if ev is not None:
                events.append(ev)
        for _, data in self.agent.recv(b"F"):
            ev = self._on_fenced(decode(data))
            if ev is not None:
                events.append(ev)
        now = time.time()
        for res in list(self._res.values()):
            if res.state in ("waiting", "corrupt") and now >= res.target.lease_deadline:
                self.metrics.failed("expired")
                self._fence(res, ACK_EXPIRED)
                events.append(ReceiverEvent(res.target.request_id, "expired",
                                            tuple(res.pages.items()),
                                            detail="lease ended without verified data"))
            if res.state == "fencing" and now >= res.free_at:
                self._free(res)
            elif res.state == "fencing" and res.sender is not None and now >= res.answered_at + ACK_RESEND_S:
                # a sender that got our Ack before it knew us could not answer Fenced; once it has
                # loaded us (e.g. for another request) the repeated Ack gets one
                self._answer(res, res.end_status)
        for rid, until in list(self._finished.items()):
            if now > until:
                del self._finished[rid]
        return events

    def _on_begin(self, src: str, msg: Begin) -> None:
        if msg.target_epoch != self.agent.epoch:
            return                       # addressed to a previous incarnation of this worker
        res = self._res.get(msg.request_id)
        if res is None:
            if msg.request_id not in self._finished:
                self._notifier.send(src, Ack(msg.request_id, msg.target_epoch, ACK_EXPIRED, 0.0))
            return
        res.begun = res.begun or time.perf_counter()
        if res.sender is None:
            res.sender = src
            if res.state == "fencing":   # aborted before we knew whom to tell
                res.free_at = max(res.free_at, self._free_at(res))
                self._answer(res, res.end_status)

    def _on_done(self, src: str, msg: TransferDone) -> ReceiverEvent | None:
        if msg.target_epoch != self.agent.epoch:
            self.metrics.failed("stale_epoch")
            return None
        res = self._res.get(msg.request_id)
        if res is None:
            if msg.request_id not in self._finished:    # late: lease over and pages freed
                self.metrics.failed("late_done")
                self._notifier.send(src, Ack(msg.request_id, msg.target_epoch, ACK_EXPIRED, 0.0))
            else:
                self.metrics.ignore("duplicate")
            return None
        res.sender = res.sender or src
        if msg.attempt <= res.attempt:
            self.metrics.ignore("duplicate")
            return None                  # duplicate notification
        res.attempt = msg.attempt
        if res.state == "fencing":       # the writer finished: nothing of it is in flight
            self._answer(res, res.end_status)
            self._free(res)
            return None
        if res.state == "ready":
            return None
        F.kill_point(self._faults, F.RECEIVER_BEFORE_VERIFY)
        if self._faults is not None and self._faults.corrupt_after_write:
            self.metrics.inject("corrupt_after_write")
            self._flip_one_byte(res)
        bad = self._verify(res, msg)
        pages = tuple(res.pages.items())
        if bad:
            res.state = "corrupt"
            self.metrics.failed("checksum")
            return ReceiverEvent(msg.request_id, "corrupt", pages, detail=bad)
        res.state, res.header = "ready", msg.header
        self._answer(res, ACK_OK)
        now = time.perf_counter()
        self.metrics.completed(msg.nbytes, now - res.started)
        return ReceiverEvent(msg.request_id, "ready", pages, header=msg.header,
                             wire_s=now - res.begun if res.begun else 0.0)

    def _on_fenced(self, msg: Fenced) -> ReceiverEvent | None:
        res = self._res.get(msg.request_id)
        if res is None or msg.target_epoch != self.agent.epoch or res.state == "ready":
            return None
        if res.state == "fencing":
            self._free(res)
            return None
        # waiting / corrupt: the sender gave up (its lease, abort or error) and promises to
        # write nothing more, so no verified data can come: fail fast and free now.
        self.metrics.failed("sender_gave_up")
        self._free(res)
        return ReceiverEvent(msg.request_id, "expired", tuple(res.pages.items()),
                             detail="sender gave up")

    def _verify(self, res: _Reservation, msg: TransferDone) -> str:
        """'' if every pool's checksum matches, else a description of what differs."""
        theirs = dict(msg.checksums)
        if set(theirs) != set(res.pages):
            return f"checksummed pools {sorted(theirs)} != reserved pools {sorted(res.pages)}"
        mine = pool_checksums(self.agent.pools, res.pages)
        bad = sorted(k for k in mine if mine[k] != theirs[k])
        return f"checksum mismatch in pools {bad}" if bad else ""

    def _flip_one_byte(self, res: _Reservation) -> None:
        for kind, ids in res.pages.items():
            if ids:
                self.agent.pools[kind][ids[0], :1].bitwise_xor_(0xFF)
                return

    # --- helpers

    def _answer(self, res: _Reservation, status: str) -> None:
        res.answered_at = time.time()
        if res.sender is not None:
            ok = self._notifier.send(res.sender, Ack(res.target.request_id, self.agent.epoch,
                                                     status, res.target.lease_deadline))
            if not ok:
                self.metrics.failed("ack_undeliverable")

    def _fence(self, res: _Reservation, status: str) -> None:
        res.state, res.end_status = "fencing", status
        res.free_at = self._free_at(res)
        self._answer(res, status)

    def _free_at(self, res: _Reservation) -> float:
        wait = self.fence_wait_s if self.fence_wait_s is not None and res.sender is not None else self.grace_s
        return res.target.lease_deadline + wait

    def unfenced_senders(self) -> set[str]:
        """NIXL names of senders whose pages wait past deadline + grace_s for their Fenced: the
        owner may check whether they still exist (and call sender_gone())."""
        now = time.time()
        return {r.sender for r in self._res.values() if r.state == "fencing" and r.sender is not None
                and now >= r.target.lease_deadline + self.grace_s}

    def sender_gone(self, nixl_name: str) -> int:
        """That sender (one incarnation) no longer exists, so it writes nothing more: its fencing
        reservations are freed by the next poll(). Returns how many."""
        hit = [r for r in self._res.values() if r.state == "fencing" and r.sender == nixl_name]
        for r in hit:
            r.free_at = min(r.free_at, time.time())
        return len(hit)

    def _free(self, res: _Reservation) -> None:
        for kind, ids in res.pages.items():
            self.allocator.free(kind, list(ids))
        self._res.pop(res.target.request_id, None)
        self._remember(res.target.request_id)

    def _remember(self, request_id: str) -> None:
        self._finished[request_id] = time.time() + self.remember_s

    # --- introspection

    def held(self) -> dict[str, str]:
        """request id -> state for every reservation still holding pages."""
        return {rid: r.state for rid, r in self._res.items()}

    def idle(self) -> bool:
        return not self._res
