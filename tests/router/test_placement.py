import pytest

from router.config import PlacementConfig
from router.placement import Placement, place, placement_request
from router.prefix_index import PrefixIndex
from worker_runtime.wire import KVEvent, WorkerLoad, page_hashes

CFG = PlacementConfig(page_size=4, remote_prefill_threshold=8)
PROMPT = list(range(1, 21))  # 20 tokens = 5 pages


def dec(wid, running=0, free=100, draining=False):
    return WorkerLoad(wid, "decode", running=running, free_pages=free, total_pages=100, draining=draining)


def pre(wid, queued=0, draining=False, waiting=0):
    return WorkerLoad(wid, "prefill", waiting=waiting, queued_prefill_tokens=queued, draining=draining)


def index(**held):
    idx = PrefixIndex(page_size=4)
    for w, n in held.items():
        idx.apply(KVEvent(w, "stored", tuple(page_hashes(PROMPT, 4)[:n])))
    return idx


CASES = [
    ("short prompt: decode prefills", PROMPT[:5], index(), [dec("d1")], [pre("p1")], Placement("d1", None, 0, "short_prompt")),
    ("no prefill worker", PROMPT, index(), [dec("d1")], [], Placement("d1", None, 0, "no_prefill_worker")),
    ("only draining prefill", PROMPT, index(), [dec("d1")], [pre("p1", draining=True)],
     Placement("d1", None, 0, "no_prefill_worker")),
    ("least loaded decode, cached prefill", PROMPT, index(p2=4), [dec("d1", running=5), dec("d2", running=1)],
     [pre("p1"), pre("p2")], Placement("d2", "p2", 16, "long_prompt")),
    ("queue beats cache", PROMPT, index(p2=2), [dec("d1")], [pre("p1"), pre("p2", queued=100)],
     Placement("d1", "p1", 0, "long_prompt")),
    ("no decode worker", PROMPT, index(), [dec("d1", draining=True)], [pre("p1")], None),
    ("queued tokens, not request counts", PROMPT, index(), [dec("d1")],
     [pre("p1", queued=60, waiting=12), pre("p2", queued=5000, waiting=1)], Placement("d1", "p1", 0, "long_prompt")),
]

BOUNDED = PlacementConfig(page_size=4, remote_prefill_threshold=8, max_prefill_queue_tokens=1000)
BOUND_CASES = [
    ("every queue past the bound: wait", PROMPT, [pre("p1", queued=1001), pre("p2", queued=4000)],
     Placement("d1", None, 0, "prefill_busy", wait=True)),
    ("one queue at the bound: placed there", PROMPT, [pre("p1", queued=4000), pre("p2", queued=1000)],
     Placement("d1", "p2", 0, "long_prompt")),
    ("a draining idle worker does not count", PROMPT, [pre("p1", queued=2000), pre("p2", draining=True)],
     Placement("d1", None, 0, "prefill_busy", wait=True)),
    ("short prompt never waits", PROMPT[:5], [pre("p1", queued=9000)], Placement("d1", None, 0, "short_prompt")),
    ("no live prefill worker: the decode worker prefills", PROMPT, [pre("p1", queued=9000, draining=True)],
     Placement("d1", None, 0, "no_prefill_worker")),
]


@pytest.mark.parametrize("name,prompt,idx,decode,prefill,want", CASES, ids=[c[0] for c in CASES])
def test_place(name, prompt, idx, decode, prefill, want):
    req = placement_request(prompt, 4, idx)
    assert place(req, decode, prefill, CFG, tie_key="r1") == want


@pytest.mark.parametrize("name,prompt,prefill,want", BOUND_CASES, ids=[c[0] for c in BOUND_CASES])
def test_place_with_a_prefill_queue_bound(name, prompt, prefill, want):
    req = placement_request(prompt, 4, index())
    assert place(req, [dec("d1")], prefill, BOUNDED, tie_key="r1") == want
    # without a bound nothing ever waits
    assert not place(req, [dec("d1")], prefill, CFG, tie_key="r1").wait


def test_a_bound_must_be_positive():
    with pytest.raises(ValueError, match="max_prefill_queue_tokens"):
        PlacementConfig(max_prefill_queue_tokens=0)
