"""The prefill worker as a Ray actor: chunked prefill, pushing the KV into the decode target.

    prefill(req, target, peer metadata, peer layout, epoch) → waits until the decode side verified
    prefill(req, None, ..., decode_id)  the same, but the decode worker reserves only when this
          worker is about to start the request: it waits here holding nothing (QUEUED), and when
          the engine's work ahead of it is under `TARGET_HORIZON_STEPS` steps this worker asks
          the decode worker for the target (`reserve_for_prefill`), so a lease covers the
          request's own compute and transfer, never its wait in this queue
    loop: apply commands → ask for due targets → engine.step() (in a thread) → WRITE the compressed
          pages each chunk made final (transfer overlaps the next chunks) → for each finished
          prompt: WRITE the rest (last pages, SWA window, compress-state rings), TransferDone with
          the header → sender.poll(): on ack / refusal / lease end, free the pages and answer the
          caller (the writes and answers: prefill_worker/shipping.py)

Each request's way out is one record (prefill_worker/delivery.py: COMPUTING → SHIPPING → ACKED,
...). The prefill worker keeps a request's pages until the decode side acknowledges them. If that
decode worker is lost instead (no answer by the lease, its writes fail, it restarted), the pages
stay *parked* for another lease: the router re-targets the request and the new decode worker
`repull`s them — the KV is delivered again, not recomputed. A re-pull also takes over a request
still prefilling or still shipping to the lost worker.

A worker may be one rank of an expert-parallel group (`start(seat)`, worker_runtime/ep_group.py):
its engine then steps in lockstep with its peers. When the group breaks, the worker fails every
prefill it has not finished with `ep_group_failed: ...` (the decode side recomputes those), refuses
new ones the same way, and leaves the registry; KV it already computed is still delivered. A
step that raises (out of GPU memory, say) fails every unfinished prefill the same way
(`prefill_step_failed: ...`), since it may have left their KV half written.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from kvtransfer.faults import FaultPlan
from kvtransfer.protocol import decode_target
from kvtransfer.sender import Sender
from model.tokenizer import load_tokenizer
from prefill_worker.delivery import (
    HOLDING,
    Asker,
    Deliveries,
    Delivery,
    Destination,
    State,
    TransferFailed,
)
from prefill_worker.engine import PrefillConfig, PrefillEngine
from prefill_worker.layer_stream import LayerStream
from prefill_worker.prefix_store import PrefixStore
from prefill_worker.shipping import Shipping
from worker_runtime.commands import Commands
from worker_runtime.ep_group import ExpertParallelGroup, GroupFailed, GroupState, Seat
from worker_runtime.in_process import InProcess
from worker_runtime.model_loader import check_step_fits, load_replica, step_error
from worker_runtime.options import WorkerOptions
from worker_runtime.shell import WorkerShell, serves_shell
from worker_runtime.wire import GenerateRequest, TargetReply, WorkerLoad

log = logging.getLogger(__name__)

# A queued request's target is asked for once the engine's work ahead of it is under this many
# steps' token budgets: enough that the answer (a round trip to the decode worker) is back before
# the engine runs dry, few enough that the lease does not cover a long wait behind other prompts.
TARGET_HORIZON_STEPS = 2
NO_ROOM_RETRY_S = 0.05  # a decode worker without room for a request is asked again after this


@serves_shell  # Ray methods ep_listen, ep_wake, ep_status, peer_info, stop: the shell's
class PrefillWorker:
    def __init__(self, worker_id: str, options: WorkerOptions, local: InProcess | None = None):
        """`local`: serve as a worker of this process (worker_runtime/in_process.py) instead of a
        Ray actor with a NIXL agent."""
        torch.set_num_threads(options.threads)
        self.worker_id, self.options = worker_id, options
        cfg, model, self.pools = load_replica(options, options.prefill_ep.size > 1)
        self.store = PrefixStore(self.pools, worker_id) if options.prefix_cache else None
        self.engine = PrefillEngine(model, self.pools, worker_id,
                                    PrefillConfig(token_budget=options.prefill_token_budget,
                                                  max_running=options.max_seqs), store=self.store,
                                    tokenizer=load_tokenizer(options.tokenizer_dir or options.model_dir,
                                                             cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id))
        if options.prefill_ep.size == 1:  # a group's ranks can only step together, once it has formed
            check_step_fits(model, self.pools, options.prefill_token_budget, "--prefill-token-budget")
        self.shell = WorkerShell(worker_id, "prefill", options, self.pools, self._load, options.prefill_ep,
                                 local)
        # a write still in flight a lease after its deadline went to a dead peer: give up on it
        self.sender = Sender(self.shell.agent, self.shell.layout, stuck_s=options.lease_s)
        self.deliveries = Deliveries(hold_s=options.lease_s)  # one record per request, by engine id
        self.shipping = Shipping(self.sender, self.pools, self.engine, self.deliveries)
        self.repulls = 0  # deliveries of held KV to a new decode worker
        self.commands = Commands()  # changes from actor methods, applied by the loop
        self.shell.observe(self.engine.stats, lambda: {"sent": self.sender.metrics.snapshot()})  # engine metrics

    # --- the shell (worker_runtime/shell.py) ------------------------------------------------
    async def start(self, seat: Seat | None = None) -> dict:
        """Start serving; with a `seat`, first join that expert-parallel group (its ranks then
        prefill in lockstep)."""
        await self.shell.join(seat, self.engine.model)
        return self.shell.serve(self._loop)

    def page_accounting(self, drop_cache: bool = False) -> dict:
        """Free vs idle pages; `drop_cache` first evicts every unlocked cached prefix."""
        if drop_cache and self.store is not None:
            self.store.cache.evict_full(10 ** 9)
        return {"free": self.pools.num_free(), "idle": self.pools.idle_free(),
                "cached_pages": self.store.cache.num_cached_pages() if self.store else 0,
                "computed_tokens": self.engine.computed_tokens, "holding": len(self.deliveries.in_state(*HOLDING)),
                "streamed_pages": self.shipping.streamed_pages, "layer_streamed": self.shipping.layer_streamed,
                "repulls": self.repulls, "epoch": self.shell.agent.epoch,
                "queued": len(self.engine.waiting) + len(self.engine.running) + len(self._untargeted()),
                "transfers": self.sender.metrics.snapshot()}

    def set_faults(self, plan: FaultPlan | None) -> None:
        """Fault injection into this worker's transfers (tests and the chaos suite)."""
        self.sender.set_faults(plan)

    async def drain(self, settle_s: float = 2.0, timeout_s: float | None = None) -> dict:
        """Scale-down: stop being chosen, finish every prefill here and keep its KV pages until
        the decode side has acknowledged them; return once idle for `settle_s` (`WorkerShell.drain`).

        Prefills that still arrive are served. Idle = no delivery left (queued, prefilling,
        awaiting its acknowledgement, parked for a re-pull). Returns {"idle": False} if
        `timeout_s` passes first: the worker stays draining."""
        idle = await self.shell.drain(self._busy, settle_s, timeout_s)
        return {"worker_id": self.worker_id, "idle": idle, "computed_tokens": self.engine.computed_tokens}

    async def _busy(self) -> bool:
        return bool(self.deliveries) or bool(self.commands) or self.engine.has_work()

    def _untargeted(self) -> list[Delivery]:
        return self.deliveries.in_state(State.QUEUED, State.ASKING)

    def _load(self) -> WorkerLoad:
        """The engine's load plus the requests queued here without a target yet: placement reads
        the whole queue in prompt tokens."""
        load, queued = self.engine.load(), self._untargeted()
        return WorkerLoad(load.worker_id, load.role, waiting=load.waiting + len(queued), running=load.running,
                          queued_prefill_tokens=load.queued_prefill_tokens + sum(len(d.req.prompt_ids) for d in queued),
                          free_pages=load.free_pages, total_pages=load.total_pages, draining=load.draining)

    # --- requests -------------------------------------------------------------------------
    async def prefill(self, req: GenerateRequest, target: bytes | None, peer_metadata: bytes, peer_layout: bytes,
                      epoch: str | None = None, decode_id: str | None = None) -> dict:
        """Prefill `req` and deliver its KV into `target`; returns once the receiver verified it.
        Without a target, decode worker `decode_id` is asked for one (`reserve_for_prefill`) when
        this worker is about to start the request. `epoch`: the incarnation of this worker whose
        metadata the decode side loaded (from the registry). Raises TransferFailed if it could not
        be delivered."""
        group = self.shell.group
        if group is not None and group.state is GroupState.FAILED:
            raise TransferFailed(f"ep_group_failed: {group.failure}")
        self._check_epoch(epoch)
        if req.grammar is not None:  # compiled into the engine's cache off the loop (GrammarError: refused)
            await asyncio.to_thread(self.engine.grammars.prepare, req.grammar)
        if target is None:
            if decode_id is None:
                raise ValueError("prefill() needs a target or the decode worker to ask for one (decode_id)")
            dest = Asker(decode_id, peer_metadata, peer_layout)
        else:
            dest = Destination(decode_target(target), peer_metadata, peer_layout)
        fut = asyncio.get_running_loop().create_future()
        d = self.deliveries.open(req, dest, fut)  # ValueError if the id is in use: ids key all state here
        if target is not None:
            self.commands.put(lambda: self._submit(d))
        else:
            self.commands.put(lambda: None)  # wake the loop: it asks for the target when its turn comes
        return await fut

    def _submit(self, d: Delivery) -> None:
        # an abort() that Ray ran before this prefill() was applied first: the delivery ended already
        if self.deliveries.find(d.request_id) is d:
            self.shipping.connect_early(d.dest)  # in the loop: a step's layer writes use the sender meanwhile
            self.engine.submit(d.req)

    # --- targets asked for when a request is about to start -----------------------------------
    def _ask_due(self) -> None:
        """Ask for the targets of the oldest queued requests while the engine's work ahead of
        them (tokens still to prefill, requests) is under the horizon and nothing it was given
        waits for pages here: the engine takes them at once."""
        if not self.deliveries.in_state(State.QUEUED) or self.engine.waiting:
            return
        asking = self.deliveries.in_state(State.ASKING)
        ahead = self.engine.load().queued_prefill_tokens + sum(len(d.req.prompt_ids) for d in asking)
        slots = self.engine.config.max_running - len(self.engine.running) - len(asking)
        horizon = TARGET_HORIZON_STEPS * self.engine.config.token_budget
        for d in self.deliveries.due():
            if ahead >= horizon or slots <= 0:
                return
            ahead, slots = ahead + len(d.req.prompt_ids), slots - 1
            self.shipping.connect_early(d.asker)  # its Ack of a reservation it gives up must reach us
            asyncio.ensure_future(self._ask(d, self.deliveries.ask(d), d.asker.decode_id))

    async def _ask(self, d: Delivery, ask: int, decode_id: str) -> None:
        try:
            decode = await asyncio.to_thread(self.shell.get_actor, decode_id)
            # an answer later than a lease would find the reservation expired there: give up on it
            reply = await asyncio.wait_for(decode.reserve_for_prefill.remote(d.request_id), self.options.lease_s)
        except Exception as e:  # the decode worker is gone or cut off: nothing was computed here for it
            log.warning("asking %s for the target of %s failed: %s", decode_id, d.request_id, e)
            reply = TargetReply(None, "gone")
        self.commands.put(lambda: self._answered(d, ask, reply))

    def _answered(self, d: Delivery, ask: int, reply: TargetReply) -> None:
        if self.deliveries.find(d.request_id) is not d or d.state is not State.ASKING or d.asks != ask:
            return  # aborted or re-pulled meanwhile: its decode worker gave the reservation up, or is gone
        if reply.refusal == "no_room":
            self.deliveries.no_room(d, NO_ROOM_RETRY_S)
        elif reply.refusal is not None:
            self._cancel(d, f"decode_gone: {d.asker.decode_id} no longer wants it")
        else:
            dest = Destination(decode_target(reply.target), d.asker.metadata, d.asker.layout)
            self.deliveries.targeted(d, dest)
            self.shipping.connect_early(dest)
            self.engine.submit(d.req)

    async def repull(self, lost_id: str, req: GenerateRequest, target: bytes, peer_metadata: bytes,
                     peer_layout: bytes, epoch: str | None = None) -> dict:
        """Deliver the KV made (or being made) here for request `lost_id`, whose decode worker was
        lost, into `target` of another decode worker; returns once verified there. Raises
        TransferFailed if this worker does not hold it (any more): the caller recomputes."""
        self._check_epoch(epoch)
        dest = Destination(decode_target(target), peer_metadata, peer_layout)
        fut = asyncio.get_running_loop().create_future()
        self.commands.put(lambda: self._repull(lost_id, req, dest, fut))
        return await fut

    def _check_epoch(self, epoch: str | None) -> None:
        """A decode side that loaded another incarnation's metadata would send its acks there."""
        if epoch is not None and epoch != self.shell.agent.epoch:
            raise TransferFailed(f"peer_restarted: {self.worker_id} is epoch {self.shell.agent.epoch}, not {epoch}")

    def _repull(self, lost_id: str, req: GenerateRequest, dest: Destination, fut: asyncio.Future) -> None:
        self.shipping.connect_early(dest)
        d = self.deliveries.find(lost_id)
        if d is None or d.state is State.ABORTING or d.req.prompt_ids != req.prompt_ids:
            fut.set_exception(TransferFailed(f"no KV of {lost_id!r} held here"))
            return
        if d.dest is not None:  # stop writing to the lost worker (its late answer is ignored: stale id)
            self.sender.abort(d.dest.request_id)
        was = d.state
        self.deliveries.repull(d, dest, fut)
        self.repulls += 1
        if was in (State.QUEUED, State.ASKING):  # not started: the engine takes it now, for the new target
            self.engine.submit(d.req)
        if d.state is State.SHIPPING:
            self.shipping.ship(d)

    async def abort(self, request_id: str) -> bool:
        self.commands.put(lambda: self._abort(request_id))
        return True

    def _abort(self, request_id: str) -> None:
        d = self.deliveries.find(request_id)
        if d is not None and (d.dest is None or d.dest.request_id == request_id):
            self._cancel(d, "aborted")  # else from a decode worker the request was re-pulled away from

    def _cancel(self, d: Delivery, reason: str) -> None:
        was = d.state
        self.deliveries.abort(d, TransferFailed(reason))
        if was in (State.QUEUED, State.ASKING):
            pass  # nothing of it here yet (an ASKING one's late answer is ignored)
        elif was in (State.COMPUTING, State.DETACHED):
            self.engine.abort(d.request_id)
        elif was is State.PARKED:
            self.engine.release(d.done)
        else:  # writes in flight: the pages are freed when poll() reports them over
            self.sender.abort(d.dest.request_id)

    # --- the loop -------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                self.commands.run()
                self._ask_due()
                group = self.shell.group
                if group is not None and group.state is GroupState.ACTIVE:
                    await self._group_step(group)
                elif group is not None and self.engine.has_work():  # queued as the group broke
                    self._fail_unfinished(f"ep_group_failed: {group.failure}")
                elif self.engine.has_work():
                    await self._step()
                elif self.deliveries.in_state(State.SHIPPING, State.ABORTING):
                    await asyncio.sleep(0.001)  # transfers in flight: keep polling them
                else:
                    await self.commands.wait()
                self.shipping.poll()
                for d in self.deliveries.expire():
                    self.engine.release(d.done)
                await self._publish_events()
            except Exception:
                log.exception("prefill loop error")
                await asyncio.sleep(0.1)

    async def _step(self) -> None:
        """One engine step: planned here, run in a thread; the prompts it completes have their
        layers written to their targets as the forward computes them (layer_stream.py)."""
        planned = self.engine.plan()
        if planned is None:
            self.shipping.computed([])
            return
        stream = LayerStream.plan(planned.owners, self.deliveries, self.pools, self.sender,
                                  self.options.prefill_layer_stream, len(self.engine.model.layers))
        try:
            finished = await asyncio.to_thread(self.engine.run, planned, None, stream)
        except Exception as e:
            # the step may have left its chunks' KV unwritten and their progress counted: a prompt
            # it touched cannot go on here, so every unfinished one fails over to its decode
            # worker, which recomputes it
            log.exception("prefill step error")
            self._fail_unfinished(f"prefill_step_failed: {step_error('prefill', e).message}")
            return
        self.shipping.computed(finished, stream)

    async def _group_step(self, group: ExpertParallelGroup) -> None:
        """One lockstep step of the expert-parallel group, planned here as `_step` plans its own
        (the prompts it completes streamed layer by layer); when no rank had work, wait until the
        next meeting is due, polling transfers in flight meanwhile."""
        planned = self.engine.plan()
        stream = None if planned is None else LayerStream.plan(
            planned.owners, self.deliveries, self.pools, self.sender, self.options.prefill_layer_stream,
            len(self.engine.model.layers))
        try:
            finished = await asyncio.to_thread(group.run, self.engine, planned, stream)
        except GroupFailed as e:
            await self._leave_group(str(e))
            return
        if finished is None:
            await group.wait_idle(self.commands, self._transfers_in_flight)
        else:
            self.shipping.computed(finished, stream)

    def _transfers_in_flight(self) -> bool:
        self.shipping.poll()
        return bool(self.deliveries.in_state(State.SHIPPING, State.ABORTING))

    async def _leave_group(self, reason: str) -> None:
        """The group broke: fail every prefill not finished here (the decode side recomputes it),
        then leave the registry, so routers stop choosing this worker."""
        self._fail_unfinished(f"ep_group_failed: {reason}")
        await self.shell.leave_group(reason, "its unfinished prefills failed")

    def _fail_unfinished(self, reason: str) -> None:
        """Fail every queued or running prefill (their decode workers recompute them)."""
        for job in list(self.engine.waiting) + list(self.engine.running.values()):
            self._cancel(self.deliveries.find(job.req.request_id), reason)
        for d in self._untargeted():
            self._cancel(d, reason)

    async def _publish_events(self) -> None:
        """KV events of the prefix cache → registry stream (the routers' prefix index)."""
        if self.store is None or not self.store.events:
            return
        # drained in place: the radix cache appends to this very list (a new one would never be published)
        events = list(self.store.events)
        self.store.events.clear()
        try:
            await asyncio.to_thread(lambda: [self.shell.registry.publish(e) for e in events])
        except Exception as e:  # Redis down: routing degrades to load only; the cache is intact
            log.warning("publishing %d KV events failed: %s", len(events), e)

    # --- writing the KV -------------------------------------------------------------------
