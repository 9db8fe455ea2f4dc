"""KV leaving a decode worker: live migration of running requests to another decode worker.

    pause (engine, between steps) → the target reserves (its `migrate_in`) → WRITE every resume
    page (SWA window, C4 / C4-indexer / C128 pages so far, compress-state rings) → TransferDone
    with the MigrationHeader (generated tokens, sampling state) → the target verifies and Acks
    → hand off: the pages are freed here and the stream ends with `Moved(target, id)`, which the
    router follows.

The commit point is the target's Ack(ok): before it the request belongs here (any failure —
refusal, a dead target, a checksum mismatch, an expired lease — resumes it here, exactly where it
paused); after it, it belongs to the target. If the Ack itself is lost the lease ends it here as a
failure: the request resumes here and the target is told to drop its copy (which nobody attached
to, so it also times out there by itself). Tokens are identical either way.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from decode_worker.engine import DecodeEngine
from decode_worker.running import Running
from kvtransfer.layout import LayoutDescriptor
from kvtransfer.protocol import decode_target
from kvtransfer.sender import Sender
from model.kv_pool import KVPools
from worker_runtime.wire import ErrorCode, ErrorInfo, Moved, TokenChunk

log = logging.getLogger(__name__)


@dataclass
class Migration:
    request_id: str  # here
    new_id: str  # at the target
    worker_id: str  # the target decode worker
    actor: Any  # its handle
    done: asyncio.Future  # → the result dict
    shipping: bool = False  # pages posted: only the sender's answer ends it now
    cancelled: bool = False  # the client went away meanwhile


class Outbound:
    def __init__(self, sender: Sender, pools: KVPools, engine: DecodeEngine):
        self.sender, self.pools, self.engine = sender, pools, engine
        self.migrations: dict[str, Migration] = {}  # request id here → its migration
        self.by_new_id: dict[str, str] = {}  # id at the target → request id here
        self.counts: Counter[str] = Counter()  # migrations_out, migrations_out_failed

    def __bool__(self) -> bool:
        return bool(self.migrations)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.migrations

    def begin(self, r: Running, new_id: str, worker_id: str, actor) -> Migration:
        """`r` was just paused: it is ours to ship."""
        m = Migration(r.req.request_id, new_id, worker_id, actor, asyncio.get_running_loop().create_future())
        self.migrations[m.request_id] = m
        self.by_new_id[new_id] = m.request_id
        return m

    def ship(self, m: Migration, offer: dict) -> None:
        """WRITE the paused request's pages into the target's reservation and notify. Raises
        before anything is declared (handshake refused, stale target, lease over)."""
        if m.cancelled:
            raise RuntimeError("cancelled")
        r = self.engine.running[m.request_id]
        target = decode_target(offer["target"])
        self.sender.handshake(target.agent_name, offer["metadata"], LayoutDescriptor.from_bytes(offer["layout"]))
        pages = {k: v for k, v in self.pools.resume_pages(r.seq).items() if v}
        m.shipping = True
        if pages:
            self.sender.send(target, pages)
        self.sender.finish(target, r.migration_header().to_bytes(), src_pages=pages)

    def fail(self, m: Migration, reason: str) -> None:
        """The migration ended without the target's Ack: the request decodes here again (or, if
        its client went away meanwhile, ends); the target is told to drop whatever it has."""
        if self.migrations.pop(m.request_id, None) is None:
            return
        self.by_new_id.pop(m.new_id, None)
        if m.shipping:  # post nothing more: the pages change as soon as the request runs again
            self.sender.abort(m.new_id)
        if m.cancelled:
            self.engine.abort(m.request_id)
        else:
            self.engine.resume(m.request_id)
            self.counts["migrations_out_failed"] += 1
        self._tell_target_abort(m)
        log.warning("migration of %s to %s failed (%s): resumed here", m.request_id, m.worker_id, reason)
        m.done.set_result({"request_id": m.request_id, "moved": False, "reason": reason})

    def cancel(self, request_id: str) -> bool:
        """The client went away during the migration; the pages are freed once nothing reads
        them (at the sender's answer). False if `request_id` is not migrating."""
        m = self.migrations.get(request_id)
        if m is None:
            return False
        m.cancelled = True
        if m.shipping:
            self.sender.abort(m.new_id)
        return True

    def poll(self) -> list[TokenChunk]:
        out = []
        for ev in self.sender.poll():
            rid = self.by_new_id.get(ev.request_id)
            m = self.migrations.get(rid) if rid is not None else None
            if m is None:
                continue
            if ev.reason != "acked":
                self.fail(m, ev.reason)
                continue
            del self.migrations[rid], self.by_new_id[m.new_id]
            self.engine.hand_off(rid)
            if m.cancelled:  # committed as the client left: the target's copy has nobody
                self._tell_target_abort(m)
                out.append(TokenChunk(rid, (), error=ErrorInfo(ErrorCode.CANCELLED, "request aborted")))
            else:
                self.counts["migrations_out"] += 1
                out.append(TokenChunk(rid, (), moved=Moved(m.worker_id, m.new_id)))
            m.done.set_result({"request_id": rid, "moved": not m.cancelled, "to": m.worker_id, "as": m.new_id})
        return out

    @staticmethod
    def _tell_target_abort(m: Migration) -> None:
        try:
            m.actor.abort.remote(m.new_id)
        except Exception:  # the target is gone: nothing of it is left to drop
            pass
