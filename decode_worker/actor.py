"""The decode worker as a Ray actor: reservations, continuous batching, token streaming, and live
migration of running requests in and out.

    generate(req, prefill, repull_id) ─┬─ prefill is None: the engine prefills locally
                                       ├─ else: prefill.prefill(req, no target) queues it there;
                                       │  when it is about to start, it asks reserve_for_prefill:
                                       │  reserve pages → target; it writes them over NIXL →
                                       │  receiver verifies → engine decodes
                                       └─ repull_id: the prefill worker still holds the KV it made for
                                          request `repull_id`, whose decode worker died: it writes that
    migrate(...)          pause running requests and ship them to other decode workers (outbound.py);
                          each stream ends with a `Moved` chunk, and the router `attach`es to the target
    migrate_in / attach   the receiving side of a migration (inbound.py)
    loop: apply commands → poll transfers in and out → engine.step() (in a thread) → route chunks

Each request a caller reads (or will read, once attached) has one stream record (streams.py:
STARTING → STREAMING → ENDED, UNATTACHED → STREAMING, ...). The prefill worker's NIXL metadata,
which its acks need, comes with the request: the router hands its registry entry (`prefill_info`).

Only the loop mutates the engine and the pools (calls from the event loop queue commands), so the
model step can run off the event loop without locks.

A worker may be one rank of an expert-parallel decode group (`start(seat)`, worker_runtime/ep_group.py):
its engine then steps in lockstep with its peers. When the group breaks, the worker leaves the
registry and ends its process: to the routers it is a dead decode worker, and they move its
requests on (re-pull or recompute) as for any other; the group is restarted as a whole. A transfer
that fails (corrupt, lease expired, prefill worker gone) falls back to prefilling locally: the
request is recomputed, never lost, never decoded from unverified pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

import torch

from decode_worker.engine import DecodeConfig, DecodeEngine
from decode_worker.inbound import Inbound
from decode_worker.outbound import Outbound
from decode_worker.peers import KnownPeers, SenderCheck, migration_targets, watch_routers
from decode_worker.router_leases import RouterLeases
from decode_worker.streams import Phase, Streams
from kvtransfer.faults import FaultPlan
from kvtransfer.receiver import Receiver
from kvtransfer.sender import Sender
from model.grammar import GrammarError
from model.tokenizer import load_tokenizer
from worker_runtime.commands import Commands
from worker_runtime.ep_group import ExpertParallelGroup, GroupFailed, Seat
from worker_runtime.in_process import InProcess
from worker_runtime.model_loader import DecodeGraphs, check_step_fits, load_replica, step_error
from worker_runtime.options import WorkerOptions
from worker_runtime.shell import WorkerShell, serves_shell
from worker_runtime.wire import (
    ErrorCode,
    ErrorInfo,
    GenerateRequest,
    TargetReply,
    TokenChunk,
    WorkerInfo,
    WorkerLoad,
)

log = logging.getLogger(__name__)

# Pages a sender began writing are reused only once it fences, or is known gone (see Receiver): no
# fixed grace bounds how long a broken network can hold a posted write back. This caps the wait.
FENCE_WAIT_S = 120.0


@serves_shell  # Ray methods ep_listen, ep_wake, ep_status, peer_info, stop: the shell's
class DecodeWorker:
    def __init__(self, worker_id: str, options: WorkerOptions, local: InProcess | None = None):
        """`local`: serve as a worker of this process (worker_runtime/in_process.py) instead of a
        Ray actor with a NIXL agent."""
        torch.set_num_threads(options.threads)
        self.worker_id, self.options = worker_id, options
        cfg, model, self.pools = load_replica(options, options.decode_ep.size > 1)
        # a rank of an expert-parallel group captures its graphs with its peers, once the group formed
        graphs = (DecodeGraphs(model, self.pools, options.decode_graphs, options.max_tokens,
                               tokens_per_row=1 + options.speculative_tokens,
                               verify_max_rows=options.speculative_max_batch)
                  if options.decode_graphs and options.decode_ep.size == 1 else None)
        tokenizer = load_tokenizer(options.tokenizer_dir or options.model_dir, cfg.vocab_size, cfg.bos_token_id,
                                   cfg.eos_token_id)
        self.engine = DecodeEngine(model, self.pools, tokenizer, worker_id,
                                   DecodeConfig(prefill_token_budget=options.prefill_token_budget,
                                                max_running=options.max_seqs,
                                                speculative_tokens=options.speculative_tokens,
                                                speculative_max_batch=options.speculative_max_batch,
                                                overlap=options.overlap), graphs)
        if options.decode_ep.size == 1:  # a group's ranks can only step together, once it has formed
            check_step_fits(model, self.pools, options.max_seqs * (1 + options.speculative_tokens)
                            + options.prefill_token_budget,
                            "--max-seqs × (1 + --speculative-tokens) + --prefill-token-budget")
        self.shell = WorkerShell(worker_id, "decode", options, self.pools, self._load, options.decode_ep, local)
        self.agent, self.layout = self.shell.agent, self.shell.layout
        self.receiver = Receiver(self.agent, self.pools, self.layout, fence_wait_s=FENCE_WAIT_S)
        self.sender = Sender(self.agent, self.layout, stuck_s=options.lease_s)  # migrations out
        self.inbound = Inbound(self.receiver, self.pools, self.engine)
        self.outbound = Outbound(self.sender, self.pools, self.engine)
        self.streams = Streams()  # one record per request streamed (or to be attached) here
        self.commands = Commands()  # changes from actor methods, applied by the loop
        self.peers = KnownPeers(self.agent)  # the NIXL peers loaded (acks and migrations reach them)
        self.migrations = 0  # ids of migrated requests at their target: "<id>>m<n>"
        self.finished = 0  # requests that ended here with a finish reason
        self.leases = RouterLeases(options.router_grace_s)  # requests of routers gone are aborted
        self.router_lost = 0  # requests aborted so
        self.senders = SenderCheck(self.shell.get_actor)  # are the senders whose pages wait for their Fenced still there?
        self.shell.observe(self.engine.stats, lambda: {"sent": self.sender.metrics.snapshot(),  # engine metrics
                                                       "received": self.receiver.metrics.snapshot()},
                           lambda: {**self.inbound.counts, **self.outbound.counts})

    # --- the shell (worker_runtime/shell.py) ------------------------------------------------
    async def start(self, seat: Seat | None = None) -> dict:
        """Start serving; with a `seat`, first join that expert-parallel group and capture the
        decode graphs with its peers."""
        if await self.shell.join(seat, self.engine.model) and self.options.decode_graphs:
            # every rank captures the same buckets now: their exchanges pair up
            self.engine.graphs = await asyncio.to_thread(DecodeGraphs, self.engine.model, self.pools,
                                                         self.options.decode_graphs, self.options.max_tokens, True)
        return self.shell.serve(self._loop, lambda: watch_routers(self.shell.registry, self.leases, self.streams,
                                                                  self.options.router_grace_s, self._router_gone))

    def _load(self) -> WorkerLoad:
        load = self.engine.load()
        return dataclasses.replace(load, waiting=load.waiting + len(self.inbound.awaiting))

    def page_accounting(self) -> dict:
        return {"free": self.pools.num_free(), "idle": self.engine.idle_free(),
                "transfers_idle": self.receiver.idle() and not self.sender.holding(),
                "held": self.receiver.held(), "sending": self.sender.holding(),
                "fallbacks": self.inbound.counts["fallbacks"], "finished": self.finished,
                # KV awaited into reserved pages (a transfer under way or due), and requests queued at
                # their prefill worker with nothing reserved yet
                "awaiting": sum(not a.queued for a in self.inbound.awaiting.values()),
                "queued": sum(a.queued for a in self.inbound.awaiting.values()), "running": len(self.engine.running),
                "tokens_left": self.engine.tokens_left(),
                "migrating": len(self.outbound.migrations), "epoch": self.agent.epoch,
                "router_lost": self.router_lost,
                "counts": dict(self.inbound.counts + self.outbound.counts),
                "transfers": self.receiver.metrics.snapshot(), "sent": self.sender.metrics.snapshot()}

    def written_pages(self) -> dict[str, list[int]]:
        """Per pool, the pages holding any non-zero byte (tests: what was ever written here)."""
        return {k: torch.nonzero(b.ne(0).any(dim=1)).flatten().tolist() for k, b in self.pools.buffers.items()}

    def set_faults(self, sender: FaultPlan | None = None, receiver: FaultPlan | None = None) -> None:
        """Fault injection into this worker's transfers (tests and the chaos suite)."""
        self.sender.set_faults(sender)
        self.receiver.set_faults(receiver)

    # --- requests -------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest, prefill=None, repull_id: str | None = None,
                       prefill_info: WorkerInfo | None = None):
        """Stream `TokenChunk`s of `req`; with a prefill actor, its KV is computed there (or, with
        `repull_id`, re-sent from what it still holds of that request). `prefill_info`: that
        worker's registry entry (the router hands it), whose NIXL metadata acks need."""
        if req.request_id in self.streams:  # ids key all per-request state here: never mix two
            yield TokenChunk(req.request_id, (), error=ErrorInfo(ErrorCode.INVALID_REQUEST,
                                                                 "request id already in progress"))
            return
        error = await self._prepare_grammar(req)
        if error is not None:
            yield TokenChunk(req.request_id, (), error=ErrorInfo(ErrorCode.INVALID_REQUEST, error))
            return
        s = self.streams.open(req.request_id)
        self.leases.add(req.request_id, req.router)
        try:
            peer = None if prefill is None else await self.peers.load_prefill(prefill, prefill_info)
        except BaseException:  # the caller went away before anything started
            self.streams.cancel(s)
            raise
        self.streams.start(s)
        self.commands.put(lambda: self._start(req, prefill if peer else None, repull_id, peer,
                                              unreachable=prefill is not None and peer is None))
        async for chunk in self.streams.read(s, abandoned=self._abort_soon):
            yield chunk

    async def _prepare_grammar(self, req: GenerateRequest) -> str | None:
        """Compile the request's grammar into the engine's cache in a thread, off the loop that runs
        the steps; → why it does not compile (None: it does, or there is none)."""
        if req.grammar is None:
            return None
        try:
            await asyncio.to_thread(self.engine.grammars.prepare, req.grammar)
        except GrammarError as e:
            return f"the request's grammar does not compile: {e}"
        return None

    async def attach(self, request_id: str):
        """The rest of a request migrated here: its chunks since the migration, then live."""
        s = self.streams.get(request_id)
        if s is None or s.state is not Phase.UNATTACHED:
            yield TokenChunk(request_id, (), error=ErrorInfo(ErrorCode.NO_WORKER, "no migrated request to attach"))
            return
        self.streams.attach(s)
        async for chunk in self.streams.read(s, abandoned=self._abort_soon):
            yield chunk

    async def abort(self, request_id: str) -> bool:
        self._abort_soon(request_id)
        return True

    def _abort_soon(self, request_id: str) -> None:
        self.commands.put(lambda: self._abort(request_id))  # the loop alone touches the engine

    def _start(self, req: GenerateRequest, prefill, repull_id: str | None, peer: tuple[str, str] | None,
               unreachable: bool = False) -> None:
        if prefill is None:  # local prefill (the router's choice, or the prefill worker unreachable)
            if unreachable:
                self.inbound.local(req, "prefill_unreachable")
            else:
                self.engine.submit(req)
            return
        # the prefill worker refuses if it is another incarnation than the one loaded (acks would miss it)
        peer_args = (self.agent.metadata(), self.layout.to_bytes(), peer[1])
        if repull_id:  # the KV exists (or is being computed) there: reserve now
            target = self.inbound.expect_prefill(req, "repull", self.options.lease_s, prefill, peer[0])
            if target is None:
                self.inbound.local(req, "no_room")
                return
            ref = prefill.repull.remote(repull_id, req, target.to_bytes(), *peer_args)
        else:  # reserved only when the prefill worker is about to start it (reserve_for_prefill)
            self.inbound.await_prefill(req, prefill, peer[0])
            ref = prefill.prefill.remote(req, None, *peer_args, self.worker_id)
        asyncio.ensure_future(self._watch_prefill(req.request_id, ref))

    async def reserve_for_prefill(self, request_id: str) -> TargetReply:
        """The prefill worker is about to start `request_id`, which it queued without a target:
        reserve its pages now and return the target; "no_room" (it asks again later) or "gone"
        (aborted, or not awaited here)."""
        def reserve() -> TargetReply:
            try:
                target = self.inbound.reserve(request_id, self.options.lease_s)
            except KeyError:
                return TargetReply(None, "gone")
            return TargetReply(None, "no_room") if target is None else TargetReply(target.to_bytes())
        return await self.commands.call(reserve)

    async def _watch_prefill(self, request_id: str, ref) -> None:
        try:
            await ref
        except Exception as e:  # prefill worker died, refused, or holds nothing to re-pull: recompute here
            log.warning("prefill of %s failed: %s", request_id, e)
            self.commands.put(lambda: self.inbound.failed(request_id, "prefill_failed"))

    def _abort(self, request_id: str) -> None:
        if not self.outbound.cancel(request_id):  # migrating: its pages are freed once nothing reads them
            awaiting = self.inbound.abort(request_id)
            if awaiting is not None and awaiting.prefill is not None:
                awaiting.prefill.abort.remote(request_id)
            self.engine.abort(request_id)
        # end the stream, so its generator returns even if nobody reads it (an unattached one ends here)
        self._route([TokenChunk(request_id, (), error=ErrorInfo(ErrorCode.CANCELLED, "request aborted"))])

    # --- live migration -------------------------------------------------------------------
    async def migrate(self, request_ids: list[str] | None = None, to: str | None = None,
                      limit: int | None = None) -> list[dict]:
        """Move running requests to other decode workers without a gap or a repeated token:
        `request_ids` (default: every decoding one, at most `limit`), to worker `to` or spread
        over the least loaded others. One result per request: {"request_id", "moved", ...}."""
        ids = list(request_ids) if request_ids is not None else await self.commands.call(self.engine.decoding)
        ids = [rid for rid in ids if rid not in self.outbound][:limit]
        if not ids:
            return []
        targets = await migration_targets(self.shell.registry, self.worker_id, to, self.shell.get_actor)
        if not targets:
            return [{"request_id": rid, "moved": False, "reason": "no target"} for rid in ids]
        return list(await asyncio.gather(*(self._migrate_one(rid, *targets[i % len(targets)])
                                           for i, rid in enumerate(ids))))

    async def _migrate_one(self, request_id: str, worker_id: str, actor) -> dict:
        r = await self.commands.call(lambda: self._pause(request_id))
        if r is None:
            return {"request_id": request_id, "moved": False, "reason": "not decoding"}
        self.migrations += 1
        m = self.outbound.begin(r, f"{request_id}>m{self.migrations}", worker_id, actor)
        try:
            offer = await actor.migrate_in.remote(dataclasses.replace(r.req, request_id=m.new_id), r.seq.num_tokens,
                                                  *self.shell.peer_info())
            await self.commands.call(lambda: self.outbound.ship(m, offer))
        except Exception as e:  # refused, target gone, stale handshake, lease over: resume here
            reason = f"{type(e).__name__}: {e}"[:200]
            await self.commands.call(lambda: self.outbound.fail(m, reason))
        return await m.done

    async def migrate_in(self, req: GenerateRequest, num_tokens: int, source_name: str, source_epoch: str,
                         source_metadata: bytes) -> dict:
        """Reserve for a request another decode worker paused at `num_tokens` cached tokens; returns
        the target it writes into. Once verified, the request decodes here and its chunks wait
        for `attach`. Raises when there is no room (the source keeps it)."""
        if self.shell.draining:
            raise RuntimeError(f"{self.worker_id} is draining")
        rid = req.request_id
        if rid in self.streams:
            raise ValueError(f"request id {rid!r} already in progress")
        error = await self._prepare_grammar(req)
        if error is not None:
            raise ValueError(error)
        sender = self.peers.load(source_name, source_epoch, source_metadata)
        # nobody attaches after this (the source resumed it, or the router lost it): then it is aborted
        s = self.streams.migrated_in(rid, until=time.time() + 2 * self.options.lease_s + 5.0)
        self.leases.add(rid, req.router)
        try:
            target = await self.commands.call(lambda: self.inbound.expect_migration(req, num_tokens,
                                                                                    self.options.lease_s, sender))
        except BaseException:
            if s.state is Phase.UNATTACHED:
                self.streams.drop(s)
            raise
        return {"target": target.to_bytes(), "metadata": self.agent.metadata(), "layout": self.layout.to_bytes()}

    # --- the loop -------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                self.commands.run()
                self._poll_transfers()
                self._expire_unattached()
                self.senders.check(self.receiver.unfenced_senders(), self._sender_gone)
                if self.shell.group is not None:
                    await self._group_step(self.shell.group)
                elif self.engine.has_work():
                    self._route(await asyncio.to_thread(self.engine.step))
                elif self.inbound or self.outbound:
                    await asyncio.sleep(0.001)  # transfers in flight: keep polling them
                else:
                    await self.commands.wait()
            except Exception as e:  # a bug must not silently stall every stream: fail loudly per request
                log.exception("decode loop error")
                error = step_error("decode", e)
                for s in self.streams.live():
                    self._route([TokenChunk(s.request_id, (), error=error)])
                    self._abort(s.request_id)
                await asyncio.sleep(0.1)

    async def _group_step(self, group: ExpertParallelGroup) -> None:
        """One lockstep step of the expert-parallel group; when no rank had work, wait until the
        next meeting is due, polling transfers meanwhile."""
        try:
            out = await asyncio.to_thread(group.step, self.engine)
        except GroupFailed as e:
            await self._leave_group(str(e))
            return
        self._route(self.engine.take_failed() + (out or []))
        if out is None:
            await group.wait_idle(self.commands, self._poll_transfers, self.engine.has_work)

    def _poll_transfers(self) -> bool:
        """Poll transfers in and out (routing what they produced) → whether any are still in flight."""
        self._route(self.inbound.poll())
        self._route(self.outbound.poll())
        return bool(self.inbound or self.outbound)

    async def _leave_group(self, reason: str) -> None:
        """The group broke. Its requests hold KV no other rank can decode in lockstep again, and
        the routers already know how to move the requests of a dead decode worker (re-pull or
        recompute, one continuous stream): so leave the registry and end the process."""
        await self.shell.leave_group(reason, "exiting")
        logging.shutdown()
        os._exit(1)

    def _pause(self, request_id: str):
        """Take a request out of the batch for a migration; the chunks of a step its pause settled
        (decode_worker/overlap.py) are streamed now, before any token of its new worker."""
        r = self.engine.pause(request_id)
        self._route(self.engine.take_failed())
        return r

    def _route(self, chunks: list[TokenChunk]) -> None:
        for chunk in chunks:
            stats = self.inbound.stats.pop(chunk.request_id, None)
            if stats is not None:
                chunk = dataclasses.replace(chunk, transfer=stats)
            self.streams.deliver(chunk)
            self.finished += chunk.finish_reason is not None

    def _expire_unattached(self) -> None:
        for s in self.streams.overdue(time.time()):
            log.warning("migrated request %s was never attached: aborting it", s.request_id)
            self._abort(s.request_id)

    def _sender_gone(self, nixl_name: str) -> None:
        self.commands.put(lambda: self.receiver.sender_gone(nixl_name))

    def _router_gone(self, request_id: str) -> None:
        self.router_lost += 1
        self._abort_soon(request_id)

    async def drain(self, settle_s: float = 2.0, timeout_s: float | None = None, migrate: bool = False) -> dict:
        """Scale-down: stop being chosen, finish (or with `migrate`, move to other decode workers)
        what is here, return once idle for `settle_s` (`WorkerShell.drain`).

        Requests that still arrive — placed on an older view — are served like any other, or
        migrated once they decode. Idle = no stream, no KV awaited or shipping, no engine work,
        for `settle_s` on end (longer than a heartbeat plus a router refresh). Returns
        {"idle": False} if `timeout_s` passes first: the worker stays draining; call again."""
        loop = asyncio.get_running_loop()
        moved, retry_at = 0, 0.0

        async def busy() -> bool:
            nonlocal moved, retry_at
            if migrate and loop.time() >= retry_at:  # what decodes here moves; what cannot, finishes here
                results = await self.migrate()
                moved += sum(r["moved"] for r in results)
                if not all(r["moved"] for r in results):  # no room elsewhere now: try again later
                    retry_at = loop.time() + 1.0
            return bool(self.streams or self.inbound or self.outbound or self.commands or not self.engine.idle())

        idle = await self.shell.drain(busy, settle_s, timeout_s, poll_s=0.25 if migrate else 0.05)
        return {"worker_id": self.worker_id, "fallbacks": self.inbound.counts["fallbacks"], "migrated": moved,
                "idle": idle}
