"""The prefill worker as a Ray actor: chunked prefill, pushing the KV into the decode target.

    prefill(req, target, peer metadata, peer layout) → waits until the decode side verified
    loop: apply commands → engine.step() (in a thread) → WRITE the compressed pages each chunk
          made final (transfer overlaps the next chunks) → for each finished prompt: WRITE the
          rest (last pages, SWA window, compress-state rings), TransferDone with the header →
          sender.poll(): on ack / refusal / lease end, free the pages and answer the caller

The prefill worker keeps a request's pages until the decode side acknowledges them (or the
lease ends), so a decode worker that fails mid-transfer can still be re-served from them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import torch

from cluster.commands import Commands
from cluster.heartbeat import heartbeat_loop
from cluster.kv_link import TransferHeader, layout_of, pool_buffers
from cluster.messages import GenerateRequest
from cluster.options import WorkerOptions
from cluster.registry import Registry, WorkerInfo
from kvtransfer.agent import Agent
from kvtransfer.layout import LayoutDescriptor
from kvtransfer.protocol import TransferTarget, decode_target
from kvtransfer.sender import Sender
from model.checkpoint import load_checkpoint
from model.kv_pool import RATIO_OF_KIND, KVPools
from prefill_worker.engine import PrefillConfig, PrefillEngine, Prefilled
from prefill_worker.prefix_store import PrefixStore

log = logging.getLogger(__name__)


class TransferFailed(RuntimeError):
    """The KV of a request could not be delivered; the decode side recomputes it."""


class PrefillWorker:
    def __init__(self, worker_id: str, options: WorkerOptions):
        torch.set_num_threads(options.threads)
        self.worker_id, self.options = worker_id, options
        cfg, model = load_checkpoint(options.model_dir)
        self.pools = KVPools(cfg, options.kv_dtype, page_size=options.page_size, max_tokens=options.max_tokens,
                             max_seqs=options.max_seqs)
        self.store = PrefixStore(self.pools, worker_id) if options.prefix_cache else None
        self.engine = PrefillEngine(model, self.pools, worker_id,
                                    PrefillConfig(token_budget=options.prefill_token_budget,
                                                  max_running=options.max_seqs), store=self.store)
        # NIXL's progress thread spins a core; on CPU pools our loop's polling drives transfers.
        self.agent = Agent(worker_id, pool_buffers(self.pools), progress_thread=self.pools.buffers["swa"].is_cuda)
        self.layout = layout_of(self.pools)
        # a write still in flight a lease after its deadline went to a dead peer: give up on it
        self.sender = Sender(self.agent, self.layout, stuck_s=options.lease_s)
        self.registry = Registry(options.registry_url, options.cluster)
        self.targets: dict[str, tuple[TransferTarget, bytes, bytes]] = {}  # rid → (target, peer md, layout)
        self.futures: dict[str, asyncio.Future] = {}
        self.shipping: dict[str, Prefilled] = {}  # written, awaiting the receiver's answer
        self.peers: dict[str, str] = {}  # agent name → epoch of the last handshake
        self.streamed: dict[str, dict[str, int]] = {}  # rid → kind → leading pages already sent
        self.streamed_pages = 0  # pages shipped before their request's prefill ended
        self.commands = Commands()  # changes from actor methods, applied by the loop
        self.draining = False
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> dict:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._loop()),
                           asyncio.create_task(heartbeat_loop(self.registry, self.info, self.options.heartbeat_s))]
        return {"worker_id": self.worker_id, "agent": self.agent.name, "epoch": self.agent.epoch}

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.worker_id, "prefill", self.worker_id, self.agent.name, self.agent.epoch,
                          self.layout.to_bytes().decode(), self.agent.metadata(), self.load())

    def load(self):
        load = self.engine.load()
        return dataclasses.replace(load, draining=True) if self.draining else load

    def peer_info(self) -> tuple[str, str, bytes]:
        """(agent name, epoch, metadata): what a decode worker loads to answer our transfers."""
        return self.agent.name, self.agent.epoch, self.agent.metadata()

    def page_accounting(self, drop_cache: bool = False) -> dict:
        """Free vs idle pages; `drop_cache` first evicts every unlocked cached prefix."""
        if drop_cache and self.store is not None:
            self.store.cache.evict_full(10 ** 9)
        return {"free": self.pools.num_free(), "idle": self.pools.idle_free(),
                "cached_pages": self.store.cache.num_cached_pages() if self.store else 0,
                "computed_tokens": self.engine.computed_tokens, "holding": len(self.shipping),
                "streamed_pages": self.streamed_pages,
                "transfers": self.sender.metrics.snapshot()}

    # --- requests -------------------------------------------------------------------------
    async def prefill(self, req: GenerateRequest, target: bytes, peer_metadata: bytes, peer_layout: bytes) -> dict:
        """Prefill `req` and deliver its KV into `target`; returns once the receiver verified it.
        Raises TransferFailed if it could not be delivered."""
        if req.request_id in self.futures:  # ids key all per-request state here: never mix two
            raise ValueError(f"request {req.request_id!r} is already being prefilled")
        fut = asyncio.get_running_loop().create_future()
        self.futures[req.request_id] = fut
        self.targets[req.request_id] = (decode_target(target), peer_metadata, peer_layout)
        self.commands.put(lambda: self.engine.submit(req))
        return await fut

    async def abort(self, request_id: str) -> bool:
        self.commands.put(lambda: self._abort(request_id))
        return True

    def _abort(self, request_id: str) -> None:
        self.streamed.pop(request_id, None)
        self.engine.abort(request_id)
        if request_id in self.shipping:
            self.sender.abort(request_id)  # pages are freed when poll() reports it
        self._answer(request_id, TransferFailed("aborted"))

    def _answer(self, request_id: str, result) -> None:
        self.targets.pop(request_id, None)
        fut = self.futures.pop(request_id, None)
        if fut is None or fut.done():
            return
        if isinstance(result, Exception):
            fut.set_exception(result)
        else:
            fut.set_result(result)

    # --- the loop -------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                self.commands.run()
                if self.engine.has_work():
                    for done in await asyncio.to_thread(self.engine.step):
                        self._ship(done)
                    self._stream_progress()
                elif self.shipping:
                    await asyncio.sleep(0.001)  # transfers in flight: keep polling them
                else:
                    await self.commands.wait()
                self._poll_sender()
                await self._publish_events()
            except Exception:
                log.exception("prefill loop error")
                await asyncio.sleep(0.1)

    async def _publish_events(self) -> None:
        """KV events of the prefix cache → registry stream (the routers' prefix index)."""
        if self.store is None or not self.store.events:
            return
        events, self.store.events = self.store.events, []
        try:
            await asyncio.to_thread(lambda: [self.registry.publish(e) for e in events])
        except Exception as e:  # Redis down: routing degrades to load only; the cache is intact
            log.warning("publishing %d KV events failed: %s", len(events), e)

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
            except Exception as e:  # the target is gone or refused: the decode side recomputes
                log.warning("streaming %s failed: %s", rid, e)
                self.sender.abort(rid)
                self._answer(rid, TransferFailed(str(e)))
                continue
            for kind, run in runs.items():
                sent[kind] = offsets[kind] + len(run)
                self.streamed_pages += len(run)

    def _ship(self, done: Prefilled) -> None:
        entry = self.targets.get(done.request_id)
        sent = self.streamed.pop(done.request_id, {})
        if entry is None:  # aborted while computing
            self.engine.release(done)
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
            log.warning("shipping %s failed: %s", done.request_id, e)
            self.sender.abort(done.request_id)
            self._answer(done.request_id, TransferFailed(str(e)))
            if done.request_id in self.sender.holding():
                self.shipping[done.request_id] = done  # writes in flight: free when poll() says so
            else:
                self.engine.release(done)
            return
        self.shipping[done.request_id] = done

    def _poll_sender(self) -> None:
        for ev in self.sender.poll():
            done = self.shipping.pop(ev.request_id, None)
            if done is not None:
                self.engine.release(done)
            if ev.reason == "acked":
                self._answer(ev.request_id, {"first_token": done.first_token if done else None})
            else:
                self._answer(ev.request_id, TransferFailed(ev.reason))

    async def drain(self, settle_s: float = 2.0, timeout_s: float | None = None) -> dict:
        """Scale-down: stop being chosen, finish every prefill here and keep its KV pages until
        the decode side has acknowledged them; return once idle for `settle_s`.

        The load turns `draining` (published at once: routers skip this worker from their next
        refresh on); prefills that still arrive are served. Idle = no queued or running prefill,
        no transfer awaiting its acknowledgement, no caller waiting. Returns {"idle": False} if
        `timeout_s` passes first: the worker stays draining and nothing is cut short."""
        self.draining = True
        try:
            await asyncio.to_thread(self.registry.heartbeat, self.info())
        except Exception as e:  # Redis down: the next regular heartbeat publishes it
            log.warning("publishing drain of %s failed: %s", self.worker_id, e)
        loop = asyncio.get_running_loop()
        start, quiet = loop.time(), None
        while True:
            busy = self.futures or self.shipping or self.targets or self.commands or self.engine.has_work()
            now = loop.time()
            quiet = None if busy else (now if quiet is None else quiet)
            if quiet is not None and now - quiet >= settle_s:
                return {"worker_id": self.worker_id, "idle": True, "computed_tokens": self.engine.computed_tokens}
            if timeout_s is not None and now - start >= timeout_s:
                return {"worker_id": self.worker_id, "idle": False, "computed_tokens": self.engine.computed_tokens}
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.to_thread(self.registry.deregister, self.worker_id)
