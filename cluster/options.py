"""Frozen options of a worker replica, built once by the launcher and passed to each actor."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerOptions:
    model_dir: str
    registry_url: str
    cluster: str = "default"
    kv_dtype: str = "fp32"  # same default as `v4serve generate`, so the two agree token for token
    page_size: int = 256
    max_tokens: int = 4096  # longest request (prompt + completion) a replica accepts
    max_seqs: int = 16  # concurrent requests per replica (pool sizing)
    threads: int = 1  # torch intra-op threads per replica
    prefill_token_budget: int = 1024
    lease_s: float = 30.0  # how long a decode reservation waits for its KV
    prefix_cache: bool = True  # prefill workers keep finished prompts' pages for reuse
    heartbeat_s: float = 1.0
