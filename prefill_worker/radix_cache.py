"""Shadow radix cache of the prefill worker (seed 000 "Shadow Radix Cache", ARCHITECTURE.md §4).

A radix tree over token ids at page granularity (`page_size` tokens per page): node keys are runs
of whole pages, matching and insertion stop at page boundaries, a trailing partial page is never
cached. Each cached page has a `PageRecord`: its page ids in the compressed pools (`full`, opaque
here) and its SWA page id (`swa`, None once tombstoned). A node end may hold an opaque compress-
state snapshot (`state`) taken by the worker at that boundary.

The SWA pool is much scarcer than the compressed pools, so SWA is evicted separately: evicting an
internal node's SWA leaves a *tombstone* that keeps its full KV and the tree structure. A prefix is
resumable at boundary b ("safe match point") only if b has a state snapshot and the SWA pages of
the last `sliding_window` tokens before b are live (or all of [0, b) is live when b < window).

Invariants (checked by `check_invariants`):
  * full_lock_ref >= swa_lock_ref; a tombstone has swa_lock_ref == 0 and no state;
  * a leaf is never a tombstone (deleting a leaf deletes the tombstoned parents it exposes);
  * full LRU holds every node but the root, SWA LRU exactly the live (non-tombstone) ones;
  * every page id and state handle handed to the cache leaves it once, through a free callback.

Ownership: `insert` takes ownership of every page and state handle it is given, except pages it
recognises as its own (same `full` ids as the cached page at that position: the request got them
from `match_prefix`); whatever it does not keep it frees at once through the callbacks.
KV events advertise *live* pages only (see docs/prefix_cache.md): a page is "stored" when it enters
the tree with live SWA or is revived, "evicted" when its SWA is tombstoned or the node is deleted.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from worker_runtime.wire import KVEvent, page_hashes


@dataclass(frozen=True)
class PageRecord:
    """One cached token page: ids in the compressed pools (opaque) and the SWA page id."""

    full: tuple[int, ...]
    swa: int | None  # None: SWA released (request-side trim or cache tombstone)


class Node:
    """A run of whole pages. Children are keyed by the tokens of their first page."""

    __slots__ = ("parent", "children", "key", "value", "hashes", "state", "swa_tombstone",
                 "full_lock_ref", "swa_lock_ref", "swa_uuid", "last_access", "serial")

    def __init__(self, parent: Node | None, key: tuple[int, ...], value: list[PageRecord],
                 hashes: list[int], tombstone: bool = False, state: object | None = None):
        self.parent = parent  # None for the root and for deleted nodes
        self.children: dict[tuple[int, ...], Node] = {}
        self.key, self.value, self.hashes = key, value, hashes  # len(value) == len(hashes) pages
        self.state = state  # compress-state snapshot at this node's end, or None
        self.swa_tombstone = tombstone
        self.full_lock_ref = self.swa_lock_ref = 0
        self.swa_uuid: int | None = None  # marks the top of a SWA lock (see RadixCache.lock)
        self.last_access = 0
        self.serial = 0

    def __len__(self) -> int:
        return len(self.value)

    def __bool__(self) -> bool:  # the root has no pages but is still a node
        return True


@dataclass(frozen=True)
class MatchResult:
    num_tokens: int  # usable prefix: a safe match point (multiple of page_size)
    pages: list[PageRecord]  # one per page of the usable prefix (tombstoned pages: swa=None)
    state: object | None  # snapshot at num_tokens (None iff num_tokens == 0); cache-owned
    last_node: Node  # node ending at num_tokens (the root when 0): what to lock
    tree_tokens: int  # how far the tree matches regardless of safety (>= num_tokens)


@dataclass(frozen=True)
class InsertResult:
    node: Node  # deepest node on the inserted path
    num_new_pages: int  # request pages adopted as new tree entries
    num_duplicate_pages: int  # request pages already cached: freed through the callbacks


@dataclass
class CacheLock:
    node: Node
    swa_uuid: int | None
    released: bool = False


class RadixCache:
    def __init__(self, page_size: int, sliding_window: int, worker_id: str, *,
                 free_full: Callable[[list[PageRecord]], None],
                 free_swa: Callable[[list[int]], None],
                 free_state: Callable[[object], None],
                 on_event: Callable[[KVEvent], None] | None = None):
        """`free_full(records)` releases the `full` ids of each record (only those),
        `free_swa(ids)` SWA pages, `free_state(handle)` one snapshot; `on_event` gets KV events."""
        if page_size <= 0 or sliding_window <= 0:
            raise ValueError("page_size and sliding_window must be positive")
        self.page_size, self.window, self.worker_id = page_size, sliding_window, worker_id
        self._free_full, self._free_swa, self._free_state = free_full, free_swa, free_state
        self._on_event = on_event
        self.root = Node(None, (), [], [])
        self._full_lru: OrderedDict[Node, None] = OrderedDict()  # oldest first, all but root
        self._swa_lru: OrderedDict[Node, None] = OrderedDict()  # oldest first, live nodes only
        self._clock = itertools.count(1)
        self._uuids = itertools.count(1)
        # page counters, kept exact by the few primitives that change them
        self._pages = self._live = self._evictable_full = self._evictable_swa = 0

    # --- accounting ---------------------------------------------------------------------------
    def num_cached_pages(self) -> int:
        """Token pages in the tree (each holds one page of every compressed pool)."""
        return self._pages

    def num_swa_pages(self) -> int:
        """Token pages in the tree whose SWA page is live."""
        return self._live

    def evictable_full_pages(self) -> int:
        """Pages `evict_full` could free (unlocked nodes; their subtrees are unlocked too)."""
        return self._evictable_full

    def evictable_swa_pages(self) -> int:
        """SWA pages `evict_swa` could free (live nodes without a SWA lock)."""
        return self._evictable_swa

    def protected_full_pages(self) -> int:
        return self._pages - self._evictable_full

    def protected_swa_pages(self) -> int:
        return self._live - self._evictable_swa

    # --- match ----------------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Longest safe match point of `tokens`; refreshes the LRU position of its path."""
        P = self.page_size
        toks = tuple(tokens[:len(tokens) // P * P])
        node, pos, live = self.root, 0, 0  # live: consecutive live-SWA tokens ending at pos
        path: list[Node] = []
        best = 0  # length of the path prefix ending at the deepest safe node
        tree_pages = 0
        while pos * P < len(toks):
            child = node.children.get(toks[pos * P:(pos + 1) * P])
            if child is None:
                break
            m = self._common_pages(child, toks, pos)
            tree_pages = pos + m
            if m < len(child):
                break  # safe points are node ends (states live there): none inside this node
            node, pos = child, pos + m
            path.append(node)
            live = 0 if node.swa_tombstone else live + m * P
            if node.state is not None and live >= min(self.window, pos * P):
                best = len(path)
        path = path[:best]
        for x in path:  # root side first: deeper nodes end up more recent in both lists
            self._touch(x)
        last = path[-1] if path else self.root
        pages = [r for x in path for r in x.value]
        return MatchResult(len(pages) * P, pages, last.state, last, tree_pages * P)

    # --- locks ----------------------------------------------------------------------------------
    def lock(self, node: Node) -> CacheLock:
        """Protect `node`'s path while a request uses it: full lock to the root, SWA lock only on
        the nodes covering the last `sliding_window` tokens (older SWA may still be tombstoned).
        The topmost SWA-locked node carries `swa_uuid` so `unlock` knows where to stop even if
        nodes were split meanwhile (a split moves the uuid to the new upper node)."""
        if node is not self.root and (node.parent is None or node.swa_tombstone):
            raise ValueError("can only lock a live node of the tree")
        x, covered, top, swa_open = node, 0, None, True
        while x is not self.root:
            if x.full_lock_ref == 0:
                self._evictable_full -= len(x)
            x.full_lock_ref += 1
            swa_open = swa_open and covered < self.window and not x.swa_tombstone
            if swa_open:  # contiguous run from `node` up: never a tombstone, never past one
                if x.swa_lock_ref == 0:
                    self._evictable_swa -= len(x)
                x.swa_lock_ref += 1
                covered += len(x) * self.page_size
                top = x
            x = x.parent
        if top is None:
            return CacheLock(node, None)
        if top.swa_uuid is None:
            top.swa_uuid = next(self._uuids)
        return CacheLock(node, top.swa_uuid)

    def unlock(self, lock: CacheLock) -> None:
        if lock.released:
            raise ValueError("lock released twice")
        lock.released = True
        x, swa_open = lock.node, lock.swa_uuid is not None
        while x is not self.root:
            x.full_lock_ref -= 1
            if x.full_lock_ref == 0:
                self._evictable_full += len(x)
            if swa_open:
                x.swa_lock_ref -= 1
                if x.swa_lock_ref == 0:
                    self._evictable_swa += len(x)
                swa_open = x.swa_uuid != lock.swa_uuid
            x = x.parent

    # --- insert ---------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], records: Sequence[PageRecord], state_at_end: object | None = None,
               swa_evicted_upto: int | None = None, *, extra_states: Mapping[int, object] | None = None) -> InsertResult:
        """Cache a finished request's pages: `records[i]` covers tokens [i·P, (i+1)·P).

        The request's SWA liveness is per page (`swa=None`: released by the request); the seed's
        `swa_evicted_upto` is the special case where the released pages form a prefix, and is
        only checked against the records. Over a cached tombstoned node the seed's three branches
        follow: request SWA live over the whole node → revive (1); over a suffix → split, the
        first part stays tombstoned, the rest revives (2); not at all → free the duplicates (3).
        `state_at_end` is the snapshot at len(records)·P, `extra_states` maps other page
        boundaries (tokens) to snapshots (e.g. at `MatchResult.tree_tokens`, where a request
        diverged from a cached prefix). The cache owns everything passed from here on."""
        P, n = self.page_size, len(records)
        if n * P > len(tokens):
            raise ValueError(f"{n} pages need {n * P} tokens, got {len(tokens)}")
        toks = tuple(tokens[:n * P])
        states = {b // P: h for b, h in (extra_states or {}).items()}
        if any(b % P or not 0 < b < n * P for b in (extra_states or {})):
            raise ValueError("extra state boundaries must be page multiples inside the sequence")
        if state_at_end is not None:
            states[n] = state_at_end
        k = self._shared_pages(toks, records)
        if swa_evicted_upto is not None and (swa_evicted_upto % P or any(
                r.swa is not None for r in records[k:swa_evicted_upto // P])):
            raise ValueError("swa_evicted_upto disagrees with the records' SWA ids")
        live = [r.swa is not None for r in records]
        hashes = page_hashes(toks, P)
        dup_full: list[PageRecord] = []
        dup_swa: list[int] = []
        path: list[Node] = []
        node, i = self.root, 0
        while i < n and (child := node.children.get(toks[i * P:(i + 1) * P])) is not None:
            m = self._common_pages(child, toks, i)
            if m < len(child):
                child = self._split(child, m)
            end = i + m
            while True:  # cut the node where sharing, SWA liveness or a state boundary changes
                cut = next((c for c in range(i + 1, end) if c == k or c in states or (
                    child.swa_tombstone and c > k and live[c] != live[c - 1])), end)
                seg = self._split(child, cut - i) if cut < end else child
                if i >= k:  # the request's own copy of pages the tree already has
                    dup_full += records[i:cut]
                    if not seg.swa_tombstone:
                        dup_swa += [r.swa for r in records[i:cut] if r.swa is not None]
                    elif live[i]:  # branch 1 (whole node) or 2 (after a split): revive
                        self._revive(seg, [r.swa for r in records[i:cut]])
                    # else branch 3: the request's SWA is gone too, only full was duplicated
                self._attach_state(seg, states.pop(cut, None))
                path.append(seg)
                i = cut
                if seg is child:
                    break
            node = child
        num_dups, num_new = len(dup_full), 0
        # new pages: tombstoned runs are kept only under a live page (leaves are never tombstones)
        last_live = max((j for j in range(i, n) if live[j]), default=i - 1)
        while i <= last_live:
            cut = next((c for c in range(i + 1, last_live + 1) if c in states or live[c] != live[i]), last_live + 1)
            node = self._add_node(node, toks[i * P:cut * P], list(records[i:cut]), hashes[i:cut], not live[i])
            self._attach_state(node, states.pop(cut, None))
            path.append(node)
            num_new += cut - i
            i = cut
        dup_full += records[i:]  # trailing pages without live SWA: not cacheable
        for x in path:
            self._touch(x)
        if dup_full:
            self._free_full(dup_full)
        if dup_swa:
            self._free_swa(dup_swa)
        for h in states.values():  # snapshots at boundaries that are not kept
            self._free_state(h)
        return InsertResult(path[-1] if path else self.root, num_new, num_dups)

    # --- eviction -------------------------------------------------------------------------------
    def evict_full(self, n_pages: int) -> int:
        """Free at least `n_pages` token pages (all pools) from unlocked leaves in full-LRU order;
        tombstoned parents left as leaves go with them. Returns the pages freed."""
        heap = [(x.last_access, x.serial, x) for x in self._full_lru
                if not x.children and x.full_lock_ref == 0]
        heapq.heapify(heap)  # nearly sorted already; split nodes keep their lower part's time
        freed = 0
        while freed < n_pages and heap:
            x = heapq.heappop(heap)[2]
            if x.parent is None or x.children or x.full_lock_ref:
                continue
            n, parent = self._delete_cascade(x)
            freed += n
            if parent is not self.root and not parent.children and parent.full_lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.serial, parent))
        return freed

    def evict_swa(self, n_pages: int) -> int:
        """Free at least `n_pages` SWA pages in SWA-LRU order: an internal node becomes a
        tombstone (full KV and structure stay), a leaf is deleted. Returns SWA pages freed."""
        freed = 0
        for x in list(self._swa_lru):
            if freed >= n_pages:
                break
            if x.parent is None or x.swa_tombstone or x.swa_lock_ref:
                continue
            freed += len(x)
            if x.children:
                self._tombstone(x)
            else:
                assert x.full_lock_ref == 0, "a full-locked leaf is always SWA-locked"
                self._delete_cascade(x)
        return freed

    # --- primitives (the only places that change counters, LRU lists and events) --------------
    def _common_pages(self, node: Node, toks: tuple[int, ...], pos: int) -> int:
        P, m = self.page_size, 1  # the first page matched through the children dict
        while m < len(node) and (pos + m + 1) * P <= len(toks) and \
                node.key[m * P:(m + 1) * P] == toks[(pos + m) * P:(pos + m + 1) * P]:
            m += 1
        return m

    def _shared_pages(self, toks: tuple[int, ...], records: Sequence[PageRecord]) -> int:
        """Leading pages whose `full` ids are the tree's own (handed out by match_prefix).
        A later page with the tree's ids would be freed as a duplicate: refuse it."""
        node, i, k, P = self.root, 0, None, self.page_size
        while i < len(records) and (child := node.children.get(toks[i * P:(i + 1) * P])) is not None:
            for j in range(self._common_pages(child, toks, i)):
                same = child.value[j].full == records[i].full
                if k is None and not same:
                    k = i
                elif k is not None and same:
                    raise ValueError(f"page {i} holds the cache's own ids but page {k} does not")
                i += 1
            node = child
        return i if k is None else k

    def _touch(self, x: Node) -> None:
        x.last_access = next(self._clock)
        self._full_lru.move_to_end(x)
        if not x.swa_tombstone:
            self._swa_lru.move_to_end(x)

    def _split(self, node: Node, m: int) -> Node:
        """Cut `node` after its first m pages; returns the new upper node (locks copied, the SWA
        lock boundary moves up, the state stays at the lower node's end)."""
        P = self.page_size
        upper = Node(node.parent, node.key[:m * P], node.value[:m], node.hashes[:m], node.swa_tombstone)
        upper.full_lock_ref, upper.swa_lock_ref = node.full_lock_ref, node.swa_lock_ref
        upper.swa_uuid, node.swa_uuid = node.swa_uuid, None
        upper.last_access, upper.serial = node.last_access, next(self._clock)
        node.parent.children[upper.key[:P]] = upper
        node.key, node.value, node.hashes = node.key[m * P:], node.value[m:], node.hashes[m:]
        node.parent = upper
        upper.children[node.key[:P]] = node
        self._full_lru[upper] = None
        if not upper.swa_tombstone:
            self._swa_lru[upper] = None
        return upper

    def _add_node(self, parent: Node, key: tuple[int, ...], value: list[PageRecord],
                  hashes: list[int], tombstone: bool) -> Node:
        x = Node(parent, key, value, hashes, tombstone)
        x.serial = next(self._clock)
        parent.children[key[:self.page_size]] = x
        self._full_lru[x] = None
        self._pages += len(x)
        self._evictable_full += len(x)
        if not tombstone:
            self._swa_lru[x] = None
            self._live += len(x)
            self._evictable_swa += len(x)
            self._emit("stored", x.hashes)
        return x

    def _attach_state(self, x: Node, handle: object | None) -> None:
        if handle is None:
            return
        if x.state is None and not x.swa_tombstone:
            x.state = handle
        else:  # a duplicate, or useless at a tombstone (never a safe point)
            self._free_state(handle)

    def _revive(self, x: Node, swa_ids: list[int]) -> None:
        x.value = [PageRecord(r.full, s) for r, s in zip(x.value, swa_ids)]
        x.swa_tombstone = False
        self._swa_lru[x] = None
        self._live += len(x)
        self._evictable_swa += len(x)
        self._emit("stored", x.hashes)

    def _tombstone(self, x: Node) -> None:
        self._free_swa([r.swa for r in x.value])
        if x.state is not None:  # its window is dead now: never a safe point again
            self._free_state(x.state)
            x.state = None
        x.value = [PageRecord(r.full, None) for r in x.value]
        x.swa_tombstone = True
        del self._swa_lru[x]
        self._live -= len(x)
        self._evictable_swa -= len(x)
        self._emit("evicted", x.hashes)

    def _delete_cascade(self, x: Node) -> tuple[int, Node]:
        """Delete unlocked leaf `x`, then every tombstoned ancestor that became a leaf.
        Returns (token pages freed, first surviving ancestor)."""
        freed = 0
        while True:
            parent = x.parent
            self._free_full(x.value)
            if not x.swa_tombstone:
                self._free_swa([r.swa for r in x.value])
                self._emit("evicted", x.hashes)
                del self._swa_lru[x]
                self._live -= len(x)
                self._evictable_swa -= len(x)
            if x.state is not None:
                self._free_state(x.state)
            del parent.children[x.key[:self.page_size]]
            del self._full_lru[x]
            self._pages -= len(x)
            self._evictable_full -= len(x)
            freed += len(x)
            x.parent = None
            x = parent
            if x is self.root or x.children or not x.swa_tombstone or x.full_lock_ref:
                return freed, x

    def _emit(self, kind: str, hashes: list[int]) -> None:
        if self._on_event is not None and hashes:
            self._on_event(KVEvent(self.worker_id, kind, tuple(hashes)))

    # --- debugging --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Recompute everything from the tree and compare (tests; O(tree))."""
        P, count = self.page_size, {"pages": 0, "live": 0, "ef": 0, "es": 0}
        seen: list[Node] = []
        stack: list[tuple[Node, tuple[int, ...], list[int]]] = [(self.root, (), [])]
        while stack:
            node, prefix, hashes = stack.pop()
            if not node.children:  # chained hashes: one check per leaf covers its whole path
                assert hashes == page_hashes(prefix, P)
            for first, c in node.children.items():
                seen.append(c)
                pre = prefix + c.key
                assert c.parent is node and c.key[:P] == first and len(c.key) == len(c) * P > 0
                assert len(c.hashes) == len(c.value) == len(c)
                assert c.full_lock_ref >= c.swa_lock_ref >= 0
                assert node is self.root or node.full_lock_ref >= c.full_lock_ref
                assert c.children or not c.swa_tombstone, "tombstoned leaf"
                if c.swa_tombstone:
                    assert c.swa_lock_ref == 0 and c.state is None and all(r.swa is None for r in c.value)
                else:
                    assert all(r.swa is not None for r in c.value)
                count["pages"] += len(c)
                count["live"] += 0 if c.swa_tombstone else len(c)
                count["ef"] += len(c) if c.full_lock_ref == 0 else 0
                count["es"] += len(c) if c.swa_lock_ref == 0 and not c.swa_tombstone else 0
                stack.append((c, pre, hashes + c.hashes))
        assert set(self._full_lru) == set(seen) and len(self._full_lru) == len(seen)
        assert set(self._swa_lru) == {x for x in seen if not x.swa_tombstone}
        assert (self._pages, self._live, self._evictable_full, self._evictable_swa) == \
            (count["pages"], count["live"], count["ef"], count["es"])
