import pytest

from router.policies.base import PlacementRequest
from router.policies.decode_load import score_decode_load
from worker_runtime.wire import WorkerLoad


def d(wid, free=100, total=100, running=0, waiting=0, draining=False):
    return WorkerLoad(wid, "decode", waiting=waiting, running=running, free_pages=free, total_pages=total,
                      draining=draining)


REQ = PlacementRequest(prompt_tokens=100, max_tokens=100, page_size=256)  # needs 1 page

CASES = [
    ("idle workers tie at 1", [d("a"), d("b")], [1.0, 1.0]),
    ("free pages fraction", [d("a", free=50), d("b", free=100)], [0.75, 1.0]),
    ("busiest gets queue 0", [d("a", running=4), d("b", running=2)], [0.5, 0.75]),
    ("waiting weighs double", [d("a", waiting=2), d("b", running=2)], [0.5, 0.75]),
    ("no room for the request", [d("a", free=0), d("b")], [0.0, 1.0]),
    ("no pages at all", [d("a", free=0, total=0)], [0.0]),
    ("draining scores 0", [d("a", draining=True), d("b", running=1)], [0.0, 0.5]),
    ("no endpoints", [], []),
]


@pytest.mark.parametrize("name,endpoints,want", CASES, ids=[c[0] for c in CASES])
def test_decode_load(name, endpoints, want):
    got = score_decode_load(REQ, endpoints)
    assert got == pytest.approx(want)
    assert all(0.0 <= s <= 1.0 for s in got)


def test_pages_needed_counts_prompt_and_max_tokens():
    big = PlacementRequest(prompt_tokens=600, max_tokens=100, page_size=256)  # 3 pages
    assert score_decode_load(big, [d("a", free=2), d("b", free=3)]) == pytest.approx([0.0, 0.515])
