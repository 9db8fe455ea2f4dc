import pytest

from router.policies.base import PlacementRequest
from router.policies.prefix_affinity import score_prefix_affinity
from worker_runtime.wire import WorkerLoad


def p(wid, queued=0, draining=False):
    return WorkerLoad(wid, "prefill", queued_prefill_tokens=queued, draining=draining)


def req(prompt, **cached):
    return PlacementRequest(prompt_tokens=prompt, page_size=100, cached_pages=cached)


CASES = [
    # name, request, endpoints, expected scores
    ("no cache, idle: tie", req(1000), [p("a"), p("b")], [1.0, 1.0]),
    ("cached prefix wins", req(1000, a=5), [p("a"), p("b")], [1.0, 0.5]),
    ("queue outweighs cache", req(1000, a=5), [p("a", queued=2000), p("b")], [1000 / 2500, 1.0]),
    ("cache outweighs shorter queue", req(1000, a=8), [p("a", queued=300), p("b", queued=100)],
     [1.0, 500 / 1100]),
    ("fully cached, idle", req(300, a=3), [p("a"), p("b")], [1.0, 0.0]),
    ("cache capped at the prompt", req(250, a=9), [p("a"), p("b", queued=50)], [1.0, 0.0]),
    ("draining scores 0", req(1000, a=9), [p("a", draining=True), p("b")], [0.0, 1.0]),
    ("no endpoints", req(10), [], []),
]


@pytest.mark.parametrize("name,request_,endpoints,want", CASES, ids=[c[0] for c in CASES])
def test_prefix_affinity(name, request_, endpoints, want):
    got = score_prefix_affinity(request_, endpoints)
    assert got == pytest.approx(want)
    assert all(0.0 <= s <= 1.0 for s in got)
