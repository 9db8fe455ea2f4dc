"""Combining scorers and picking one endpoint, deterministically.

    combined_i = Σ_s w_s · score_s,i / Σ_s w_s          (weights ≥ 0; stays in [0, 1])

`pick` returns the best non-draining endpoint. Ties (within 1e-9) are broken by a rendezvous hash
of (tie_key, worker_id): deterministic for a given key, yet spread over the tied workers when the
key is the request id — so a burst that arrives between two load reports does not pile onto the
alphabetically first worker.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

from worker_runtime.wire import WorkerLoad

_TIE_EPS = 1e-9


def combine(weighted: Sequence[tuple[float, Sequence[float]]]) -> list[float]:
    if not weighted:
        return []
    n = len(weighted[0][1])
    if any(len(s) != n for _, s in weighted):
        raise ValueError("every scorer must score every endpoint")
    if any(w < 0 for w, _ in weighted):
        raise ValueError("scorer weights must be >= 0")
    total = sum(w for w, _ in weighted)
    if total == 0:
        return [0.0] * n
    return [sum(w * s[i] for w, s in weighted) / total for i in range(n)]


def _tie_rank(tie_key: str, worker_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{tie_key}\x00{worker_id}".encode(), digest_size=8).digest(), "little")


def pick(endpoints: Sequence[WorkerLoad], scores: Sequence[float], tie_key: str = "") -> WorkerLoad | None:
    if len(endpoints) != len(scores):
        raise ValueError("one score per endpoint")
    live = [(s, e) for e, s in zip(endpoints, scores) if not e.draining]
    if not live:
        return None
    top = max(s for s, _ in live)
    tied = [e for s, e in live if s >= top - _TIE_EPS]
    return max(tied, key=lambda e: (_tie_rank(tie_key, e.worker_id), e.worker_id))
