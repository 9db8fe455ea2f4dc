"""Decode load scorer: prefer decode workers with free KV pages and short batches and queues.

    score = ½ · free_pages / total_pages  +  ½ · (1 − busy / max busy over the endpoints)
    busy  = running + waiting_weight · waiting      (a waiting request is worse: it is blocked)

A worker that cannot fit the request's pages now, has no pages at all, or is draining scores 0.
"""

from __future__ import annotations

from typing import Sequence

from router.policies.base import PlacementRequest
from worker_runtime.wire import WorkerLoad


def score_decode_load(request: PlacementRequest, endpoints: Sequence[WorkerLoad],
                      waiting_weight: float = 2.0) -> list[float]:
    busy = [e.running + waiting_weight * e.waiting for e in endpoints]
    max_busy = max(busy, default=0.0)
    scores = []
    for e, b in zip(endpoints, busy):
        if e.draining or e.total_pages <= 0 or e.free_pages < request.pages_needed:
            scores.append(0.0)
            continue
        free = min(max(e.free_pages / e.total_pages, 0.0), 1.0)
        queue = 1.0 - b / max_busy if max_busy > 0 else 1.0
        scores.append(0.5 * free + 0.5 * queue)
    return scores
