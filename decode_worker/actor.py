"""The decode worker as a Ray actor: reservations, continuous batching, token streaming.

    generate(req, prefill)  ─┬─ prefill is None: the engine prefills locally
                             └─ else: reserve pages → target → prefill.prefill(req, target) writes
                                them over NIXL → receiver verifies → engine decodes
    loop: apply commands → poll transfers → engine.step() (in a thread) → route chunks to streams

Only the loop mutates the engine (calls from the event loop queue commands), so the model step
can run off the event loop without locks. A transfer that fails (corrupt, lease expired, prefill
worker gone) falls back to prefilling locally: the request is recomputed, never lost, never
decoded from unverified pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import torch

from cluster.commands import Commands
from cluster.heartbeat import heartbeat_loop
from cluster.kv_link import TransferHeader, layout_of, pool_buffers
from cluster.messages import ErrorCode, ErrorInfo, GenerateRequest, TokenChunk, TransferStats
from cluster.options import WorkerOptions
from cluster.registry import Registry, WorkerInfo
from decode_worker.engine import DecodeConfig, DecodeEngine
from kvtransfer.agent import Agent
from kvtransfer.receiver import OutOfPages, Receiver
from model.checkpoint import load_checkpoint
from model.kv_pool import KVPools, PoolExhausted
from model.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(self, worker_id: str, options: WorkerOptions):
        torch.set_num_threads(options.threads)
        self.worker_id, self.options = worker_id, options
        cfg, model = load_checkpoint(options.model_dir)
        self.pools = KVPools(cfg, options.kv_dtype, page_size=options.page_size, max_tokens=options.max_tokens,
                             max_seqs=options.max_seqs)
        tokenizer = load_tokenizer(options.model_dir, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
        self.engine = DecodeEngine(model, self.pools, tokenizer, worker_id,
                                   DecodeConfig(prefill_token_budget=options.prefill_token_budget,
                                                max_running=options.max_seqs))
        # NIXL's progress thread spins a core; on CPU pools our loop's polling drives transfers.
        self.agent = Agent(worker_id, pool_buffers(self.pools), progress_thread=self.pools.buffers["swa"].is_cuda)
        self.layout = layout_of(self.pools)
        self.receiver = Receiver(self.agent, self.pools, self.layout)
        self.registry = Registry(options.registry_url, options.cluster)
        self.streams: dict[str, asyncio.Queue] = {}
        self.awaiting_kv: dict[str, GenerateRequest] = {}  # reserved, KV not yet verified
        self.prefill_of: dict[str, Any] = {}  # request id → prefill actor handle
        self.reserved_at: dict[str, float] = {}  # request id → perf_counter at reservation
        self.transfer_stats: dict[str, TransferStats] = {}  # attached to the request's next chunk
        self.commands = Commands()  # changes from actor methods, applied by the loop
        self.peer_epochs: dict[str, str] = {}  # prefill agent name → epoch loaded
        self.draining = False
        self.fallbacks = 0  # transfers that failed and were recomputed locally
        self._tasks: list[asyncio.Task] = []

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> dict:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._loop()),
                           asyncio.create_task(heartbeat_loop(self.registry, self.info, self.options.heartbeat_s))]
        return {"worker_id": self.worker_id, "agent": self.agent.name, "epoch": self.agent.epoch}

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.worker_id, "decode", self.worker_id, self.agent.name, self.agent.epoch,
                          self.layout.to_bytes().decode(), self.agent.metadata(), self.load())

    def load(self):
        load = self.engine.load()
        return dataclasses.replace(load, waiting=load.waiting + len(self.awaiting_kv), draining=self.draining)

    def page_accounting(self) -> dict:
        return {"free": self.pools.num_free(), "idle": self.pools.idle_free(),
                "transfers_idle": self.receiver.idle(), "fallbacks": self.fallbacks,
                "transfers": self.receiver.metrics.snapshot()}

    # --- requests -------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest, prefill=None):
        """Stream `TokenChunk`s of `req`; with a prefill actor, its KV is computed there."""
        if req.request_id in self.streams:  # ids key all per-request state here: never mix two
            yield TokenChunk(req.request_id, (), error=ErrorInfo(ErrorCode.INVALID_REQUEST,
                                                                 "request id already in progress"))
            return
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[req.request_id] = queue
        finished = False
        try:
            if prefill is not None:
                prefill = await self._connect(prefill)
            self.commands.put(lambda: self._start(req, prefill))
            while True:
                chunk = await queue.get()
                yield chunk
                if chunk.finish_reason or chunk.error:
                    finished = True
                    return
        finally:
            self.streams.pop(req.request_id, None)
            if not finished:  # the caller went away: abort everywhere
                self.commands.put(lambda: self._abort(req.request_id))

    async def _connect(self, prefill):
        """Load the prefill worker's NIXL metadata (once per epoch) so acks can reach it.
        Returns None — local prefill — if it cannot be reached."""
        try:
            name, epoch, metadata = await prefill.peer_info.remote()
        except Exception as e:
            log.warning("prefill worker unreachable, prefilling locally: %s", e)
            return None
        if self.peer_epochs.get(name) != epoch:
            self.agent.add_peer(name, metadata)
            self.peer_epochs[name] = epoch
        return prefill

    async def abort(self, request_id: str) -> bool:
        self.commands.put(lambda: self._abort(request_id))
        return True

    def _start(self, req: GenerateRequest, prefill) -> None:
        if prefill is None:
            self.engine.submit(req)
            return
        try:
            counts = self.pools.resume_page_counts(len(req.prompt_ids))
            target = self.receiver.reserve(req.request_id, counts, self.options.lease_s)
        except OutOfPages:
            self.engine.submit(req)  # no room for a transfer now: queue for local prefill
            return
        self.awaiting_kv[req.request_id] = req
        self.prefill_of[req.request_id] = prefill
        self.reserved_at[req.request_id] = time.perf_counter()
        ref = prefill.prefill.remote(req, target.to_bytes(), self.agent.metadata(), self.layout.to_bytes())
        asyncio.ensure_future(self._watch_prefill(req.request_id, ref))

    async def _watch_prefill(self, request_id: str, ref) -> None:
        try:
            await ref
        except Exception as e:  # prefill worker died or refused: recompute here
            log.warning("prefill of %s failed: %s", request_id, e)
            self.commands.put(lambda: self._fallback(request_id))

    def _fallback(self, request_id: str) -> None:
        req = self.awaiting_kv.pop(request_id, None)
        self.prefill_of.pop(request_id, None)
        if req is None:
            return
        self.receiver.abort(request_id)
        self._record(request_id, 0, "prefill_failed")
        self.fallbacks += 1
        self.engine.submit(req)

    def _abort(self, request_id: str) -> None:
        self.reserved_at.pop(request_id, None)
        if self.awaiting_kv.pop(request_id, None) is not None:
            self.receiver.abort(request_id)
            prefill = self.prefill_of.pop(request_id, None)
            if prefill is not None:
                prefill.abort.remote(request_id)
        self.engine.abort(request_id)
        # end the stream, so its generator returns even if nobody reads it any more
        self._route([TokenChunk(request_id, (), error=ErrorInfo(ErrorCode.CANCELLED, "request aborted"))])

    # --- the loop -------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                self.commands.run()
                self._route(self._poll_transfers())
                if self.engine.has_work():
                    self._route(await asyncio.to_thread(self.engine.step))
                elif self.awaiting_kv:
                    await asyncio.sleep(0.001)  # transfers in flight: keep polling them
                else:
                    await self.commands.wait()
            except Exception:  # a bug must not silently stall every stream: fail loudly per request
                log.exception("decode loop error")
                for rid in list(self.streams):
                    self._route([TokenChunk(rid, (), error=ErrorInfo(ErrorCode.INTERNAL, "decode worker error"))])
                    self._abort(rid)
                await asyncio.sleep(0.1)

    def _poll_transfers(self) -> list[TokenChunk]:
        out = []
        for ev in self.receiver.poll():
            req = self.awaiting_kv.pop(ev.request_id, None)
            self.prefill_of.pop(ev.request_id, None)
            if req is None:
                if ev.kind == "ready":
                    self.receiver.release(ev.request_id)
                continue
            if ev.kind != "ready":
                self._record(ev.request_id, 0, ev.kind)
                if ev.kind == "corrupt":
                    self.receiver.release(ev.request_id)
                log.warning("transfer of %s %s (%s): recomputing locally", ev.request_id, ev.kind, ev.detail)
                self.fallbacks += 1
                self.engine.submit(req)
                continue
            header = TransferHeader.from_bytes(ev.header)
            pages = self.receiver.claim(ev.request_id)
            self._record(ev.request_id, sum(len(ids) * self.pools.specs[k].page_bytes for k, ids in pages.items()))
            seq = self.pools.adopt(header.num_tokens, pages)
            cached = header.num_tokens - header.computed_tokens
            try:
                out += self.engine.admit_transferred(req, seq, header.first_token, cached_tokens=cached)
            except PoolExhausted:  # no decode pages now: drop the KV, recompute when there is room
                self.pools.release(seq)
                self.engine.submit(req)
        return out

    def _record(self, request_id: str, nbytes: int, failure: str | None = None) -> None:
        started = self.reserved_at.pop(request_id, time.perf_counter())
        self.transfer_stats[request_id] = TransferStats(nbytes, time.perf_counter() - started, failure)

    def _route(self, chunks: list[TokenChunk]) -> None:
        for chunk in chunks:
            stats = self.transfer_stats.pop(chunk.request_id, None)
            if stats is not None:
                chunk = dataclasses.replace(chunk, transfer=stats)
            queue = self.streams.get(chunk.request_id)
            if queue is not None:
                queue.put_nowait(chunk)

    async def drain(self, settle_s: float = 2.0, timeout_s: float | None = None) -> dict:
        """Scale-down: stop being chosen, finish what is here, return once idle for `settle_s`.

        The load turns `draining` (published at once, so routers skip this worker from their
        next refresh on); requests that still arrive — placed on an older view — are served like
        any other. Idle = no stream, no KV awaited, no engine work, for `settle_s` on end (longer
        than a heartbeat plus a router refresh). Returns {"idle": False} if `timeout_s` passes
        first: the worker stays draining and nothing is cut short; call again."""
        self.draining = True
        try:
            await asyncio.to_thread(self.registry.heartbeat, self.info())
        except Exception as e:  # Redis down: the next regular heartbeat publishes it
            log.warning("publishing drain of %s failed: %s", self.worker_id, e)
        loop = asyncio.get_running_loop()
        start, quiet = loop.time(), None
        while True:
            busy = self.streams or self.awaiting_kv or self.commands or self.engine.has_work()
            now = loop.time()
            quiet = None if busy else (now if quiet is None else quiet)
            if quiet is not None and now - quiet >= settle_s:
                return {"worker_id": self.worker_id, "idle": True, "fallbacks": self.fallbacks}
            if timeout_s is not None and now - start >= timeout_s:
                return {"worker_id": self.worker_id, "idle": False, "fallbacks": self.fallbacks}
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.to_thread(self.registry.deregister, self.worker_id)
