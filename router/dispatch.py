"""One generation from admission to its last token, shared by the HTTP and gRPC front doors.

    slot = dispatcher.admit()                          # 429 / RESOURCE_EXHAUSTED before any work
    outcome = await dispatcher.execute(slot, req, emit, arrival)

`execute` relays the backend's `TokenChunk`s to `emit` under the request's deadline and records
the latency metrics. Whatever way it ends other than a finish reason — an error chunk, the
deadline, the client going away (the calling task is cancelled), an `Abort` by request id — the
backend is told `abort(request_id)`, so prefill and decode free the request's pages.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from router.errors import APIError, reason_label
from router.metrics import RouterMetrics
from worker_runtime.wire import ErrorCode, GenerateRequest, TokenChunk, Usage

Emit = Callable[[TokenChunk], Awaitable[None]]


@dataclass(frozen=True)
class Outcome:
    finish_reason: str
    usage: Usage


class Slot:
    """One admitted request's place under `max_concurrent_requests`; release is idempotent."""

    __slots__ = ("_dispatcher", "_held")

    def __init__(self, dispatcher: "Dispatcher"):
        self._dispatcher, self._held = dispatcher, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._dispatcher._active -= 1


class Dispatcher:
    def __init__(self, backend, metrics: RouterMetrics, max_concurrent: int, retry_after_s: float):
        self.backend = backend
        self.metrics = metrics
        self.max_concurrent = max_concurrent
        self.retry_after_s = retry_after_s
        self._active = 0
        self._inflight: dict[str, asyncio.Task] = {}
        self._aborted: set[str] = set()

    # --- admission
    def admit(self) -> Slot:
        """A slot, or APIError(OVERLOADED) when the pools or the router are over their limits."""
        retry = self.backend.overloaded()
        if retry is not None:
            raise APIError(ErrorCode.OVERLOADED, "the serving pools are over their queue limits; retry later",
                           retry_after=max(float(retry), 0.0))
        if self._active >= self.max_concurrent:
            raise APIError(ErrorCode.OVERLOADED, f"more than {self.max_concurrent} requests in flight; retry later",
                           retry_after=self.retry_after_s)
        self._active += 1
        return Slot(self)

    def rejected(self, err: APIError) -> None:
        """Count a request that failed before `execute` (validation, auth, admission)."""
        if not err.counted:
            err.counted = True
            self.metrics.request_finished("error", reason_label(err.code))

    @property
    def active(self) -> int:
        return self._active

    def in_flight(self, request_id: str) -> bool:
        return request_id in self._inflight

    # --- abort by id (gRPC Abort, shutdown)
    async def abort(self, request_id: str) -> bool:
        """Cancel an in-flight request of this router (its stream ends CANCELLED); always tells the
        backend too, since the request may run through another router replica."""
        task = self._inflight.get(request_id)
        if task is not None:
            self._aborted.add(request_id)
            task.cancel()
        await self.backend.abort(request_id)
        return task is not None

    async def abort_all(self) -> None:
        for rid in list(self._inflight):
            await self.abort(rid)

    # --- execution
    async def execute(self, slot: Slot, req: GenerateRequest, emit: Emit, arrival: float) -> Outcome:
        """Relay `req`'s chunks to `emit`; `arrival` is the perf_counter() time the request came in."""
        rid = req.request_id
        if rid in self._inflight:
            slot.release()
            raise APIError(ErrorCode.INVALID_REQUEST, f"request_id '{rid}' is already in flight", "request_id")
        self._inflight[rid] = asyncio.current_task()
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
        except TimeoutError:
            err = APIError(ErrorCode.DEADLINE_EXCEEDED, "the request did not finish before its deadline")
            err.counted, outcome_label = True, ("error", reason_label(err.code))
            raise err from None
        except APIError as err:
            err.counted, outcome_label = True, ("error", reason_label(err.code))
            raise
        except asyncio.CancelledError:
            if rid not in self._aborted:
                raise
            asyncio.current_task().uncancel()  # our own Abort: end the request as CANCELLED, not the task
            outcome_label = ("cancelled", "aborted")
            err = APIError(ErrorCode.CANCELLED, "the request was aborted")
            err.counted = True
            raise err from None
        except Exception as exc:  # a broken backend or transport: reason-coded, never a bare 500 trace
            outcome_label = ("error", reason_label(ErrorCode.INTERNAL))
            err = APIError(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}")
            err.counted = True
            raise err from exc
        finally:
            await _close_quietly(gen)
            if relay.finish is None:
                await asyncio.shield(self.backend.abort(rid))
            self._inflight.pop(rid, None)
            self._aborted.discard(rid)
            self.metrics.in_flight.dec()
            slot.release()
            relay.done(outcome_label)
        usage = relay.finish.usage or Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=relay.tokens)
        self.metrics.usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        return Outcome(relay.finish.finish_reason, usage)


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


async def _close_quietly(gen) -> None:
    """Close the backend's async generator; errors from a generator being torn down are not ours."""
    try:
        await gen.aclose()
    except Exception:  # noqa: BLE001 - a broken backend generator must not mask the request's outcome
        pass
