import pytest

from router.policies.prefill_queue import prefill_saturated
from worker_runtime.wire import WorkerLoad


def p(wid, queued=0, draining=False, waiting=0):
    return WorkerLoad(wid, "prefill", waiting=waiting, queued_prefill_tokens=queued, draining=draining)


CASES = [
    # name, endpoints, bound, saturated
    ("no bound", [p("a", queued=10 ** 9)], None, False),
    ("all past the bound", [p("a", queued=101), p("b", queued=500)], 100, True),
    ("one at the bound", [p("a", queued=100), p("b", queued=500)], 100, False),
    ("many requests, few tokens", [p("a", queued=50, waiting=40)], 100, False),
    ("one request, many tokens", [p("a", queued=8192, waiting=1)], 100, True),
    ("draining ones left out", [p("a", queued=500), p("b", draining=True)], 100, True),
    ("only draining: nothing to wait for", [p("a", queued=500, draining=True)], 100, False),
    ("no endpoints", [], 100, False),
]


@pytest.mark.parametrize("name,endpoints,bound,want", CASES, ids=[c[0] for c in CASES])
def test_prefill_saturated(name, endpoints, bound, want):
    assert prefill_saturated(endpoints, bound) is want
