import pytest

from router.prefix_index import PrefixIndex
from worker_runtime.wire import KVEvent, page_hashes

P = 4
A = list(range(100, 116))  # 4 pages
B = A[:8] + [7] * 8  # shares A's first 2 pages
HA, HB = page_hashes(A, P), page_hashes(B, P)


def stored(w, hashes):
    return KVEvent(w, "stored", tuple(hashes))


CASES = [
    # name, events, query, expected match
    ("empty index", [], HA, {}),
    ("full match", [stored("w1", HA)], HA, {"w1": 4}),
    ("prefix of the query", [stored("w1", HA[:2])], HA, {"w1": 2}),
    ("shared prefix only", [stored("w1", HB)], HA, {"w1": 2}),
    # chained hashes: the deepest announced page proves every page before it (workers announce
    # resume points, not every page)
    ("only resume points announced", [stored("w1", [HA[1], HA[3]])], HA, {"w1": 4}),
    ("deepest point within the query", [stored("w1", [HA[1]])], HA, {"w1": 2}),
    ("resume point beyond the query", [stored("w1", [HA[3]])], HA[:3], {}),
    ("resume point of another prompt", [stored("w1", [HB[3]])], HA, {}),
    ("several workers", [stored("w1", HA[:3]), stored("w2", HA), stored("w3", HB)], HA,
     {"w1": 3, "w2": 4, "w3": 2}),
    ("eviction", [stored("w1", HA), KVEvent("w1", "evicted", (HA[3],))], HA, {"w1": 3}),
    ("eviction of the deepest point", [stored("w1", [HA[1], HA[3]]), KVEvent("w1", "evicted", (HA[3],))], HA,
     {"w1": 2}),
    ("cleared", [stored("w1", HA), stored("w2", HA[:1]), KVEvent("w1", "cleared")], HA, {"w2": 1}),
    ("evicting unknown is a no-op", [KVEvent("w9", "evicted", (1, 2))], HA, {}),
    ("empty query", [stored("w1", HA)], [], {}),
]


@pytest.mark.parametrize("name,events,query,want", CASES, ids=[c[0] for c in CASES])
def test_match(name, events, query, want):
    idx = PrefixIndex(page_size=P)
    for e in events:
        idx.apply(e)
    assert idx.match(query) == want


def test_tokens_and_worker_removal():
    idx = PrefixIndex(page_size=P)
    idx.apply(stored("w1", HA))
    idx.apply(stored("w2", HB))
    assert idx.match_tokens(A + [1, 2]) == {"w1": 4, "w2": 2}  # a partial last page never matches
    assert idx.workers() == ["w1", "w2"] and idx.pages("w1") == 4
    idx.remove_worker("w1")
    assert idx.match_tokens(A) == {"w2": 2} and idx.workers() == ["w2"] and idx.pages("w1") == 0
    idx.apply(KVEvent("w2", "evicted", tuple(HB)))
    assert idx.workers() == [] and idx._holders == {}  # nothing left behind


def test_bad_event_kind():
    with pytest.raises(ValueError):
        PrefixIndex(P).apply(KVEvent("w", "moved", ()))
