"""The pushing side: WRITE a request's pages into a peer's reservation, then notify.

    s = Sender(agent, layout)
    s.handshake("decode-3", decode_metadata, decode_layout)   # refuses mismatched layouts
    s.send(target, {"c4": [...], "swa": [...]}, page_byte_range=layer_range)  # any number of times
    s.finish(target, header)       # TransferDone with checksums once every write has landed
    for ev in s.poll(): free(ev.src_pages)   # after Ack, or when the lease runs out

Writes are one-sided: the receiver learns nothing until TransferDone. The sender keeps holding
the caller's source pages until the receiver acknowledges (or rejects / aborts / expires) or the
lease deadline passes, so a receiver that finds a checksum mismatch can still ask for a resend.
No write is ever posted within `post_margin_s` of the lease deadline; the receiver waits a grace
period past the deadline before reusing unacknowledged pages, which bounds late writes.

Not thread-safe: call from the worker's event-loop thread. poll() must be called regularly.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from . import faults as F
from .transport import RemotePeer, TransferError, metadata_epoch, split_nixl_name
from .checksum import pool_checksums
from .layout import LayoutDescriptor
from .metrics import TransferMetrics
from .protocol import ACK_OK, Ack, Begin, Fenced, TransferDone, TransferTarget, decode
from .regions import SpanBatch
from .transport import TransferAgent
from .write_plan import ByteRange, SendPart, plan_write, target_pages


class LayoutMismatch(ValueError):
    """The peer's layout differs; the message names every difference."""


class NotConnected(RuntimeError):
    """No (current) handshake with the target's agent."""


class StaleTarget(RuntimeError):
    """The target was issued by another incarnation of the peer (epoch differs)."""


class LeaseExpired(RuntimeError):
    """Too close to (or past) the target's lease deadline to post a write."""


class RequestClosed(RuntimeError):
    """The request was acknowledged, aborted or refused; no more writes for it."""


@dataclass(frozen=True)
class Posted:
    """What one send() put on the wire: descriptor count after coalescing, and bytes."""

    descriptors: int
    nbytes: int


@dataclass(frozen=True)
class SenderEvent:
    """The sender no longer needs `src_pages` of `request_id`: the caller may free them.

    reason: "acked" (verified by the receiver), "rejected", "aborted", "expired" (receiver said
    so), "lease_expired" (no answer by the deadline), "cancelled" (local abort()),
    "xfer_error", "peer_restarted".
    """

    request_id: str
    peer: str
    reason: str
    src_pages: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass
class _Outgoing:
    target: TransferTarget
    peer: RemotePeer
    started: float                                   # perf_counter at first send()
    dst: dict = field(default_factory=dict)          # kind -> target page ids (np.int64)
    src_pages: dict[str, tuple[int, ...]] = field(default_factory=dict)
    inflight: list = field(default_factory=list)     # NIXL handles
    queued: list = field(default_factory=list)       # (cuda event, SpanBatch)
    nbytes: int = 0                                  # bytes of the current attempt
    attempt: int = 0
    began: bool = False
    pending_done: TransferDone | None = None         # finish() called, writes still landing
    done_sent: bool = False
    answer: str | None = None                        # Ack status, or a local end reason

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.target.request_id, self.target.agent_name, self.target.agent_epoch)


