"""Which prefill worker holds which KV pages, by chained page hash — the router's view of the
prefill workers' prefix caches, kept in step by their `KVEvent`s.

Page hashes are chained (`worker_runtime.wire.page_hashes`: hash i covers tokens [0, (i+1)·P)), so
holding hash i alone proves the worker holds the prompt's first i+1 pages. Workers announce a page
as `stored` only where a request can resume at its end (page boundary, live SWA window) and as
`evicted` when it no longer can, so they announce resume points, not every page: a worker's usable
prefix for a prompt is its deepest announced page of the prompt's chain, whatever it announced
before it (a 609-token prompt with 256-token pages is typically announced at page 1 only).

Pure state, no I/O: the cluster side subscribes to the KV-event stream (Redis) and calls
`apply`; every router replica fed the same stream agrees on the index.
"""

from __future__ import annotations

from typing import Sequence

from worker_runtime.wire import KVEvent, page_hashes


class PrefixIndex:
    def __init__(self, page_size: int = 256):
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page_size = page_size
        self._pages: dict[str, set[int]] = {}  # worker → hashes it holds
        self._holders: dict[int, set[str]] = {}  # hash → workers holding it

    # --- updates
    def apply(self, event: KVEvent) -> None:
        if event.kind == "stored":
            self._store(event.worker_id, event.page_hashes)
        elif event.kind == "evicted":
            self._evict(event.worker_id, event.page_hashes)
        elif event.kind == "cleared":
            self.remove_worker(event.worker_id)
        else:
            raise ValueError(f"unknown KV event kind {event.kind!r}")

    def remove_worker(self, worker_id: str) -> None:
        """Forget everything a worker held (it died, drained, or cleared its cache)."""
        self._evict(worker_id, tuple(self._pages.pop(worker_id, ())))

    def _store(self, worker: str, hashes: Sequence[int]) -> None:
        pages = self._pages.setdefault(worker, set())
        for h in hashes:
            pages.add(h)
            self._holders.setdefault(h, set()).add(worker)

    def _evict(self, worker: str, hashes: Sequence[int]) -> None:
        pages = self._pages.get(worker)
        for h in hashes:
            if pages is not None:
                pages.discard(h)
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[h]
        if pages is not None and not pages:
            del self._pages[worker]

    # --- queries
    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """worker → number of leading pages of `hashes` it can resume after: its deepest announced
        page of the chain, plus one (workers with none are absent)."""
        counts: dict[str, int] = {}
        for depth in range(len(hashes) - 1, -1, -1):  # deepest first: the first hit is the match
            for w in self._holders.get(hashes[depth], ()):
                counts.setdefault(w, depth + 1)
        return counts

    def match_tokens(self, token_ids: Sequence[int]) -> dict[str, int]:
        return self.match(page_hashes(list(token_ids), self.page_size))

    def workers(self) -> list[str]:
        return sorted(self._pages)

    def pages(self, worker_id: str) -> int:
        return len(self._pages.get(worker_id, ()))
