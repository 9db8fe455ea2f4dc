"""What every scorer sees: the request's placement facts and the endpoints' reported loads.

Endpoints are `worker_runtime.wire.WorkerLoad`s as the workers report them; the prefix-cache view
(`cached_pages`) comes from `router.prefix_index.PrefixIndex.match`. A scorer returns one score in
[0, 1] per endpoint, higher is better, and never looks at anything else (no clocks, no I/O).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from worker_runtime.wire import WorkerLoad


@dataclass(frozen=True)
class PlacementRequest:
    prompt_tokens: int
    max_tokens: int = 0
    page_size: int = 256
    cached_pages: Mapping[str, int] = field(default_factory=dict)  # prefill worker → leading pages held

    def cached_tokens(self, worker_id: str) -> int:
        return min(self.cached_pages.get(worker_id, 0) * self.page_size, self.prompt_tokens)

    @property
    def pages_needed(self) -> int:
        """KV pages (full-attention granularity) the request occupies on its decode worker at most."""
        return -(-(self.prompt_tokens + self.max_tokens) // self.page_size)


Scorer = Callable[[PlacementRequest, Sequence[WorkerLoad]], list[float]]
