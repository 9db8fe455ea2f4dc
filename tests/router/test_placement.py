import pytest

from router.config import PlacementConfig
from router.placement import Placement, place, placement_request
from router.prefix_index import PrefixIndex
from worker_runtime.wire import KVEvent, WorkerLoad, page_hashes

CFG = PlacementConfig(page_size=4, remote_prefill_threshold=8)
PROMPT = list(range(1, 21))  # 20 tokens = 5 pages


def dec(wid, running=0, free=100, draining=False):
    return WorkerLoad(wid, "decode", running=running, free_pages=free, total_pages=100, draining=draining)


def pre(wid, queued=0, draining=False):
    return WorkerLoad(wid, "prefill", queued_prefill_tokens=queued, draining=draining)


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
]


@pytest.mark.parametrize("name,prompt,idx,decode,prefill,want", CASES, ids=[c[0] for c in CASES])
def test_place(name, prompt, idx, decode, prefill, want):
    req = placement_request(prompt, 4, idx)
    assert place(req, decode, prefill, CFG, tie_key="r1") == want
