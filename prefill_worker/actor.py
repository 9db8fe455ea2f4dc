"""The prefill worker as a Ray actor: chunked prefill, pushing the KV into the decode target.

    prefill(req, target, peer metadata, peer layout) → waits until the decode side verified
    loop: apply commands → engine.step() (in a thread) → WRITE the compressed pages each chunk
          made final (transfer overlaps the next chunks) → for each finished prompt: WRITE the
          rest (last pages, SWA window, compress-state rings), TransferDone with the header →
          sender.poll(): on ack / refusal / lease end, free the pages and answer the caller

The prefill worker keeps a request's pages until the decode side acknowledges them. If that
decode worker is lost instead (no answer by the lease, its writes fail, it restarted), the pages
stay *parked* for another lease: the router re-targets the request and the new decode worker
`repull`s them — the KV is delivered again, not recomputed. A re-pull also takes over a request
still prefilling or still shipping to the lost worker. Requests are keyed by their id here (the
engine id); a re-pull's target carries the new decode worker's id, mapped back by `engine_id`.

A worker may be one rank of an expert-parallel group (`start(seat)`, worker_runtime/ep_group.py):
its engine then steps in lockstep with its peers. When the group breaks, the worker fails every
prefill it has not finished with `ep_group_failed: ...` (the decode side recomputes those), refuses
new ones the same way, and leaves the registry; KV it already computed is still delivered.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from kvtransfer.faults import FaultPlan
from kvtransfer.layout import LayoutDescriptor
from kvtransfer.protocol import TransferTarget, decode_target
from kvtransfer.sender import Sender
from model.kv_pool import RATIO_OF_KIND
from prefill_worker.engine import PrefillConfig, Prefilled, PrefillEngine
from prefill_worker.prefix_store import PrefixStore
from worker_runtime.commands import Commands
from worker_runtime.ep_group import ExpertParallelGroup, GroupFailed, GroupState, Seat
from worker_runtime.model_loader import load_replica
from worker_runtime.options import WorkerOptions
from worker_runtime.shell import WorkerShell, shell_method
from worker_runtime.wire import GenerateRequest, TransferHeader

log = logging.getLogger(__name__)


class TransferFailed(RuntimeError):
    """The KV of a request could not be delivered; the decode side recomputes it."""


# Sender outcomes after which the decode side is gone rather than giving up by itself (it said
# "expired" / "aborted" / "rejected" then, and recomputes): the KV is parked for a re-pull.
_LOST = ("lease_expired", "xfer_error", "peer_restarted", "cancelled")


class PrefillWorker:
    def __init__(self, worker_id: str, options: WorkerOptions):
        torch.set_num_threads(options.threads)
        self.worker_id, self.options = worker_id, options
        _, model, self.pools = load_replica(options, options.prefill_ep.size > 1)
        self.store = PrefixStore(self.pools, worker_id) if options.prefix_cache else None
        self.engine = PrefillEngine(model, self.pools, worker_id,
                                    PrefillConfig(token_budget=options.prefill_token_budget,
                                                  max_running=options.max_seqs), store=self.store)
        self.shell = WorkerShell(worker_id, "prefill", options, self.pools, self.engine.load, options.prefill_ep)
        # a write still in flight a lease after its deadline went to a dead peer: give up on it
        self.sender = Sender(self.shell.agent, self.shell.layout, stuck_s=options.lease_s)
        # all keyed by the engine id of the request (the id its first prefill() came with)
        self.targets: dict[str, tuple[TransferTarget, bytes, bytes]] = {}  # → (target, peer md, layout)
        self.futures: dict[str, asyncio.Future] = {}  # → the caller waiting for delivery
        self.shipping: dict[str, Prefilled] = {}  # written, awaiting the receiver's answer
        self.parked: dict[str, tuple[Prefilled, float]] = {}  # decode side lost: (KV, held until unix s)
        self.aborting: set[str] = set()  # aborted while writes were in flight: freed at the sender's answer
        self.engine_id: dict[str, str] = {}  # a re-pull's target request id → engine id
        self.peers: dict[str, str] = {}  # agent name → epoch of the last handshake
        self.streamed: dict[str, dict[str, int]] = {}  # → kind → leading pages already sent
        self.streamed_pages = 0  # pages shipped before their request's prefill ended
        self.repulls = 0  # deliveries of held KV to a new decode worker
        self.commands = Commands()  # changes from actor methods, applied by the loop

    # --- the shell (worker_runtime/shell.py) ------------------------------------------------
    ep_listen = shell_method("ep_listen")
    ep_wake = shell_method("ep_wake")
    ep_status = shell_method("ep_status")
    peer_info = shell_method("peer_info")
    stop = shell_method("stop")

    async def start(self, seat: Seat | None = None) -> dict:
        """Start serving; with a `seat`, first join that expert-parallel group."""
        await self.shell.join(seat, self.engine.model)
        return self.shell.serve(self._loop)

    def page_accounting(self, drop_cache: bool = False) -> dict:
        """Free vs idle pages; `drop_cache` first evicts every unlocked cached prefix."""
        if drop_cache and self.store is not None:
            self.store.cache.evict_full(10 ** 9)
        return {"free": self.pools.num_free(), "idle": self.pools.idle_free(),
                "cached_pages": self.store.cache.num_cached_pages() if self.store else 0,
                "computed_tokens": self.engine.computed_tokens, "holding": len(self.shipping) + len(self.parked),
                "streamed_pages": self.streamed_pages, "repulls": self.repulls, "epoch": self.shell.agent.epoch,
                "queued": len(self.engine.waiting) + len(self.engine.running),
                "transfers": self.sender.metrics.snapshot()}

    def set_faults(self, plan: FaultPlan | None) -> None:
        """Fault injection into this worker's transfers (tests and the chaos suite)."""
        self.sender.set_faults(plan)

    # --- requests -------------------------------------------------------------------------
    async def prefill(self, req: GenerateRequest, target: bytes, peer_metadata: bytes, peer_layout: bytes) -> dict:
        """Prefill `req` and deliver its KV into `target`; returns once the receiver verified it.
        Raises TransferFailed if it could not be delivered."""
        rid = req.request_id
        if rid in self.futures or rid in self.targets or rid in self.shipping or rid in self.parked:
            raise ValueError(f"request {rid!r} is already being prefilled")  # ids key all state here
        group = self.shell.group
        if group is not None and group.state is GroupState.FAILED:
            raise TransferFailed(f"ep_group_failed: {group.failure}")
        fut = asyncio.get_running_loop().create_future()
        self.futures[rid] = fut
        self.targets[rid] = (decode_target(target), peer_metadata, peer_layout)
        self._connect_early(self.targets[rid][0], peer_metadata, peer_layout)
        self.commands.put(lambda: self.engine.submit(req))
        return await fut

    async def repull(self, lost_id: str, req: GenerateRequest, target: bytes, peer_metadata: bytes,
                     peer_layout: bytes) -> dict:
        """Deliver the KV made (or being made) here for request `lost_id`, whose decode worker was
        lost, into `target` of another decode worker; returns once verified there. Raises
        TransferFailed if this worker does not hold it (any more): the caller recomputes."""
        fut = asyncio.get_running_loop().create_future()
        self._connect_early(decode_target(target), peer_metadata, peer_layout)
        self.commands.put(lambda: self._repull(lost_id, req, decode_target(target), peer_metadata, peer_layout, fut))
        return await fut

    def _repull(self, lost_id: str, req: GenerateRequest, target: TransferTarget, metadata: bytes, layout: bytes,
                fut: asyncio.Future) -> None:
        eid = self.engine_id.get(lost_id, lost_id)
        held = self.shipping.get(eid) or self.parked.get(eid, (None,))[0]
        job = held.job if held is not None else self.engine.job(eid)
        if job is None or eid in self.aborting or job.req.prompt_ids != req.prompt_ids:
            fut.set_exception(TransferFailed(f"no KV of {lost_id!r} held here"))
            return
        old = self.targets.get(eid)
        if old is not None:  # stop writing to the lost worker (its late answer is ignored: stale id)
            self.sender.abort(old[0].request_id)
        self._answer(eid, TransferFailed("re-pulled by another decode worker"))
        self.futures[eid], self.targets[eid] = fut, (target, metadata, layout)
        self.engine_id[target.request_id] = eid
        self.streamed.pop(eid, None)  # every page goes again, to the new target
        self.repulls += 1
        self.shipping.pop(eid, None)
        self.parked.pop(eid, None)
        if held is not None:
            self._ship(held)

    async def abort(self, request_id: str) -> bool:
        self.commands.put(lambda: self._abort(request_id))
        return True

    def _abort(self, request_id: str, reason: str = "aborted") -> None:
        eid = self.engine_id.get(request_id, request_id)
        entry = self.targets.get(eid)
        if entry is not None and entry[0].request_id != request_id:
            return  # from a decode worker the request was re-pulled away from
        self.streamed.pop(eid, None)
        self.engine.abort(eid)
        if eid in self.shipping:  # pages are freed when poll() reports the writes over
            self.aborting.add(eid)
            self.sender.abort(request_id)
        else:
            self.targets.pop(eid, None)
        if eid in self.parked:
            self._release(self.parked.pop(eid)[0])
        self._answer(eid, TransferFailed(reason))

    def _answer(self, eid: str, result) -> None:
        fut = self.futures.pop(eid, None)
        if fut is None or fut.done():
            return
        if isinstance(result, Exception):
            fut.set_exception(result)
        else:
            fut.set_result(result)

    def _park(self, done: Prefilled) -> None:
        """Its decode worker is lost: hold the KV one more lease for a re-pull."""
        self.parked[done.request_id] = (done, time.time() + self.options.lease_s)

    def _release(self, done: Prefilled) -> None:
        self.engine.release(done)
        for rid in [r for r, e in self.engine_id.items() if e == done.request_id]:
            del self.engine_id[rid]

    # --- the loop -------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                self.commands.run()
                group = self.shell.group
                if group is not None and group.state is GroupState.ACTIVE:
                    await self._group_step(group)
                elif group is not None and self.engine.has_work():  # queued as the group broke
                    self._fail_unfinished(f"ep_group_failed: {group.failure}")
                elif self.engine.has_work():
                    for done in await asyncio.to_thread(self.engine.step):
                        self._ship(done)
                    self._stream_progress()
                elif self.shipping:
                    await asyncio.sleep(0.001)  # transfers in flight: keep polling them
                else:
                    await self.commands.wait()
                self._poll_sender()
                self._expire_parked()
                await self._publish_events()
            except Exception:
                log.exception("prefill loop error")
                await asyncio.sleep(0.1)

    async def _group_step(self, group: ExpertParallelGroup) -> None:
        """One lockstep step of the expert-parallel group; when no rank had work, wait until the
        next meeting is due, polling transfers in flight meanwhile."""
        try:
            finished = await asyncio.to_thread(group.step, self.engine)
        except GroupFailed as e:
            await self._leave_group(str(e))
            return
        if finished is None:
            await group.wait_idle(self.commands, self._transfers_in_flight)
            return
        for done in finished:
            self._ship(done)
        self._stream_progress()

    def _transfers_in_flight(self) -> bool:
        self._poll_sender()
        return bool(self.shipping)

    async def _leave_group(self, reason: str) -> None:
        """The group broke: fail every prefill not finished here (the decode side recomputes it),
        then leave the registry, so routers stop choosing this worker."""
        self._fail_unfinished(f"ep_group_failed: {reason}")
        await self.shell.leave_group(reason, "its unfinished prefills failed")

    def _fail_unfinished(self, reason: str) -> None:
        """Fail every queued or running prefill (their decode workers recompute them)."""
        for job in list(self.engine.waiting) + list(self.engine.running.values()):
            entry = self.targets.get(job.req.request_id)  # aborted by the id its target knows (a re-pull's)
            self._abort(entry[0].request_id if entry else job.req.request_id, reason)

    async def _publish_events(self) -> None:
        """KV events of the prefix cache → registry stream (the routers' prefix index)."""
        if self.store is None or not self.store.events:
            return
        events, self.store.events = self.store.events, []
        try:
            await asyncio.to_thread(lambda: [self.shell.registry.publish(e) for e in events])
        except Exception as e:  # Redis down: routing degrades to load only; the cache is intact
            log.warning("publishing %d KV events failed: %s", len(events), e)

    def _connect_early(self, target: TransferTarget, metadata: bytes, layout: bytes) -> None:
        """Know the decode worker from the moment it reserved pages for us, not from the first write:
        if it gives the reservation up first (lease over, abort), its Ack must find us able to
        answer Fenced, or its pages wait out the receiver's fence timeout. A refused handshake is
        left to _ship, which reports it."""
        try:
            self._connect(target, metadata, layout)
        except Exception as e:
            log.debug("early handshake with %s failed: %s", target.agent_name, e)

    def _connect(self, target: TransferTarget, metadata: bytes, layout: bytes) -> None:
        if self.peers.get(target.agent_name) != target.agent_epoch:
            self.sender.handshake(target.agent_name, metadata, LayoutDescriptor.from_bytes(layout))
            self.peers[target.agent_name] = target.agent_epoch

    def _stream_progress(self) -> None:
        """Ship the compressed pages that became final in this step (every page whose entries
        are all written), so the transfer overlaps the prefill of the next chunks."""
        for rid, job in self.engine.running.items():
            entry = self.targets.get(rid)
            if entry is None or job.seq is None:
                continue
            target, metadata, layout = entry
            sent = self.streamed.setdefault(rid, {})
            runs, offsets = {}, {}
            for kind, pages in target.page_ids:
                if kind not in RATIO_OF_KIND:
                    continue  # SWA (only the last window) and state rings go at the end
                final = job.seq.num_tokens // RATIO_OF_KIND[kind] // self.pools.specs[kind].entries_per_page
                final = min(final, len(pages))
                if final > sent.get(kind, 0):
                    runs[kind] = job.seq.pages[kind][sent.get(kind, 0):final]
                    offsets[kind] = sent.get(kind, 0)
            if not runs:
                continue
            try:
                self._connect(target, metadata, layout)
                self.sender.send(target, runs, first_page=offsets)
            except Exception as e:  # the target is gone or refused: the KV is parked once computed
                log.warning("streaming %s failed: %s", rid, e)
                self.sender.abort(target.request_id)
                self.targets.pop(rid, None)
                self._answer(rid, TransferFailed(str(e)))
                continue
            for kind, run in runs.items():
                sent[kind] = offsets[kind] + len(run)
                self.streamed_pages += len(run)

    def _ship(self, done: Prefilled) -> None:
        eid = done.request_id
        entry = self.targets.get(eid)
        sent = self.streamed.pop(eid, {})
        if entry is None:  # its decode worker was lost while it computed: held for a re-pull
            self._park(done)
            return
        target, metadata, layout = entry
        try:
            self._connect(target, metadata, layout)
            # kinds with no pages yet (e.g. c128 before 128 tokens) are not part of the target
            pages = {k: v for k, v in self.pools.resume_pages(done.seq).items() if v}
            rest = {k: v[sent.get(k, 0):] for k, v in pages.items() if v[sent.get(k, 0):]}
            if rest:
                self.sender.send(target, rest, first_page={k: sent.get(k, 0) for k in rest})
            header = TransferHeader(done.seq.num_tokens, done.first_token, done.computed_tokens)
            self.sender.finish(target, header.to_bytes(), src_pages=pages)
        except Exception as e:  # mismatch, stale target, lease over: nothing usable was declared
            log.warning("shipping %s failed: %s", eid, e)
            self.sender.abort(target.request_id)
            self._answer(eid, TransferFailed(str(e)))
            if target.request_id in self.sender.holding():
                self.shipping[eid] = done  # writes in flight: parked when poll() says they are over
            else:
                self.targets.pop(eid, None)
                self._park(done)
            return
        self.shipping[eid] = done

    def _poll_sender(self) -> None:
        for ev in self.sender.poll():
            eid = self.engine_id.get(ev.request_id, ev.request_id)
            entry = self.targets.get(eid)
            if eid not in self.shipping or entry is None or entry[0].request_id != ev.request_id:
                continue  # an earlier delivery of a re-pulled request (or one that never shipped)
            done = self.shipping.pop(eid)
            del self.targets[eid]
            if ev.reason == "acked":
                self._release(done)
                self._answer(eid, {"first_token": done.first_token})
            elif ev.reason in _LOST and eid not in self.aborting:
                self._park(done)
                self._answer(eid, TransferFailed(ev.reason))
            else:  # the decode side gave up on it (it recomputes) or it was aborted
                self.aborting.discard(eid)
                self._release(done)
                self._answer(eid, TransferFailed(ev.reason))

    def _expire_parked(self) -> None:
        now = time.time()
        for eid in [e for e, (_, until) in self.parked.items() if now > until]:
            self._release(self.parked.pop(eid)[0])

    async def drain(self, settle_s: float = 2.0, timeout_s: float | None = None) -> dict:
        """Scale-down: stop being chosen, finish every prefill here and keep its KV pages until
        the decode side has acknowledged them; return once idle for `settle_s` (`WorkerShell.drain`).

        Prefills that still arrive are served. Idle = no queued or running prefill, no transfer
        awaiting its acknowledgement, no KV parked for a re-pull, no caller waiting. Returns
        {"idle": False} if `timeout_s` passes first: the worker stays draining."""
        idle = await self.shell.drain(self._busy, settle_s, timeout_s)
        return {"worker_id": self.worker_id, "idle": idle, "computed_tokens": self.engine.computed_tokens}

    async def _busy(self) -> bool:
        return bool(self.futures or self.shipping or self.parked or self.targets or self.commands
                    or self.engine.has_work())
