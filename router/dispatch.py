"""One generation from admission to its last token, shared by the HTTP and gRPC front doors.

    slot = dispatcher.admit()                          # 429 / RESOURCE_EXHAUSTED before any work
    outcome = await dispatcher.execute(slot, req, emit, arrival, owner)
    outcomes = await dispatcher.execute_group(slot, request_id, children, emit_k, arrival, owner)  # n > 1, batches

`execute` relays the backend's `TokenChunk`s to `emit` under the request's deadline and records
the latency metrics. Whatever way it ends other than a finish reason — an error chunk, the
deadline, the client going away (the calling task is cancelled), an `Abort` by request id, the
router shutting down — the backend is told `abort(request_id)`, so prefill and decode free the
request's pages.

Admission and placement happen in one step of the event loop: both front doors call `execute`
right after `admit` (HTTP writes the SSE headers between, which waits only on a client that has
stopped reading), and the backend places the request in the first step of its `generate`. A
backend that counts the requests it placed (router/cluster_backend.py) thus sees every admitted
request before the next admission decision, however large the burst.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from router.choices import Child
from router.errors import APIError, shutting_down
from router.metrics import RouterMetrics
from worker_runtime.wire import ErrorCode, GenerateRequest, TokenChunk, Usage

log = logging.getLogger("v4serve.router.dispatch")

Emit = Callable[[TokenChunk], Awaitable[None]]
EmitChoice = Callable[[int, TokenChunk], Awaitable[None]]  # (choice index, chunk)
_SETTLE_TIMEOUT_S = 10.0  # closing and aborting a finished request's backend stream, at most


@dataclass(frozen=True)
class Outcome:
    finish_reason: str
    usage: Usage


class Slot:
    """One admitted request's places under `max_concurrent_requests` (one per choice); release is
    idempotent."""

    __slots__ = ("_dispatcher", "_held", "count")

    def __init__(self, dispatcher: "Dispatcher", count: int = 1):
        self._dispatcher, self._held, self.count = dispatcher, True, count

    def release(self) -> None:
        if self._held:
            self._held = False
            self._dispatcher._active -= self.count


class _Running:
    """A request in `execute`: its task, the API key identity that made it, and, once something
    ended it from outside, the error it ends with and its metrics label."""

    __slots__ = ("task", "owner", "running", "ended_by")

    def __init__(self, task: asyncio.Task, owner: str | None):
        self.task, self.owner, self.running = task, owner, True
        self.ended_by: tuple[APIError, tuple[str, str]] | None = None

    def end(self, err: APIError, label: tuple[str, str]) -> bool:
        if not self.running or self.ended_by is not None:
            return False
        self.ended_by = (err, label)
        self.task.cancel()
        return True


class Dispatcher:
    def __init__(self, backend, metrics: RouterMetrics, max_concurrent: int, retry_after_s: float):
        self.backend = backend
        self.metrics = metrics
        self.max_concurrent = max_concurrent
        self.retry_after_s = retry_after_s
        self.closing = False  # set by the shutdown: no more admissions
        self._active = 0
        self._inflight: dict[str, _Running] = {}  # request id → its run, until its backend stream is settled
        self._settling: set[asyncio.Task] = set()

    # --- admission
    def admit(self, count: int = 1) -> Slot:
        """A slot for a request of `count` concurrent generations (its choices), or
        APIError(OVERLOADED) when the pools or the router are over their limits."""
        if self.closing:
            raise shutting_down()
        retry = self.backend.overloaded()
        if retry is not None:
            raise APIError(ErrorCode.OVERLOADED, "the serving pools are over their queue limits; retry later",
                           retry_after=max(float(retry), 0.0))
        if self._active + count > self.max_concurrent:
            raise APIError(ErrorCode.OVERLOADED, f"more than {self.max_concurrent} requests in flight; retry later",
                           retry_after=self.retry_after_s)
        self._active += count
        return Slot(self, count)

    def rejected(self, err: APIError) -> None:
        """Count a request that failed outside `execute` (validation, auth, admission, a bug)."""
        if not err.counted:
            err.counted = True
            self.metrics.request_finished("error", err.reason)

    @property
    def active(self) -> int:
        return self._active

    def in_flight(self, request_id: str) -> bool:
        return request_id in self._inflight

    # --- abort by id (gRPC Abort, shutdown)
    async def abort(self, request_id: str, owner: str | None = None) -> bool:
        """Cancel an in-flight request (its stream ends CANCELLED). `owner` None (API keys off):
        any request, and the backend is told too, since the request may run through another
        router replica. `owner` set: only a request of this router made with that key; nothing
        else is touched, since another replica's request cannot be checked."""
        run = self._inflight.get(request_id)
        if owner is not None and (run is None or run.owner != owner):
            return False
        if run is not None:
            run.end(APIError(ErrorCode.CANCELLED, "the request was aborted"), ("cancelled", "aborted"))
        await self.backend.abort(request_id)
        return run is not None

    def close(self) -> None:
        """Admit nothing more (the shutdown's first step)."""
        self.closing = True

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, at most `timeout_s`; whether none is."""
        end = time.monotonic() + timeout_s
        while any(r.running for r in self._inflight.values()) and time.monotonic() < end:
            await asyncio.sleep(0.02)
        return not any(r.running for r in self._inflight.values())

    async def abort_all(self, timeout_s: float = _SETTLE_TIMEOUT_S) -> None:
        """End every request still running with `shutting_down` (an SSE error event, a gRPC
        status), and wait, at most `timeout_s`, until their backend streams are settled."""
        for run in list(self._inflight.values()):
            run.end(shutting_down(), ("error", "shutdown"))
        end = time.monotonic() + timeout_s
        while self._inflight and time.monotonic() < end:
            await asyncio.sleep(0.01)

    # --- execution
    async def execute(self, slot: Slot, req: GenerateRequest, emit: Emit, arrival: float,
                      owner: str | None = None) -> Outcome:
        """Relay `req`'s chunks to `emit`; `arrival` is the perf_counter() time the request came
        in, `owner` the identity of the API key it came with (None: keys off)."""
        rid = req.request_id
        if rid in self._inflight:
            slot.release()
            raise APIError(ErrorCode.INVALID_REQUEST, f"request_id '{rid}' is already in flight", "request_id")
        run = self._inflight[rid] = _Running(asyncio.current_task(), owner)
        self.metrics.in_flight.inc()
        relay = _Relay(self.metrics, arrival)
        gen = self.backend.generate(req)
        outcome_label = ("cancelled", "client_disconnect")
        try:
            timeout = None if req.deadline is None else max(0.0, req.deadline - time.time())
            async with asyncio.timeout(timeout):
                async for chunk in gen:
                    if chunk.error is not None:
                        raise APIError.from_info(chunk.error)
                    relay.observe(chunk)
                    await emit(chunk)
                    if chunk.finish_reason is not None:
                        relay.finish = chunk
                        break
            if relay.finish is None:
                raise APIError(ErrorCode.INTERNAL, "the backend ended the stream without a finish reason")
            outcome_label = ("success", relay.finish.finish_reason)
        except BaseException as exc:
            err, outcome_label = _ending(exc, run)
            if err is exc:
                raise
            raise err from (exc if isinstance(exc, Exception) and not isinstance(exc, TimeoutError) else None)
        finally:
            # The bookkeeping first, with no await before it: a second cancellation (a gRPC
            # deadline firing while the first one unwinds) must not skip it.
            run.running = False
            self.metrics.in_flight.dec()
            slot.release()
            relay.done(outcome_label)
            await self._settle(rid, run, gen, abort=relay.finish is None)
        usage = relay.finish.usage or Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=relay.tokens)
        self.metrics.usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        return Outcome(relay.finish.finish_reason, usage)

    async def execute_group(self, slot: Slot, request_id: str, children: Sequence[Child], emit: EmitChoice,
                            arrival: float, owner: str | None = None) -> list[Outcome]:
        """Run a request of several choices (router/choices.py): each child streams to
        `emit(index, chunk)` in a task of its own, a child with `after` once that child's first
        chunk is out. One child failing fails the request with its error, and whatever ends the
        request (deadline, disconnect, Abort of `request_id` or of a child's id, shutdown) ends
        every child; each unfinished one is aborted in the backend. One outcome per child."""
        ids = [request_id] + [c.req.request_id for c in children]
        taken = next((i for i in ids if i in self._inflight), None)
        if taken is not None:
            slot.release()
            raise APIError(ErrorCode.INVALID_REQUEST, f"request_id '{taken}' is already in flight", "request_id")
        run = _Running(asyncio.current_task(), owner)
        for i in ids:
            self._inflight[i] = run
        self.metrics.in_flight.inc()
        relays = [_Relay(self.metrics, arrival) for _ in children]
        gens: list = [None] * len(children)
        first = [asyncio.Event() for _ in children]

        async def child(k: int, c: Child) -> None:
            if c.after is not None:
                await first[c.after].wait()
            gen = gens[k] = self.backend.generate(c.req)
            relay = relays[k]
            try:
                async for chunk in gen:
                    if chunk.error is not None:
                        raise APIError.from_info(chunk.error)
                    first[k].set()
                    relay.observe(chunk)
                    await emit(c.index, chunk)
                    if chunk.finish_reason is not None:
                        relay.finish = chunk
                        return
            finally:
                first[k].set()  # a choice waiting on this one must not wait forever
            raise APIError(ErrorCode.INTERNAL, "the backend ended the stream without a finish reason")

        tasks = [asyncio.ensure_future(child(k, c)) for k, c in enumerate(children)]
        outcome_label = ("cancelled", "client_disconnect")
        try:
            timeout = None if children[0].req.deadline is None else max(0.0, children[0].req.deadline - time.time())
            async with asyncio.timeout(timeout):
                await _first_failure(tasks)
            outcome_label = ("success", relays[0].finish.finish_reason)
        except BaseException as exc:
            err, outcome_label = _ending(exc, run)
            if err is exc:
                raise
            raise err from (exc if isinstance(exc, Exception) and not isinstance(exc, TimeoutError) else None)
        finally:
            run.running = False
            self.metrics.in_flight.dec()
            slot.release()
            relays[0].done(outcome_label)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            pending = [(c.req.request_id, g, r.finish is None) for c, g, r in zip(children, gens, relays)]
            await self._settle_all(ids, run, pending)
        outcomes = [Outcome(r.finish.finish_reason, r.finish.usage or Usage(len(c.req.prompt_ids), r.tokens))
                    for c, r in zip(children, relays)]
        # each prompt counted once (its first choice's), cache hits wherever they happened
        self.metrics.usage(sum(o.usage.prompt_tokens for c, o in zip(children, outcomes) if c.after is None),
                           sum(o.usage.completion_tokens for o in outcomes), sum(o.usage.cached_tokens for o in outcomes))
        return outcomes

    async def _settle_all(self, ids: list[str], run: _Running, streams: list[tuple[str, object, bool]]) -> None:
        """`_settle` for a group: every started child's stream closed, the unfinished ones aborted
        (a child that never started was never seen by the backend)."""
        async def settle():
            try:
                async with asyncio.timeout(_SETTLE_TIMEOUT_S):
                    for rid, gen, unfinished in streams:
                        if gen is None:
                            continue
                        await _close_quietly(gen)
                        if unfinished:
                            await self.backend.abort(rid)
            except Exception:  # noqa: BLE001 - the request has ended; a failing abort is logged, not raised
                log.exception("settling request %s in the backend failed", ids[0])
            finally:
                for i in ids:
                    if self._inflight.get(i) is run:
                        del self._inflight[i]

        task = asyncio.ensure_future(settle())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        await asyncio.shield(task)

    async def _settle(self, rid: str, run: _Running, gen, abort: bool) -> None:
        """Close the backend stream; for a request that did not finish, close it and abort it
        there in a task of its own, which cancelling the caller again does not stop. The request
        id stays taken until then, so a reuse of it cannot meet the old request in the backend."""
        if not abort:  # finished: closing its stream has nothing to wait for, no task needed
            try:
                await _close_quietly(gen)
            finally:
                if self._inflight.get(rid) is run:
                    del self._inflight[rid]
            return

        async def settle():
            try:
                async with asyncio.timeout(_SETTLE_TIMEOUT_S):
                    await _close_quietly(gen)
                    await self.backend.abort(rid)
            except Exception:  # noqa: BLE001 - the request has ended; a failing abort is logged, not raised
                log.exception("settling request %s in the backend failed", rid)
            finally:
                if self._inflight.get(rid) is run:
                    del self._inflight[rid]

        task = asyncio.ensure_future(settle())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        await asyncio.shield(task)


class _Relay:
    """Latency bookkeeping of one stream (TTFT, per-token gaps, end to end)."""

    __slots__ = ("metrics", "arrival", "last", "tokens", "finish")

    def __init__(self, metrics: RouterMetrics, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.last: float | None = None
        self.tokens = 0
        self.finish: TokenChunk | None = None

    def observe(self, chunk: TokenChunk) -> None:
        """TTFT at the first token; afterwards one inter-token sample per chunk, the chunk's gap
        divided by its token count (= one sample per token when the backend streams token by
        token, and bounded cost when it sends many tokens at once)."""
        k = len(chunk.token_ids)
        if not k:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe((now - self.last) / k)
        self.last = now
        self.tokens += k

    def done(self, outcome: tuple[str, str]) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        self.metrics.request_finished(*outcome)


def _ending(exc: BaseException, run: _Running) -> tuple[APIError, tuple[str, str]]:
    """What a request whose relay raised `exc` ends with: the APIError it answers with (counted)
    and its outcome label. A cancellation from outside (a client gone, not an Abort or shutdown of
    ours) and anything that is not an Exception are re-raised as they are."""
    if isinstance(exc, asyncio.CancelledError):
        if run.ended_by is None:
            raise exc
        asyncio.current_task().uncancel()  # ended by us (Abort, shutdown): the request ends, not the task
        err, label = run.ended_by
    elif isinstance(exc, TimeoutError):
        err = APIError(ErrorCode.DEADLINE_EXCEEDED, "the request did not finish before its deadline")
        label = ("error", err.reason)
    elif isinstance(exc, APIError):
        err, label = exc, ("error", exc.reason)
    elif isinstance(exc, Exception):  # a broken backend or transport: reason-coded, never a bare 500 trace
        err = APIError(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}")
        label = ("error", err.reason)
    else:
        raise exc
    err.counted = True
    return err, label


async def _first_failure(tasks: list[asyncio.Task]) -> None:
    """Wait for every task; the first to fail (in the order they end) fails the wait, its error raised."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()


async def _close_quietly(gen) -> None:
    """Close the backend's async generator; errors from a generator being torn down are not ours."""
    try:
        await gen.aclose()
    except Exception:  # noqa: BLE001 - a broken backend generator must not mask the request's outcome
        pass
