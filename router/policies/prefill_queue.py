"""Prefill queue bound: should a request that is to be prefilled remotely wait at the router?

A prefill worker's queue is its `queued_prefill_tokens` (prompt tokens still to prefill, the
requests it holds without a target yet included). When every live prefill worker's queue is deeper
than `bound`, pushing one more request into any of them only lengthens that queue: the request
waits at the router instead (up to its deadline), and is placed once some queue drains below the
bound. Without live prefill workers there is nothing to wait for (the decode worker prefills).
"""

from __future__ import annotations

from collections.abc import Sequence

from worker_runtime.wire import WorkerLoad


def prefill_saturated(endpoints: Sequence[WorkerLoad], bound: int | None) -> bool:
    live = [e for e in endpoints if not e.draining]
    return bound is not None and bool(live) and all(e.queued_prefill_tokens > bound for e in live)
