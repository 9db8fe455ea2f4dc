"""KV arriving at a decode worker: reservations that a prefill worker (a fresh prefill, or the held
KV of a request whose decode worker died: a re-pull) or another decode worker (a live migration)
writes into, and what becomes of each once it is verified or has failed.

    expect_prefill(req, source) / expect_migration(req, num_tokens) → TransferTarget
    await_prefill(req) → QUEUED: nothing reserved while the request waits in the prefill worker's
                         queue; reserve(request_id) when that worker is about to start it
                         → RESERVED (its target), or None: no room now (it asks again later)
    poll() → chunks      verified:  adopt the pages, the engine admits the request
                         failed:    from a prefill worker → recomputed here (never lost);
                                    a migration → dropped (the source worker resumes it)

A request awaited here is QUEUED (no pages, no lease: it cannot expire however long the prefill
worker's queue) or RESERVED (pages and a lease, which now covers the prefill's compute and the
transfer only). Either ends verified (admitted), failed (recomputed here, with the reason on the
request's first chunk: `TransferStats.failure`) or aborted (every page freed).

Only the worker loop calls these (they allocate pages): between engine steps.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from decode_worker.engine import DecodeEngine
from kvtransfer.protocol import TransferTarget
from kvtransfer.receiver import OutOfPages, Receiver
from model.kv_pool import KVPools, PoolExhausted, SeqKV
from worker_runtime.wire import (
    ErrorCode,
    ErrorInfo,
    GenerateRequest,
    MigrationHeader,
    TokenChunk,
    TransferHeader,
    TransferStats,
)


@dataclass
class Awaiting:
    req: GenerateRequest
    source: str  # "prefill" | "repull" | "migration"
    started: float  # perf_counter at the reservation (QUEUED: when it was registered)
    extra: SeqKV | None = None  # migration: decode pages for the rest of the request, reserved up front
    prefill: Any = None  # the prefill actor writing it (told when the request is aborted)
    target: TransferTarget | None = None  # None while QUEUED: nothing reserved yet
    sender: str | None = None  # QUEUED: the NIXL name of the agent that will write, named at reserve

    @property
    def queued(self) -> bool:
        return self.target is None


class Inbound:
    def __init__(self, receiver: Receiver, pools: KVPools, engine: DecodeEngine):
        self.receiver, self.pools, self.engine = receiver, pools, engine
        self.awaiting: dict[str, Awaiting] = {}
        self.stats: dict[str, TransferStats] = {}  # attached to the request's next chunk
        # fallbacks (recomputed here), repulls, migrations_in, migrations_in_failed
        self.counts: Counter[str] = Counter()

    def __bool__(self) -> bool:
        return bool(self.awaiting)

    def expect_prefill(self, req: GenerateRequest, source: str, lease_s: float, prefill, sender: str):
        """Reserve the pages `req`'s prompt resumes from (written by NIXL agent `sender`); None
        when they are not free now."""
        counts = self.pools.resume_page_counts(len(req.prompt_ids))
        try:
            target = self.receiver.reserve(req.request_id, counts, lease_s, sender=sender)
        except OutOfPages:
            return None
        self.awaiting[req.request_id] = Awaiting(req, source, time.perf_counter(), prefill=prefill, target=target)
        return target

    def await_prefill(self, req: GenerateRequest, prefill, sender: str) -> None:
        """Await `req`'s KV from the prefill worker `prefill` (NIXL agent `sender`) without
        reserving anything yet: QUEUED until `reserve`."""
        if req.request_id in self.awaiting:
            raise ValueError(f"request {req.request_id!r} is already awaited")
        self.awaiting[req.request_id] = Awaiting(req, "prefill", time.perf_counter(), prefill=prefill, sender=sender)

    def reserve(self, request_id: str, lease_s: float) -> TransferTarget | None:
        """The prefill worker is about to start a QUEUED request: reserve its pages now → RESERVED,
        its target (the same one again if asked twice); None when the pages are not free now (it
        stays QUEUED). KeyError when the request is not awaited here (any more)."""
        a = self.awaiting[request_id]
        if a.target is not None:
            return a.target
        counts = self.pools.resume_page_counts(len(a.req.prompt_ids))
        try:
            a.target = self.receiver.reserve(request_id, counts, lease_s, sender=a.sender)
        except OutOfPages:
            return None
        a.started = time.perf_counter()
        return a.target

    def local(self, req: GenerateRequest, reason: str) -> None:
        """Prefill `req` here though a prefill worker was chosen (`reason`: why), reported with
        its first chunk like any fallback."""
        self._fallback(Awaiting(req, "prefill", time.perf_counter()), reason)

    def expect_migration(self, req: GenerateRequest, num_tokens: int, lease_s: float, sender: str):
        """Reserve the pages of a request paused at `num_tokens` and, up front, the decode pages
        of the rest of it: once the KV is verified (and the source told so) admission cannot fail.
        Raises OutOfPages / PoolExhausted with nothing held."""
        counts = self.pools.resume_page_counts(num_tokens)
        probe = self.pools.adopt(num_tokens, {k: [0] * n for k, n in counts.items()})
        more = self.pools.pages_needed(probe, self.engine.tokens_held(req))
        short = [k for k, n in more.items() if counts.get(k, 0) + n > self.pools.num_free(k)]
        if short:
            raise PoolExhausted(f"no room to migrate {req.request_id} in: {short}")
        target = self.receiver.reserve(req.request_id, counts, lease_s, sender=sender)
        extra = SeqKV()
        for kind, n in more.items():
            extra.pages[kind] = self.pools.alloc(kind, n)
        self.awaiting[req.request_id] = Awaiting(req, "migration", time.perf_counter(), extra, target=target)
        return target

    def failed(self, request_id: str, reason: str) -> None:
        """The prefill worker could not deliver (it died, refused, or holds no KV to re-pull)."""
        a = self.awaiting.get(request_id)
        if a is not None and a.source != "migration":
            self.abort(request_id)
            self._fallback(a, reason)

    def abort(self, request_id: str) -> Awaiting | None:
        a = self.awaiting.pop(request_id, None)
        if a is not None:
            self.receiver.abort(request_id)
            if a.extra is not None:
                self.pools.release(a.extra)
        return a

    def poll(self) -> list[TokenChunk]:
        out = []
        for ev in self.receiver.poll():
            a = self.awaiting.pop(ev.request_id, None)
            if a is None:
                if ev.kind == "ready":
                    self.receiver.release(ev.request_id)
                continue
            if ev.kind != "ready":
                if ev.kind == "corrupt":
                    self.receiver.release(ev.request_id)
                if a.source == "migration":  # the source resumes it; nobody is attached here
                    self.pools.release(a.extra)
                    self.counts["migrations_in_failed"] += 1
                    out.append(TokenChunk(ev.request_id, (), error=ErrorInfo(ErrorCode.KV_TRANSFER_FAILED,
                                                                             f"migration {ev.kind}")))
                else:
                    self._fallback(a, ev.kind)
                continue
            pages = self.receiver.claim(ev.request_id)
            nbytes = sum(len(ids) * self.pools.specs[k].page_bytes for k, ids in pages.items())
            self.stats[ev.request_id] = TransferStats(nbytes, time.perf_counter() - a.started, None, a.source,
                                                        ev.wire_s)
            out += self._admit(a, pages, ev.header)
        return out

    def _admit(self, a: Awaiting, pages: dict, header: bytes) -> list[TokenChunk]:
        rid = a.req.request_id
        if a.source == "migration":
            h = MigrationHeader.from_bytes(header)
            seq = self.pools.adopt(h.num_tokens, pages)
            try:
                if h.sampling != a.req.sampling:
                    raise ValueError(f"{rid}: sampling state {h.sampling} != request's {a.req.sampling}")
                self.engine.admit_migrated(a.req, seq, h, a.extra)
            except ValueError as e:  # verified bytes, inconsistent header: a bug, never decoded
                self.pools.release(seq)
                self.pools.release(a.extra)
                return [TokenChunk(rid, (), error=ErrorInfo(ErrorCode.INTERNAL, str(e)))]
            self.counts["migrations_in"] += 1
            return []
        h = TransferHeader.from_bytes(header)
        seq = self.pools.adopt(h.num_tokens, pages)
        self.counts["repulls"] += a.source == "repull"
        try:
            return self.engine.admit_transferred(a.req, seq, h.first_token, cached_tokens=h.num_tokens - h.computed_tokens,
                                                 first_logprobs=h.first_logprobs, prompt_logprobs=h.prompt_logprobs)
        except PoolExhausted:  # no decode pages now: drop the KV, recompute when there is room
            self.pools.release(seq)
            self._fallback(a, "no_room")
            return []

    def _fallback(self, a: Awaiting, reason: str) -> None:
        self.stats[a.req.request_id] = TransferStats(0, time.perf_counter() - a.started, reason, a.source)
        self.counts["fallbacks"] += 1
        self.engine.submit(a.req)
