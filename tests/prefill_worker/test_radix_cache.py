"""Shadow radix cache: seed scenarios (tombstone matches, the three insert branches), both eviction
paths, locks, LRU order, KV events, and a randomized run against a reference with exact page
accounting (every id handed to the cache comes back once through the free callbacks)."""

import itertools
import random

import pytest

from prefill_worker.radix_cache import PageRecord, RadixCache
from worker_runtime.wire import page_hashes


class Harness:
    """A cache plus the bookkeeping of a worker: page ids it hands over and ids freed back."""

    def __init__(self, page_size: int, window: int):
        self.P, self.W = page_size, window
        self.ids = itertools.count(1)
        self.handed: set = set()  # ("full"|"swa"|"state", id) given to the cache
        self.freed: list = []
        self.events: list = []
        self.cache = RadixCache(page_size, window, "p0", free_full=self._free_full,
                                free_swa=lambda ids: self._free("swa", ids),
                                free_state=lambda h: self._free("state", [h]), on_event=self.events.append)

    def _free_full(self, records):
        self._free("full", [r.full[0] for r in records])

    def _free(self, kind, ids):
        for i in ids:
            key = (kind, i)
            assert key in self.handed, f"{key} freed but never handed to the cache"
            assert key not in self.freed, f"{key} freed twice"
            self.freed.append(key)

    def new_records(self, n, dead=()):
        """n fresh pages; pages in `dead` had their SWA released by the request."""
        return [PageRecord((next(self.ids), next(self.ids)), None if j in dead else next(self.ids))
                for j in range(n)]

    def state(self):
        return next(self.ids)

    def insert(self, tokens, records, state=None, upto=None, extra=None):
        for r in records:
            self.handed.add(("full", r.full[0]))
            if r.swa is not None:
                self.handed.add(("swa", r.swa))
        for h in [state, *(extra or {}).values()]:
            if h is not None:
                self.handed.add(("state", h))
        res = self.cache.insert(tokens, records, state, upto, extra_states=extra)
        self.cache.check_invariants()
        return res

    def freed_of(self, kind):
        return sorted(i for k, i in self.freed if k == kind)


