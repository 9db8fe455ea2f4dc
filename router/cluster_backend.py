"""The router's backend over the Ray cluster (the `Backend` protocol of router/stub_backend.py).

Per request, decode-first placement (router/placement.py) over the loads the workers publish
in the registry — corrected by the requests this router has on each decode worker now — and the
prefix index built from the prefill workers' KV events; then one streaming call to the chosen
decode actor, handing it the chosen prefill actor (or none: the decode worker prefills).

Admission (`overloaded`) reads the same view. The load reports are up to a heartbeat old, so
this router counts its own requests per decode worker exactly: one more when it places a request
there (in the same step of the event loop as the admission, router/dispatch.py), one less when
the request's stream there ends or moves on. A worker's queue is taken as the reported one, or
this router's requests there beyond the reported running batch, whichever is larger: exact with
one router; with several, each counts its own and sees the others' through the reports.

A request's stream survives its decode worker: a worker that migrates it away ends its stream
with `Moved` and the stream goes on from the target (`attach`); a worker that dies is replaced by
another one, which re-pulls the KV from the prefill worker still holding it (when no token was
streamed yet) or recomputes prompt + tokens so far. The client sees one continuous stream either way.

Prefill workers are seen the same way: a worker's queue (`queued_prefill_tokens`) is taken as the
reported one, or the prompt tokens this router placed there whose first chunk has not come back,
whichever is larger. With `PlacementConfig.max_prefill_queue_tokens`, a request to be prefilled
remotely waits here (up to its deadline) while every prefill worker's queue is past that bound.

Every request prefilled on its decode worker is counted with its reason (`decode_prefills`): the
placement's (short prompt, no prefill worker) or the decode worker's, which comes with the
request's first chunk (`TransferStats.failure`: expired, corrupt, no_room, prefill_failed, ...).

Each refresh also renews this router's lease in the registry, and every request it streams names
it (`GenerateRequest.router`): if this process dies, the decode workers abort its requests once
the lease lapses instead of decoding them for nobody.

Registry reads run in threads, never on the event loop; every router replica builds the same
prefix index because each reads the whole KV event stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from router.config import PlacementConfig
from router.metrics import RouterMetrics
from router.placement import place, placement_request
from router.prefix_index import PrefixIndex
from worker_runtime.registry import ROUTER_LEASE_S, Registry
from worker_runtime.wire import ErrorCode, ErrorInfo, GenerateRequest, TokenChunk, WorkerInfo, WorkerLoad

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Lost:
    """The decode worker under a request died: the last item of `_generate_once` instead of a chunk."""

    worker_id: str
    epoch: str  # its incarnation: a worker restarted under the same name is a new one, usable again
    request_id: str  # the request's id there
    prefill_id: str | None  # the prefill worker that computed its KV there (None: local, or migrated in)


class ClusterBackend:
    def __init__(self, registry: Registry, tokenizer, model_name: str, max_model_len: int,
                 placement: PlacementConfig, metrics: RouterMetrics | None = None,
                 max_waiting_per_worker: int = 64, refresh_s: float = 0.2, max_retargets: int = 2,
                 lease_s: float = ROUTER_LEASE_S, get_actor: Callable[[str], Any] = ray.get_actor):
        self.registry, self.tokenizer, self.model_name = registry, tokenizer, model_name
        self.max_model_len, self.placement, self.metrics = max_model_len, placement, metrics
        self.max_waiting_per_worker, self.refresh_s = max_waiting_per_worker, refresh_s
        self.max_retargets = max_retargets  # decode workers a request may lose before it fails
        self.lease_s = lease_s  # this router's registry lease, renewed every refresh_s
        self.get_actor = get_actor  # worker id → its handle (Ray's; InProcess.get_actor in one process)
        self.index = PrefixIndex(placement.page_size)
        self.router_id = f"router-{uuid.uuid4().hex[:12]}"  # one per process: its registry lease
        self.loads: dict[str, WorkerLoad] = {}
        self.epochs: dict[str, str] = {}  # worker id → incarnation registered now
        self.workers: dict[str, WorkerInfo] = {}  # worker id → its registry entry (NIXL metadata: prefill peers)
        self.own = Counter()  # decode worker id → this router's requests on it now
        self.own_prefill = Counter()  # prefill worker id → prompt tokens placed there, first chunk not back yet
        self.decode_of: dict[str, tuple[str, str]] = {}  # client request id → (decode worker, its request id)
        self._actors: dict[str, tuple[str | None, object]] = {}  # worker id → (incarnation, handle)
        self._tasks: list[asyncio.Task] = []

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        await self._refresh()
        self._tasks = [asyncio.create_task(self._refresh_loop()), asyncio.create_task(self._event_loop())]

    async def wait_for_workers(self, prefill: int, decode: int, timeout_s: float = 120.0) -> None:
        """Return once at least `prefill` / `decode` workers are registered (so a first request
        can be placed); TimeoutError after `timeout_s`."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            health = self.health()
            if health["decode"] >= decode and health["prefill"] >= prefill:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"workers did not register within {timeout_s}s: {health}")
            await asyncio.sleep(0.1)
            await self._refresh()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _refresh(self) -> None:
        await asyncio.to_thread(self.registry.renew_router, self.router_id, self.lease_s)
        workers = await asyncio.to_thread(self.registry.workers)
        fresh = {w.worker_id: w.load for w in workers}
        for gone in set(self.loads) - set(fresh):
            self.index.remove_worker(gone)
        self.loads = fresh
        self.epochs = {w.worker_id: w.epoch for w in workers}
        self.workers = {w.worker_id: w for w in workers}
        if self.metrics is not None:
            for role in ("prefill", "decode"):
                self.metrics.set_queue_depth(role, sum(l.waiting for l in fresh.values() if l.role == role))

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self._refresh()
            except Exception as e:  # Redis restarting: keep the last view, retry
                log.warning("registry refresh failed: %s", e)
                if self.metrics is not None:
                    self.metrics.registry_error()

    async def _event_loop(self) -> None:
        last = "0-0"
        while True:
            try:
                last, events = await asyncio.to_thread(self.registry.read_events, last, 500)
                for event in events:
                    self.index.apply(event)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis restarting: retry from the last event seen
                log.warning("KV event read failed: %s", e)
                await asyncio.sleep(0.5)

    # --- the Backend protocol --------------------------------------------------------------
    def _view(self, role: str) -> list[WorkerLoad]:
        """The non-draining workers of `role`; a decode worker's queue corrected by this router's
        own requests there (see the module docstring)."""
        out = []
        for l in self.loads.values():
            if l.role != role or l.draining:
                continue
            if role == "decode" and self.own[l.worker_id] - l.running > l.waiting:
                l = dataclasses.replace(l, waiting=self.own[l.worker_id] - l.running)
            if role == "prefill" and self.own_prefill[l.worker_id] > l.queued_prefill_tokens:
                l = dataclasses.replace(l, queued_prefill_tokens=self.own_prefill[l.worker_id])
            out.append(l)
        return out

    def _count(self, worker_id: str, n: int, counter: Counter | None = None) -> None:
        counter = self.own if counter is None else counter
        counter[worker_id] += n
        if counter[worker_id] <= 0:
            del counter[worker_id]

    async def _place(self, req: GenerateRequest, exclude: set[tuple[str, str]]):
        """The placement of `req`; while every prefill queue is past the bound, wait here (a
        refresh at a time) → (placement or None, error chunk or None)."""
        counted = False
        while True:
            decode_loads = [l for l in self._view("decode")
                            if (l.worker_id, self.epochs.get(l.worker_id)) not in exclude]
            where = place(placement_request(req.prompt_ids, req.max_tokens, self.index), decode_loads,
                          self._view("prefill"), self.placement, tie_key=req.request_id)
            if where is None or not where.wait:
                return where, None
            if self.metrics is not None and not counted:
                self.metrics.prefill_wait()
            counted = True
            if req.deadline is not None and time.time() >= req.deadline:
                return None, TokenChunk(req.request_id, (), error=ErrorInfo(
                    ErrorCode.DEADLINE_EXCEEDED, "every prefill worker's queue stayed past its bound"))
            await asyncio.sleep(self.refresh_s)

    def _decode_prefill(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.decode_prefill(reason)

    def _actor(self, worker_id: str):
        """The actor of `worker_id`, looked up again once the registry shows a new incarnation
        (a worker restarted under the same name is another actor)."""
        epoch = self.epochs.get(worker_id)
        cached = self._actors.get(worker_id)
        if cached is None or cached[0] != epoch:
            cached = self._actors[worker_id] = (epoch, self.get_actor(worker_id))
        return cached[1]

    async def generate(self, req: GenerateRequest):
        """Stream `req`'s chunks. If its decode worker dies, the request moves to another one: it
        re-pulls the KV from the prefill worker if none of it was decoded yet and that worker
        still holds it, else prompt + tokens generated so far are recomputed there; since sampling
        is a pure function of (logits, seed, position) the stream goes on with the tokens it
        would have had."""
        req = dataclasses.replace(req, router=self.router_id)
        generated: list[int] = []
        lost: set[tuple[str, str]] = set()  # (worker id, incarnation) of decode workers that died under it
        repull: tuple[str, str] | None = None  # (prefill worker, request id) holding the KV of a lost attempt
        retargeted = False  # the next token chunk tells how (its transfer stats), and is counted then
        while True:
            # a retry is a new request to the workers (its own id: the old one may linger there)
            attempt = req if not lost else dataclasses.replace(
                req, request_id=f"{req.request_id}~{len(lost)}", prompt_ids=req.prompt_ids + tuple(generated),
                max_tokens=req.max_tokens - len(generated), grammar_replay=tuple(generated),
                # the client has the prompt's logprobs once a token came: the longer prompt's are not asked
                prompt_logprobs=None if generated else req.prompt_logprobs)
            outcome = None
            async for chunk in self._generate_once(attempt, lost, req.request_id, repull):
                if isinstance(chunk, _Lost):  # the decode worker died: retarget
                    outcome = chunk
                    break
                if retargeted and (chunk.token_ids or chunk.finish_reason):
                    retargeted = False
                    t = chunk.transfer
                    self._retargeted("repull" if t and t.source == "repull" and t.failure is None else "recompute")
                generated.extend(chunk.token_ids)
                if lost:  # the client knows only its original prompt length
                    usage = chunk.usage and dataclasses.replace(
                        chunk.usage, prompt_tokens=len(req.prompt_ids), completion_tokens=len(generated))
                    chunk = dataclasses.replace(chunk, usage=usage)
                if chunk.request_id != req.request_id:  # the client knows only its own id
                    chunk = dataclasses.replace(chunk, request_id=req.request_id)
                yield chunk
                if chunk.finish_reason or chunk.error:
                    return
            if outcome is None:
                return
            lost.add((outcome.worker_id, outcome.epoch))
            repull = (outcome.prefill_id, outcome.request_id) if outcome.prefill_id and not generated else None
            retargeted = True
            log.warning("decode worker %s lost under %s after %d tokens: retargeting (%s)", outcome.worker_id,
                        req.request_id, len(generated), "re-pull" if repull else "recompute")
            if len(lost) > self.max_retargets:
                yield TokenChunk(req.request_id, (), error=ErrorInfo(ErrorCode.NO_WORKER, "decode workers lost"))
                return

    def _retargeted(self, path: str) -> None:
        if self.metrics is not None:
            self.metrics.request_retargeted(path)

    async def _generate_once(self, req: GenerateRequest, exclude: set[tuple[str, str]], client_id: str,
                             repull: tuple[str, str] | None = None):
        """One placement and one streaming call, following the request when it migrates. Yields
        chunks, or a `_Lost` last if the decode worker under it died."""
        where, refused = await self._place(req, exclude)
        if where is None:
            yield refused or TokenChunk(req.request_id, (), error=ErrorInfo(ErrorCode.NO_WORKER,
                                                                             "no decode worker available"))
            return
        worker_id, rid, prefill_id, repull_id = where.decode_id, req.request_id, where.prefill_id, None
        self._count(worker_id, 1)  # before any await: the next admission decision sees it
        counted = worker_id
        queued = (prefill_id, len(req.prompt_ids) - where.cached_tokens) if prefill_id and repull is None else None
        if queued is not None:
            self._count(*queued, self.own_prefill)
        try:
            epoch = self.epochs.get(worker_id, "")
            if repull is not None:  # the KV is held by that prefill worker: it alone can re-send it
                prefill_id, repull_id = repull
            try:
                decode = self._actor(worker_id)
            except ValueError:  # removed since our last registry view (scale-down): as if it died
                yield _Lost(worker_id, epoch, rid, None)
                return
            try:
                prefill = self._actor(prefill_id) if prefill_id is not None else None
            except ValueError:
                prefill, prefill_id, repull_id = None, None, None  # the decode worker prefills itself
                self._decode_prefill("prefill_gone")
            else:
                if prefill is None:
                    self._decode_prefill(where.reason)
            self.decode_of[client_id] = (worker_id, rid)
            # the prefill worker's registry entry: the decode worker loads its NIXL metadata from it
            stream = decode.generate.options(num_returns="streaming").remote(req, prefill, repull_id,
                                                                             self.workers.get(prefill_id))
            finished, attached = False, False
            try:
                while True:
                    moved = None
                    async for ref in stream:
                        chunk = await ref
                        if chunk.moved is not None:
                            moved = chunk.moved
                            break
                        if attached and chunk.error is not None and chunk.error.code is ErrorCode.NO_WORKER:
                            finished = True  # it migrated there, but that worker no longer has it
                            yield _Lost(worker_id, epoch, rid, None)
                            return
                        attached = False
                        if queued is not None:  # its prefill is done (or failed): off that queue
                            self._count(queued[0], -queued[1], self.own_prefill)
                            queued = None
                        self._transfer_metrics(chunk)
                        finished = bool(chunk.finish_reason or chunk.error)
                        yield chunk
                        if finished:
                            return
                    if moved is None:
                        yield TokenChunk(req.request_id, (),
                                         error=ErrorInfo(ErrorCode.INTERNAL, "stream ended early"))
                        finished = True
                        return
                    # migrated: the rest of the stream comes from the target, not a token lost or repeated
                    worker_id, rid, prefill_id, attached = moved.worker_id, moved.request_id, None, True
                    self._count(counted, -1)
                    self._count(worker_id, 1)
                    counted = worker_id
                    epoch = self.epochs.get(worker_id, "")
                    self.decode_of[client_id] = (worker_id, rid)
                    self._retargeted("migrate")
                    try:
                        decode = self._actor(worker_id)
                    except ValueError:
                        finished = True
                        yield _Lost(worker_id, epoch, rid, None)
                        return
                    stream = decode.attach.options(num_returns="streaming").remote(rid)
            except ray.exceptions.RayActorError:
                self._actors.pop(worker_id, None)
                finished = True  # nothing left to abort there
                yield _Lost(worker_id, epoch, rid, prefill_id)
            finally:
                self.decode_of.pop(client_id, None)
                if not finished:  # client went away: make sure the worker stops
                    try:
                        decode.abort.remote(rid)
                    except Exception:
                        pass
        finally:
            self._count(counted, -1)
            if queued is not None:
                self._count(queued[0], -queued[1], self.own_prefill)

    def _transfer_metrics(self, chunk: TokenChunk) -> None:
        if chunk.transfer is not None and self.metrics is not None:
            if chunk.transfer.failure is None:
                self.metrics.kv_transfer_done(chunk.transfer.nbytes, chunk.transfer.seconds,
                                              chunk.transfer.wire_seconds)
            else:
                self.metrics.kv_transfer_failed(chunk.transfer.failure)
                if chunk.transfer.source != "migration":  # recomputed on the decode worker
                    self.metrics.decode_prefill(chunk.transfer.failure)

    async def abort(self, request_id: str) -> None:
        placed = self.decode_of.get(request_id)
        if placed is not None:
            worker, worker_request_id = placed
            await self._actor(worker).abort.remote(worker_request_id)

    def overloaded(self) -> float | None:
        decode = self._view("decode")
        if decode and all(l.waiting >= self.max_waiting_per_worker for l in decode):
            return 1.0
        return None

    def health(self) -> dict:
        roles = Counter(l.role for l in self.loads.values())
        return {"ok": roles["decode"] > 0, "prefill": roles["prefill"], "decode": roles["decode"]}
