"""Decode-first placement: decode worker by load, then the P/D decision, then the prefill worker
by prefix affinity. Called by the cluster backend for each request; pure given its inputs.

    req = placement_request(prompt_ids, max_tokens, index)
    p = place(req, decode_loads, prefill_loads, config.placement, tie_key=request_id)
    # p.decode_id, p.prefill_id (None: decode prefills locally), p.cached_tokens;
    # p.wait: every prefill queue is past `max_prefill_queue_tokens`: place it again later
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from router.config import PlacementConfig
from router.policies.base import PlacementRequest
from router.policies.decode_load import score_decode_load
from router.policies.pd_decision import decide_prefill
from router.policies.picker import combine, pick
from router.policies.prefill_queue import prefill_saturated
from router.policies.prefix_affinity import score_prefix_affinity
from router.prefix_index import PrefixIndex
from worker_runtime.wire import WorkerLoad


@dataclass(frozen=True)
class Placement:
    decode_id: str
    prefill_id: str | None  # None: the decode worker prefills locally
    cached_tokens: int  # prompt tokens the chosen prefill worker already holds
    reason: str  # the P/D decision's reason ("prefill_busy" when it waits)
    wait: bool = False  # every prefill worker's queue is past the bound: hold the request, place it later


def placement_request(prompt_ids: Sequence[int], max_tokens: int, index: PrefixIndex) -> PlacementRequest:
    return PlacementRequest(prompt_tokens=len(prompt_ids), max_tokens=max_tokens, page_size=index.page_size,
                            cached_pages=index.match_tokens(prompt_ids))


def pick_prefill(req: PlacementRequest, prefill: Sequence[WorkerLoad], config: PlacementConfig,
                 tie_key: str = "") -> WorkerLoad | None:
    scores = combine([(config.prefix_affinity_weight, score_prefix_affinity(req, prefill))])
    return pick(prefill, scores, tie_key)


def place(req: PlacementRequest, decode: Sequence[WorkerLoad], prefill: Sequence[WorkerLoad],
          config: PlacementConfig, tie_key: str = "") -> Placement | None:
    """None when no decode worker can take the request (the caller answers NO_WORKER)."""
    scores = combine([(config.decode_load_weight, score_decode_load(req, decode, config.waiting_weight))])
    d = pick(decode, scores, tie_key)
    if d is None:
        return None
    live_prefill = [p for p in prefill if not p.draining]
    decision = decide_prefill(req.prompt_tokens, 0, config.remote_prefill_threshold, bool(live_prefill))
    if not decision.remote_prefill:
        return Placement(d.worker_id, None, 0, decision.reason)
    if prefill_saturated(live_prefill, config.max_prefill_queue_tokens):
        return Placement(d.worker_id, None, 0, "prefill_busy", wait=True)
    p = pick_prefill(req, live_prefill, config, tie_key)
    return Placement(d.worker_id, p.worker_id, req.cached_tokens(p.worker_id), decision.reason)