class Sender:
    """Pushes pages from `agent`'s pools to handshaken peers.

    layout: this worker's LayoutDescriptor (must describe agent.pools).
    post_margin_s: no write is posted later than lease_deadline - post_margin_s.
    stuck_s: a write still in flight this long after the lease deadline is cancelled and the
        request fails with "xfer_error" (a peer that vanished without NIXL noticing).
    faults: optional FaultPlan (tests only).
    """

    def __init__(self, agent: TransferAgent, layout: LayoutDescriptor, *,
                 faults: F.FaultPlan | None = None, post_margin_s: float = 0.25,
                 stuck_s: float = 30.0):
        layout.check_pools(agent.pools)
        self.agent = agent
        self.layout = layout
        self._pools = {p.kind: p for p in layout.pools}
        self.metrics = TransferMetrics()
        self.post_margin_s = post_margin_s
        self.stuck_s = stuck_s
        self._faults = faults
        self._notifier = F.Notifier(agent, faults, self.metrics)
        self._peers: dict[str, tuple[str, LayoutDescriptor]] = {}   # name -> (epoch, layout)
        # name -> epochs a later handshake replaced: a restarted peer never comes back as its
        # old self, so a target or metadata of a retired incarnation is refused, not reloaded
        self._retired: dict[str, set[str]] = {}
        self._out: dict[tuple[str, str, str], _Outgoing] = {}
        self._tombstones: dict[tuple[str, str, str], float] = {}    # refused keys -> forget at

    def set_faults(self, plan: F.FaultPlan | None) -> None:
        """Replace the fault plan (tests and the chaos suite); None turns injection off."""
        self._faults = plan
        self._notifier.set_plan(plan)

    # --- handshake

    def handshake(self, peer_name: str, peer_metadata: bytes,
                  peer_layout: LayoutDescriptor) -> RemotePeer:
        """Check the peer's layout and load its metadata. Raises LayoutMismatch naming every
        difference; nothing is loaded then. Call again after the peer restarts. Raises
        StaleTarget for metadata of an incarnation a later handshake already replaced (a late
        request of a restarted peer must not swap its successor out)."""
        epoch = metadata_epoch(peer_metadata)
        if epoch in self._retired.get(peer_name, ()):
            self.metrics.failed("stale_target")
            raise StaleTarget(f"{peer_name!r} epoch {epoch} restarted since; a newer incarnation "
                              f"is handshaken")
        diffs = self.layout.mismatches(peer_layout)
        if diffs:
            self.metrics.failed("layout_mismatch")
            raise LayoutMismatch(f"layout mismatch with peer {peer_name!r}: " + "; ".join(diffs))
        known = self._peers.get(peer_name)
        if known is not None and known[0] != epoch:
            self._retired.setdefault(peer_name, set()).add(known[0])
        peer = self.agent.add_peer(peer_name, peer_metadata)
        for p in peer_layout.pools:
            _, nbytes, _ = peer.pool(p.kind)
            if nbytes != p.num_pages * p.page_bytes:
                raise LayoutMismatch(f"peer {peer_name!r} pool {p.kind!r} registers {nbytes} B "
                                     f"but its layout says {p.num_pages} x {p.page_bytes}")
        self._peers[peer_name] = (peer.epoch, peer_layout)
        return peer

    def _peer_for(self, target: TransferTarget) -> tuple[RemotePeer, LayoutDescriptor]:
        known = self._peers.get(target.agent_name)
        peer = self.agent.peer(target.agent_name)
        if known is None or peer is None or peer.epoch != known[0]:
            raise NotConnected(f"no current handshake with {target.agent_name!r}")
        if target.agent_epoch != peer.epoch:
            self.metrics.failed("stale_target")
            raise StaleTarget(
                f"target for {target.request_id!r} is from epoch {target.agent_epoch} of "
                f"{target.agent_name!r} but the handshaken peer has epoch {peer.epoch}: the peer "
                f"restarted or this handshake is old; handshake again and get a new target")
        if target.layout_id != self.layout.layout_id:
            raise LayoutMismatch(f"target layout id {target.layout_id} != ours "
                                 f"{self.layout.layout_id}")
        return peer, known[1]

    # --- sending

    def _open(self, target: TransferTarget):
        """(peer, peer layout, key, outgoing state or None) of a request still open to writes;
        raises RequestClosed when the receiver or an answer already ended it."""
        peer, peer_layout = self._peer_for(target)
        key = (target.request_id, target.agent_name, target.agent_epoch)
        if key in self._tombstones:
            raise RequestClosed(f"{target.request_id!r} to {target.agent_name!r} already ended")
        out = self._out.get(key)
        if out is not None and out.answer is not None:
            raise RequestClosed(f"{target.request_id!r} already ended: {out.answer}")
        return peer, peer_layout, key, out

    def send(self, target: TransferTarget, src_pages: Mapping[str, Sequence[int]],
             page_byte_range: ByteRange | Mapping[str, ByteRange | None] | None = None,
             ready: torch.cuda.Event | None = None,
             first_page: Mapping[str, int] | None = None) -> Posted:
        """WRITE src_pages[kind][i] -> target page i of kind, for each kind given.

        src_pages: per kind, this worker's page ids in request order, as many as the target has
            (or any run of them with `first_page`).
        first_page: per kind, the target page index src_pages[kind][0] goes to: streams a
            request's pages in pieces as they become final (e.g. per prefill chunk); finish()
            then needs the full source lists (its src_pages) for the checksums.
        page_byte_range: (offset_in_page, length) to write only that slice of every page
            (e.g. one layer; see regions.layer_byte_range), or per kind (kind -> range, or None
            for whole pages; every kind given must be named); None = whole pages.
        ready: CUDA event after which the source data is complete; the write is posted by a
            later poll() once it has fired. None on CUDA: the write is ordered after the current
            stream (the CUDA IPC path on the device; UCX by synchronising the stream).
        Raises NotConnected / StaleTarget / LayoutMismatch / RequestClosed / LeaseExpired /
        ValueError before any byte moves.
        """
        return self.send_many(target, (SendPart(src_pages, page_byte_range, first_page),), ready)

    def send_many(self, target: TransferTarget, parts: Sequence[SendPart],
                  ready: torch.cuda.Event | None = None) -> Posted:
        """send() of several parts as ONE write (e.g. every layer's slices of a chunk, each
        layer its own byte ranges): all parts are checked first, and nothing is posted unless
        all pass. Same errors and `ready` as send().

        Order: checks, then the write is posted, then (first write of the request) the Begin
        notice and the bookkeeping, so the bytes start moving as early as possible.
        """
        peer, peer_layout, key, out = self._open(target)
        if out is not None and out.pending_done is not None:
            raise RuntimeError(f"finish() of {target.request_id!r} is still pending")
        dst = out.dst if out is not None and out.dst else target_pages(target, peer_layout)
        batch, full_lists = plan_write(target.request_id, parts, dst, self._pools)
        faults = self._faults
        if faults is not None:
            if faults.stall_before_write_s:
                self.metrics.inject("stall_before_write")
                time.sleep(faults.stall_before_write_s)
            if faults.truncate_write is not None:
                self.metrics.inject("truncate_write")
                batch = batch.prefix(faults.truncate_write)
        if time.time() >= target.lease_deadline - self.post_margin_s:
            self.metrics.failed("lease_expired")
            raise LeaseExpired(f"lease of {target.request_id!r} ends at "
                               f"{target.lease_deadline:.3f}; not posting")
        if out is None:
            out = self._out[key] = _Outgoing(target, peer, time.perf_counter())
        out.dst = dst
        if out.done_sent and out.pending_done is None:     # resend after a reported mismatch
            out.done_sent, out.nbytes = False, 0
        if not out.began:
            F.kill_point(faults, F.SENDER_BEFORE_WRITE)
        try:
            if ready is not None and not ready.query():
                out.queued.append((ready, batch))
            else:
                self._post(out, batch, sync_stream=ready is None)
        finally:
            # After the post, even a failed one (part of it may be under way): the receiver
            # learns whom to wait for, and poll() will fence this request with the receiver.
            if not out.began:
                out.began = True
                self._notifier.send(peer.nixl_name, Begin(target.request_id, target.agent_epoch))
            out.src_pages.update(full_lists)
        F.kill_point(faults, F.SENDER_AFTER_POST)
        return Posted(batch.count, batch.nbytes)

    def _post(self, out: _Outgoing, batch: SpanBatch, sync_stream: bool = False) -> None:
        current = self.agent.peer(out.peer.name)
        if current is None or current.epoch != out.target.agent_epoch:
            # A write queued behind a CUDA event while the peer restarted and was handshaken
            # again: it must not land in the new incarnation's pages.
            out.answer = out.answer or "peer_restarted"
            return
        try:
            handle = self.agent.write(out.peer.name, batch, epoch=out.target.agent_epoch,
                                      sync_stream=sync_stream)
        except TransferError:
            self.metrics.failed("xfer_error")
            out.answer = out.answer or "xfer_error"
            raise
        if handle is not None:
            out.inflight.append(handle)
        out.nbytes += batch.nbytes

    def finish(self, target: TransferTarget, header: bytes,
               src_pages: Mapping[str, Sequence[int]] | None = None,
               checksums: Mapping[str, torch.Tensor] | None = None) -> None:
        """Send TransferDone (checksums of every target pool, `header`) once all writes landed.

        src_pages: the full source page lists per kind, if not all were given to send().
        checksums: per kind, the checksum of those pages as the caller already computed it on
            their device (0-d int64 tensors: checksum.range_checksum_tensor summed over slices
            covering every page's bytes once, e.g. layer by layer as the layers were produced);
            the other kinds are computed here.
        """
        peer, _, key, out = self._open(target)
        known = dict(out.src_pages) if out is not None else {}
        known.update({k: tuple(int(i) for i in v) for k, v in (src_pages or {}).items()})
        missing = [k for k, ids in target.page_ids if ids and k not in known]
        if missing:
            raise ValueError(f"no source pages known for pools {missing}")
        if out is None:      # nothing was written (e.g. all pools empty): still a transfer
            if time.time() >= target.lease_deadline - self.post_margin_s:
                raise LeaseExpired(f"lease of {target.request_id!r} already over")
            out = self._out[key] = _Outgoing(target, peer, time.perf_counter())
            out.began = True
            self._notifier.send(peer.nixl_name, Begin(target.request_id, target.agent_epoch))
        out.src_pages = known
        # Read on the current stream: source data produced on it is complete by stream order.
        pages = {k: known[k] for k, ids in target.page_ids if ids}
        sums = pool_checksums(self.agent.pools, pages, {k: v for k, v in (checksums or {}).items() if k in pages})
        out.attempt += 1
        out.pending_done = TransferDone(target.request_id, target.agent_epoch, out.attempt,
                                        tuple(sorted(sums.items())), bytes(header), 0)
        self._advance(out)

    def abort(self, request_id: str) -> bool:
        """Stop every transfer of `request_id`; its pages are released (reason "cancelled")
        by poll() once no write is in flight."""
        hit = False
        for out in self._out.values():
            if out.target.request_id == request_id and out.answer is None:
                out.answer, out.queued, out.pending_done = "cancelled", [], None
                hit = True
        return hit

    # --- progress

    def poll(self) -> list[SenderEvent]:
        """Advance transfers, handle acknowledgements and leases. Returns released requests."""
        self._notifier.pump()
        for src, data in self.agent.recv(b"A"):
            self._on_ack(src, decode(data))
        now = time.time()
        events: list[SenderEvent] = []
        for key, out in list(self._out.items()):
            self._advance(out)
            if out.inflight:
                continue
            current = self._peers.get(out.target.agent_name)
            if out.answer is None and (current is None or current[0] != out.target.agent_epoch):
                out.answer = "peer_restarted"
            if out.answer is None and now >= out.target.lease_deadline:
                out.answer = "lease_expired"
            if out.answer is None:
                continue
            reason = "acked" if out.answer == ACK_OK else out.answer
            if reason != "acked":
                self.metrics.failed(reason)
                if out.began:   # the receiver may be waiting to reuse its pages
                    self._notifier.send(out.peer.nixl_name,
                                        Fenced(out.target.request_id, out.target.agent_epoch))
            del self._out[key]
            # A later send() with this target must not write into pages the receiver may
            # have handed on; past the deadline the lease check refuses it anyway.
            self._tombstones[key] = out.target.lease_deadline
            events.append(SenderEvent(out.target.request_id, out.target.agent_name, reason,
                                      tuple(sorted(out.src_pages.items()))))
        for key, until in list(self._tombstones.items()):
            if now > until:
                del self._tombstones[key]
        return events

    def post_ready(self) -> None:
        """Post the queued writes whose CUDA event has fired, and nothing else (no answers, no
        releases: those are poll()'s): a caller streaming layers calls it between layers, so each
        layer's write starts as soon as the layer is done, not at the next poll()."""
        for out in self._out.values():
            self._post_queued(out)

    def _post_queued(self, out: _Outgoing) -> None:
        if out.queued and out.answer is None:
            if time.time() >= out.target.lease_deadline - self.post_margin_s:
                out.queued, out.answer = [], "lease_expired"
            else:
                waiting = []
                for ev, batch in out.queued:
                    if ev.query():
                        try:
                            self._post(out, batch)
                        except TransferError:
                            break
                    else:
                        waiting.append((ev, batch))
                out.queued = waiting if out.answer is None else []

    def _advance(self, out: _Outgoing) -> None:
        """Post writes whose CUDA event fired; reap completed writes; send a due TransferDone."""
        self._post_queued(out)
        stuck = bool(out.inflight) and time.time() > out.target.lease_deadline + self.stuck_s
        still = []
        for h in out.inflight:
            state = "ERR" if stuck else self.agent.state(h)
            if state == "PROC":
                still.append(h)
                continue
            self.agent.release(h)
            if state == "ERR":
                self.metrics.failed("xfer_error")
                out.answer = out.answer or "xfer_error"
        out.inflight = still
        if out.pending_done is not None and not out.inflight and not out.queued \
                and out.answer is None:
            F.kill_point(self._faults, F.SENDER_BEFORE_DONE)
            done = out.pending_done
            done = TransferDone(done.request_id, done.target_epoch, done.attempt, done.checksums,
                                done.header, out.nbytes)
            self._notifier.send(out.peer.nixl_name, done)
            out.pending_done, out.done_sent = None, True
            self.metrics.completed(out.nbytes, time.perf_counter() - out.started)

    def _on_ack(self, src: str, ack: Ack) -> None:
        name, epoch = split_nixl_name(src)
        key = (ack.request_id, name, ack.target_epoch)
        out = self._out.get(key)
        if out is None or epoch != ack.target_epoch:
            # Unknown (already released, or never started): promise not to write, so the
            # receiver can reuse the pages now instead of after the grace period.
            if ack.status != ACK_OK:
                self._tombstones[key] = ack.lease_deadline
                self._notifier.send(src, Fenced(ack.request_id, ack.target_epoch))
            return
        if out.answer is None:
            out.answer = ack.status
        out.queued, out.pending_done = [], None

    # --- introspection

    def in_flight(self, request_id: str) -> int:
        """Writes of `request_id` posted (or waiting for their CUDA event) and not yet landed."""
        return sum(len(o.inflight) + len(o.queued) for o in self._out.values()
                   if o.target.request_id == request_id)

    def holding(self) -> list[str]:
        """Request ids whose source pages are still held."""
        return sorted({k[0] for k in self._out})

