"""Prefix-affinity scorer for prefill workers: cached tokens saved against queued prefill work.

A prefill worker's time to this request's KV is roughly proportional to the tokens it must still
compute before it is done: its queue plus the part of this prompt it has not cached,

    work_i  = queued_prefill_tokens_i + (prompt_tokens − cached_tokens_i)
    score_i = min_j work_j / work_i          (1 for the soonest-done worker; 1 when work_i = 0)

so a long cached prefix wins only while it saves more than the extra queue it waits behind.
Draining workers score 0.
"""

from __future__ import annotations

from typing import Sequence

from router.policies.base import PlacementRequest
from worker_runtime.wire import WorkerLoad


def score_prefix_affinity(request: PlacementRequest, endpoints: Sequence[WorkerLoad]) -> list[float]:
    work = [max(e.queued_prefill_tokens, 0) + request.prompt_tokens - request.cached_tokens(e.worker_id)
            for e in endpoints]
    live = [w for e, w in zip(endpoints, work) if not e.draining]
    best = min(live, default=0)
    scores = []
    for e, w in zip(endpoints, work):
        if e.draining:
            scores.append(0.0)
        elif w <= 0:
            scores.append(1.0)
        else:
            scores.append(best / w)
    return scores
