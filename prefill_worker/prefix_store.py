"""The prefill worker's prefix cache over its pools: the radix cache holds page ids, this module
moves the pages and keeps their reference counts exact.

* `admit(prompt)`: longest resumable cached prefix → a request `SeqKV` whose first pages are the
  cached ones (the request takes its own reference on each), with the compress-state snapshot at
  the match point copied into the request's state slot. At least one prompt token is always left
  to compute: its logits sample the first token.
* `snapshot(seq)`: copy of the ratio-4 compress-state slots at a page boundary (the ratio-128 ring
  holds nothing a 128-aligned boundary needs), and of the MTP slot (the main streams at the
  boundary's last token, which the MTP layer's next position pairs with). Taken where the request may later be matched:
  the prompt's last page boundary, and where it diverged from the tree (`tree_tokens`).
* `finish(...)`: insert the prompt's full pages into the tree. The tree takes over the request's
  references to new pages; for pages it already had, the request drops its own.
* `make_room(need)`: evict (SWA first: it keeps the compressed KV) until an allocation fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.kv_pool import KVPools, PoolExhausted, SeqKV
from prefill_worker.radix_cache import CacheLock, PageRecord, RadixCache
from worker_runtime.wire import KVEvent

SNAPSHOT_KINDS = ("state_c4", "state_c4_indexer", "state_mtp")
FULL_KINDS = ("c4", "c128", "c4_indexer")


@dataclass
class Reuse:
    """What a request got from the cache and what it must give back."""

    cached_tokens: int
    lock: CacheLock | None
    snapshot_points: tuple[int, ...]  # page boundaries (tokens) where to snapshot the state
    snapshots: dict[int, dict[str, int]] = field(default_factory=dict)  # boundary → kind → page


class PrefixStore:
    def __init__(self, pools: KVPools, worker_id: str):
        self.pools = pools
        self.full_kinds = tuple(k for k in FULL_KINDS if k in pools.kinds_for())
        self.snapshot_kinds = tuple(k for k in SNAPSHOT_KINDS if k in pools.kinds_for())
        self.events: list[KVEvent] = []  # drained by the worker, published to the registry
        self.cache = RadixCache(pools.page_size, pools.cfg.sliding_window, worker_id,
                                free_full=self._free_full, free_swa=lambda ids: pools.free("swa", list(ids)),
                                free_state=self._free_snapshot, on_event=self.events.append)

    # --- callbacks from the tree ----------------------------------------------------------
    def _free_full(self, records) -> None:
        for r in records:
            for kind, page in zip(self.full_kinds, r.full):
                self.pools.free(kind, [page])

    def _free_snapshot(self, handle: dict[str, int]) -> None:
        for kind, page in handle.items():
            self.pools.free(kind, [page])

    # --- request lifecycle ----------------------------------------------------------------
    def admit(self, prompt: tuple[int, ...], match: bool = True) -> tuple[SeqKV, Reuse]:
        """A SeqKV holding the longest reusable prefix (and pages for the rest of the prompt);
        `match=False`: nothing reused, the whole prompt is computed (its pages still enter the
        cache when it finishes)."""
        P = self.pools.page_size
        m = self.cache.match_prefix(prompt[:-1] if match else ())
        seq = SeqKV(num_tokens=m.num_tokens)
        for i, record in enumerate(m.pages):
            for kind, page in zip(self.full_kinds, record.full):
                seq.pages[kind].append(page)
            seq.pages["swa"].append(-1 if record.swa is None else record.swa)
        for kind in self.full_kinds + ("swa",):
            self.pools.allocators[kind].incref([p for p in seq.pages[kind] if p >= 0])
        lock = self.cache.lock(m.last_node) if m.num_tokens else None
        try:
            self._reserve(seq, len(prompt))
        except PoolExhausted:
            self.pools.release(seq)
            if lock is not None:
                self.cache.unlock(lock)
            raise
        if m.state is not None:
            for kind, page in m.state.items():
                self.pools.buffers[kind][seq.pages[kind][0]] = self.pools.buffers[kind][page]
        end = len(prompt) // P * P
        points = {end} if end > m.num_tokens else set()
        diverged = m.tree_tokens // P * P
        if m.num_tokens < diverged < end:
            points.add(diverged)
        return seq, Reuse(m.num_tokens, lock, tuple(sorted(points)))

    def _reserve(self, seq: SeqKV, total_tokens: int) -> None:
        need = self.pools.pages_needed(seq, total_tokens)
        self.make_room(need)
        self.pools.reserve(seq, total_tokens)

    def make_room(self, need: dict[str, int]) -> None:
        """Evict cached pages until `need` (kind → pages) fits; stops when nothing more can go."""
        def short() -> int:
            return max((n - self.pools.num_free(k) for k, n in need.items()), default=0)
        if short() > 0 and need.get("swa", 0) > self.pools.num_free("swa"):
            self.cache.evict_swa(need["swa"] - self.pools.num_free("swa"))
        while short() > 0 and self.cache.evict_full(short()) > 0:
            pass

    def snapshot(self, seq: SeqKV, reuse: Reuse) -> None:
        """Copy the request's ratio-4 state slots now (its tokens end at a snapshot point)."""
        self.make_room({k: 1 for k in self.snapshot_kinds})
        handle = {}
        try:
            for kind in self.snapshot_kinds:
                page = self.pools.alloc(kind, 1)[0]
                handle[kind] = page
                self.pools.buffers[kind][page] = self.pools.buffers[kind][seq.pages[kind][0]]
        except PoolExhausted:  # no room to snapshot: this boundary simply won't be cached
            self._free_snapshot(handle)
            return
        reuse.snapshots[seq.num_tokens] = handle

    def pinned(self, reuse: Reuse) -> frozenset[int]:
        """SWA page indices to keep: those covering the window before each snapshot point."""
        P, W = self.pools.page_size, self.pools.cfg.sliding_window
        return frozenset(i for b in reuse.snapshot_points for i in range(max(0, b - W) // P, b // P))

    def finish(self, prompt: tuple[int, ...], seq: SeqKV, reuse: Reuse) -> None:
        """Insert the prompt's full pages (up to the last snapshot taken), then release the rest."""
        P = self.pools.page_size
        end = max(reuse.snapshots, default=0)
        n = end // P
        if n > reuse.cached_tokens // P:
            records = [PageRecord(tuple(seq.pages[k][i] for k in self.full_kinds),
                                  None if seq.pages["swa"][i] < 0 else seq.pages["swa"][i]) for i in range(n)]
            extra = {b: h for b, h in reuse.snapshots.items() if b != end}
            self.cache.insert(prompt[:end], records, reuse.snapshots[end], extra_states=extra)
            kept = reuse.cached_tokens // P
            # new pages [kept, n) now belong to the tree; the request keeps its own reference only
            # on the matched pages [0, kept), which it drops below with everything else it holds
            for kind in self.full_kinds + ("swa",):
                seq.pages[kind][kept:n] = [-1] * (n - kept)
        else:
            for handle in reuse.snapshots.values():
                self._free_snapshot(handle)
        self.pools.release(seq)
        if reuse.lock is not None:
            self.cache.unlock(reuse.lock)