def chain(h: Harness, scale: int = 1):
    """The seed's chain A=[0,1] B=[2,3] C=[4,5] (tokens × scale), states at every node end, then
    A's SWA evicted (oldest SWA-LRU entry, internal node → tombstone)."""
    toks = list(range(6 * scale))
    recs = h.new_records(6 * scale // h.P)
    h.insert(toks, recs, h.state(), extra={2 * scale: h.state(), 4 * scale: h.state()})
    return toks, recs


# --- match: the seed's tombstone scenarios ------------------------------------------------------
@pytest.mark.parametrize("page_size,scale", [(1, 1), (4, 4), (2, 4)])
@pytest.mark.parametrize("tombstone,query,expected", [
    (True, 6, 6),    # A dead, B+C = window live tokens → safe at C
    (True, 4, 0),    # only B live: less than a window → void back to the root
    (True, 5, 0),    # C only partially matched: the last safe point is still none
    (True, 2, 0),    # A itself is dead
    (False, 4, 4),   # no tombstone: a short prefix is live from the start → safe
    (False, 5, 4),   # falls back to the last node end with a state
    (False, 2, 2),
])
def test_seed_tombstone_match(page_size, scale, tombstone, query, expected):
    h = Harness(page_size, 4 * scale)
    toks, recs = chain(h, scale)
    if tombstone:
        assert h.cache.evict_swa(1) == 2 * scale // page_size  # A: oldest, internal
        h.cache.check_invariants()
    m = h.cache.match_prefix(toks[:query * scale] + [999])
    assert m.num_tokens == expected * scale
    assert m.tree_tokens == query * scale // page_size * page_size
    assert [r.full for r in m.pages] == [r.full for r in recs[:expected * scale // page_size]]
    assert (m.state is None) == (expected == 0)
    dead = 2 * scale // page_size if tombstone else 0
    assert all(r.swa is None for r in m.pages[:dead]) and all(r.swa is not None for r in m.pages[dead:])


def test_window_smaller_than_a_page():
    h = Harness(4, 4)
    toks = list(range(12))
    h.insert(toks, h.new_records(3), h.state(), extra={8: h.state()})
    h.cache.evict_swa(1)  # pages 0-1 tombstoned; page 2 alone covers the window
    assert h.cache.match_prefix(toks).num_tokens == 12
    assert h.cache.match_prefix(toks[:8]).num_tokens == 0


def test_boundary_without_state_is_not_a_match_point():
    h = Harness(4, 8)
    toks = list(range(16))
    h.insert(toks, h.new_records(4), h.state(), extra={4: h.state()})
    m = h.cache.match_prefix(toks[:12] + [0, 0, 0, 0])  # diverges after page 3: no state there
    assert (m.num_tokens, m.tree_tokens) == (4, 12)


# --- insert: the seed's three branches -----------------------------------------------------------
def tombstoned_q(h: Harness):
    """Node Q=[0,1,2,3] (internal, tombstoned) above X=[10..13]."""
    toks = [0, 1, 2, 3, 10, 11, 12, 13]
    recs = h.new_records(8)
    h.insert(toks, recs, h.state(), extra={4: h.state()})
    assert h.cache.evict_swa(1) == 4
    h.events.clear()
    return recs


@pytest.mark.parametrize("upto,tombstoned_pages,revived,new_pages", [
    (0, [], [0, 1, 2, 3], 4),            # branch 1: all SWA restorable: Q revives
    (2, [0, 1], [2, 3], 4),              # branch 2: Q split, [0,1] stays dead, [2,3] revives
    (8, [0, 1, 2, 3], [], 0),            # branch 3: nothing restorable: free the duplicates
])
def test_insert_branches(upto, tombstoned_pages, revived, new_pages):
    h = Harness(1, 4)
    old = tombstoned_q(h)
    toks = list(range(8))
    recs = h.new_records(8, dead=range(upto))
    end = h.state()
    res = h.insert(toks, recs, end, upto=upto)
    assert (res.num_duplicate_pages, res.num_new_pages) == (4, new_pages)
    m = h.cache.match_prefix(toks)
    assert m.tree_tokens == (8 if new_pages else 4)
    # Q keeps the cache's original full KV; the request's duplicates went back
    node_pages = [r for x in _path(h.cache, toks) for r in x.value]
    assert [r.full for r in node_pages[:4]] == [r.full for r in old[:4]]
    assert [j for j in range(4) if node_pages[j].swa is None] == tombstoned_pages
    assert [node_pages[j].swa for j in revived] == [recs[j].swa for j in revived]
    if revived:  # the revived pages are advertised again
        assert h.events[0].kind == "stored" and h.events[0].page_hashes == tuple(page_hashes(toks, 1)[revived[0]:4])
    if new_pages:
        assert h.freed_of("full") == sorted(r.full[0] for r in recs[:4]) and ("state", end) not in h.freed
        assert m.num_tokens == 8 and [r.swa for r in m.pages[4:]] == [r.swa for r in recs[4:]]
        assert h.events[-1].page_hashes == tuple(page_hashes(toks, 1)[4:])
    else:  # the trailing pages had no live SWA: not cacheable, freed with the end state
        assert h.freed_of("full") == sorted(r.full[0] for r in recs) and ("state", end) in h.freed
        assert m.num_tokens == 0 and h.events == []


def _path(cache, toks):
    node, out, i = cache.root, [], 0
    while i < len(toks) and (child := node.children.get(tuple(toks[i:i + cache.page_size]))):
        out.append(child)
        i += len(child.key)
        node = child
    return out


def test_duplicate_insert_frees_the_copy_and_shared_pages_are_kept():
    h = Harness(4, 8)
    toks = list(range(16))
    first = h.new_records(4)
    h.insert(toks, first, h.state())
    dup = h.new_records(4)  # a request that computed the same prompt without the cache
    res = h.insert(toks + [7], dup, h.state())
    assert (res.num_new_pages, res.num_duplicate_pages) == (0, 4)
    assert h.freed_of("full") == sorted(r.full[0] for r in dup)
    assert h.freed_of("swa") == sorted(r.swa for r in dup) and len(h.freed_of("state")) == 1
    m = h.cache.match_prefix(toks + [1, 2, 3, 4])
    lk = h.cache.lock(m.last_node)
    more = m.pages + h.new_records(1)  # the matched pages are the cache's own: never freed
    res = h.insert(toks + [1, 2, 3, 4], more, h.state())
    h.cache.unlock(lk)
    assert (res.num_new_pages, res.num_duplicate_pages) == (1, 0) and len(h.freed) == 9


def test_insert_rejects_inconsistent_input():
    h = Harness(4, 8)
    toks = list(range(16))
    recs = h.new_records(4)
    h.insert(toks, recs, h.state())
    with pytest.raises(ValueError):
        h.cache.insert(toks[:12], h.new_records(4))
    with pytest.raises(ValueError):
        h.cache.insert(toks, h.new_records(4), None, None, extra_states={6: "s"})
    with pytest.raises(ValueError):
        h.cache.insert(toks, h.new_records(4), None, 8)  # pages below 8 claim live SWA
    with pytest.raises(ValueError):  # page 1 is the cache's own, page 0 is not: would double free
        h.cache.insert(toks, h.new_records(1) + recs[1:], None)
    h.cache.check_invariants()


# --- eviction ------------------------------------------------------------------------------------
def test_evict_full_lru_order_and_tombstone_cascade():
    h = Harness(2, 2)
    a, b, c = [1, 1, 2, 2], [1, 1, 3, 3], [5, 5, 6, 6]
    for toks in (a, b, c):
        h.insert(toks, h.new_records(2), h.state())
    locks = [h.cache.lock(h.cache.match_prefix(t).last_node) for t in (a, b, c)]
    assert h.cache.evict_swa(1) == 1  # leaves hold the windows: only the shared [1,1] can go
    for lk in locks:
        h.cache.unlock(lk)
    assert h.cache.num_cached_pages() == 5 and h.cache.num_swa_pages() == 4
    h.cache.match_prefix(a)  # LRU among leaves now: b's [3,3], c's node, a's [2,2]
    assert h.cache.evict_full(1) == 1  # b's leaf
    assert h.cache.match_prefix(c).num_tokens == 4 and h.cache.match_prefix(b).num_tokens == 0
    assert h.cache.evict_full(1) == 2  # a's leaf, and its tombstoned parent, now a leaf, with it
    assert h.cache.num_cached_pages() == 2 and list(h.cache.root.children) == [(5, 5)]
    h.cache.check_invariants()
    assert h.cache.evict_full(10) == 2 and h.cache.num_cached_pages() == 0
    assert len(set(h.freed)) == len(h.freed) and set(h.freed) == h.handed


def test_evict_swa_internal_tombstones_leaf_deletes():
    h = Harness(2, 2)
    h.insert([1, 1, 2, 2, 3, 3], h.new_records(3), h.state(), extra={2: h.state()})
    h.insert([1, 1, 4, 4], h.new_records(2), h.state())  # [1,1] → {[2,2,3,3], [4,4]}
    locks = [h.cache.lock(h.cache.match_prefix(t).last_node) for t in ([1, 1, 2, 2, 3, 3], [1, 1, 4, 4])]
    h.events.clear()
    assert h.cache.evict_swa(1) == 1  # [1,1]: internal → tombstone, full KV kept
    assert h.cache.num_cached_pages() == 4 and h.cache.num_swa_pages() == 3
    assert [(e.kind, e.page_hashes) for e in h.events] == [("evicted", tuple(page_hashes([1, 1], 2)))]
    for lk in locks:
        h.cache.unlock(lk)
    assert h.cache.evictable_swa_pages() == 3
    assert h.cache.evict_swa(3) == 3  # both leaves deleted, the tombstone parent goes with the last
    assert h.cache.num_cached_pages() == 0 and not h.cache.root.children
    assert len(set(h.freed)) == len(h.freed) and set(h.freed) == h.handed


# --- locks ---------------------------------------------------------------------------------------
def test_lock_protects_path_and_window_only():
    h = Harness(2, 2)
    toks = [1, 1, 2, 2, 3, 3]
    h.insert(toks, h.new_records(3), h.state(), extra={2: h.state(), 4: h.state()})
    m = h.cache.match_prefix(toks)
    lk = h.cache.lock(m.last_node)
    assert h.cache.protected_full_pages() == 3 and h.cache.protected_swa_pages() == 1
    assert h.cache.evict_full(10) == 0
    assert h.cache.evict_swa(10) == 2  # outside the window: tombstoned while in use
    assert h.cache.match_prefix(toks).num_tokens == 6  # still resumable: the window is live
    h.insert([1, 1, 9, 9], h.new_records(2), h.state())  # splits a locked path
    h.cache.unlock(lk)
    with pytest.raises(ValueError):
        h.cache.unlock(lk)
    assert h.cache.protected_full_pages() == 0 and h.cache.protected_swa_pages() == 0
    h.cache.check_invariants()
    total = h.cache.evictable_full_pages()
    assert total == h.cache.num_cached_pages() and h.cache.evict_full(100) == total
    assert h.cache.num_cached_pages() == 0 and set(h.freed) == h.handed


def test_lock_of_a_tombstone_is_refused_and_split_below_lock_unlocks_cleanly():
    h = Harness(1, 4)
    toks, _ = chain(h)
    h.cache.evict_swa(1)
    with pytest.raises(ValueError):
        h.cache.lock(h.cache.root.children[(0,)])
    m = h.cache.match_prefix(toks)
    lk = h.cache.lock(m.last_node)
    h.insert([0, 1, 2, 3, 4, 7], h.new_records(6), h.state())  # splits C (the locked node)
    h.insert([0, 1, 2, 8], h.new_records(4), h.state())  # splits B (the SWA lock's top)
    assert h.cache.evict_swa(100) > 0 and h.cache.match_prefix(toks).num_tokens == 6
    h.cache.unlock(lk)
    h.cache.check_invariants()
    assert h.cache.protected_full_pages() == h.cache.protected_swa_pages() == 0


# --- events --------------------------------------------------------------------------------------
def test_events_mirror_live_pages():
    h = Harness(2, 2)
    docs = [[1, 1, 2, 2, 3, 3], [1, 1, 2, 2, 4, 4, 5], [7, 7]]
    for d in docs:
        h.insert(d, h.new_records(len(d) // 2), h.state())
    stored = [e for e in h.events if e.kind == "stored"]
    assert [e.page_hashes for e in stored] == [tuple(page_hashes(docs[0], 2)), tuple(page_hashes(docs[1], 2)[2:]),
                                               tuple(page_hashes(docs[2], 2))]
    assert {e.worker_id for e in h.events} == {"p0"}
    h.cache.evict_swa(1)
    h.cache.evict_full(100)
    mirror = _replay(h.events)
    assert mirror == set()
    assert sorted(x for e in h.events if e.kind == "evicted" for x in e.page_hashes) == \
        sorted(x for e in stored for x in e.page_hashes)


def _replay(events):
    live = set()
    for e in events:
        for x in e.page_hashes:
            if e.kind == "stored":
                assert x not in live
                live.add(x)
            else:
                assert x in live
                live.discard(x)
    return live


# --- randomized run against a reference ---------------------------------------------------------
def _reference_match(cache, toks, P, W):
    """Brute force from the flattened tree: deepest page boundary with a state whose last
    window of pages is live."""
    info, stack = {}, [(cache.root, ())]  # page-end prefix → (SWA live, state at that boundary)
    while stack:
        node, pre = stack.pop()
        for c in node.children.values():
            for j, r in enumerate(c.value):
                info[pre + c.key[:(j + 1) * P]] = (r.swa is not None, c.state if j == len(c) - 1 else None)
            stack.append((c, pre + c.key))
    best = 0
    for b in range(P, len(toks) // P * P + 1, P):
        if tuple(toks[:b]) not in info:
            break
        first = max(0, b - W) // P
        if info[tuple(toks[:b])][1] is not None and all(info[tuple(toks[:(j + 1) * P])][0] for j in range(first, b // P)):
            best = b
    return best


@pytest.mark.parametrize("seed,page_size,window", [(0, 1, 4), (1, 2, 4), (2, 4, 4), (3, 4, 8), (4, 2, 6), (5, 3, 8)])
def test_random_operations_exact_accounting(seed, page_size, window):
    rng = random.Random(seed)
    h = Harness(page_size, window)
    cache, P = h.cache, page_size
    owner: dict = {}  # id → the token prefix its content belongs to
    bases = [[rng.randrange(3) for _ in range(40)] for _ in range(3)]
    running: list = []

    def check_match(toks, m):
        assert m.num_tokens % P == 0 and m.num_tokens <= m.tree_tokens
        assert m.num_tokens == _reference_match(cache, toks, P, window)
        for j, r in enumerate(m.pages):
            assert owner[("full", r.full[0])] == tuple(toks[:(j + 1) * P]) and ("full", r.full[0]) not in h.freed
            if r.swa is not None:
                assert owner[("swa", r.swa)] == tuple(toks[:(j + 1) * P]) and ("swa", r.swa) not in h.freed
        assert all(r.swa is not None for r in m.pages[max(0, m.num_tokens - window) // P:])
        if m.num_tokens:
            assert owner[("state", m.state)] == tuple(toks[:m.num_tokens]) and ("state", m.state) not in h.freed

    def start():
        b = rng.choice(bases)
        toks = b[:rng.randrange(1, 41)] + [rng.randrange(3) for _ in range(rng.randrange(0, 12))]
        m = cache.match_prefix(toks)
        check_match(toks, m)
        lk = cache.lock(m.last_node)
        n, k = len(toks) // P, len(m.pages)
        if rng.random() < 0.5:  # the seed's shape: SWA released below some point
            upto = rng.randrange(k, n + 1)
            dead, upto_arg = set(range(k, upto)), upto * P
        else:
            dead, upto_arg = {j for j in range(k, n) if rng.random() < 0.4}, None
        recs = list(m.pages) + h.new_records(n - k)
        recs[k:] = [PageRecord(r.full, None if j in dead else r.swa) for j, r in enumerate(recs[k:], k)]
        for j, r in enumerate(recs[k:], k):
            owner[("full", r.full[0])] = tuple(toks[:(j + 1) * P])
            if r.swa is not None:
                owner[("swa", r.swa)] = tuple(toks[:(j + 1) * P])
        states = {b * P: h.state() for b in range(max(k, 1), n) if rng.random() < 0.15}
        if k * P < m.tree_tokens < n * P:
            states[m.tree_tokens] = h.state()  # snapshot where this request leaves the cached path
        end = h.state() if rng.random() < 0.85 and n else None
        for bnd, s in list(states.items()) + [(n * P, end)]:
            owner[("state", s)] = tuple(toks[:bnd])
        running.append((toks, recs, end, upto_arg, states, lk))

    def finish():
        toks, recs, end, upto, states, lk = running.pop(rng.randrange(len(running)))
        h.insert(toks, recs, end, upto, states)
        cache.unlock(lk)

    for _ in range(600):
        op = rng.random()
        if op < 0.3 or not running:
            start()
        elif op < 0.6:
            finish()
        elif op < 0.75:
            n = rng.randrange(1, 6)
            before = cache.evictable_full_pages()
            freed = cache.evict_full(n)
            assert freed >= min(n, before) or cache.evictable_full_pages() == 0
        elif op < 0.9:
            n = rng.randrange(1, 6)
            freed = cache.evict_swa(n)
            assert freed >= n or cache.evictable_swa_pages() == 0
        else:
            toks = rng.choice(bases)[:rng.randrange(1, 41)]
            check_match(toks, cache.match_prefix(toks))
        cache.check_invariants()
        assert cache.protected_full_pages() <= cache.num_cached_pages()
        live_hashes = set()
        stack = [(cache.root, ())]
        while stack:
            node, pre = stack.pop()
            for c in node.children.values():
                if not c.swa_tombstone:
                    live_hashes |= set(c.hashes)
                stack.append((c, pre + c.key))
        assert _replay(h.events) == live_hashes

    while running:
        finish()
    assert cache.protected_full_pages() == 0 and cache.protected_swa_pages() == 0
    total = cache.evictable_full_pages()
    assert cache.evict_full(total + 1) == total
    assert cache.num_cached_pages() == 0 and not cache.root.children
    assert len(h.freed) == len(set(h.freed)) and set(h.freed) == h.handed
    assert _replay(h.events) == set()
