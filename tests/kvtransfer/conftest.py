"""Make the repository root importable (kvtransfer) and this folder (kvt_harness) for tests and
for the worker processes they spawn (spawn children inherit sys.path); and the in-process pair
of agents that the in-process test modules share (each module's own LAYOUT), once per transport:
"nixl" (two NIXL agents, real UCX loopback) and "local" (two LocalAgents of one directory)."""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for p in (str(_HERE.parents[1]), str(_HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)


import pytest  # noqa: E402


@pytest.fixture(scope="module", params=["nixl", "local"])
def new_agent(request):
    """(name, pools) -> a new agent of this run's transport; local agents of one module share a
    directory, so they reach each other."""
    from kvt_harness import agent_factory

    return agent_factory(request.param)


@pytest.fixture(scope="module")
def agents(request, new_agent):
    """Two agents in this process ("pa" -> "pb") with pools of the requesting module's LAYOUT;
    each has loaded the other."""
    from kvt_harness import random_pools

    layout = request.module.LAYOUT
    a = new_agent("pa", random_pools(layout, 1))
    b = new_agent("pb", random_pools(layout, 2))
    a.add_peer("pb", b.metadata())
    b.add_peer("pa", a.metadata())
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def sides(agents, request):
    """(sender on "pa" handshaken with "pb", receiver on "pb", its allocator); afterwards every
    request is aborted and every page must be back in the allocator."""
    from kvtransfer import Receiver, Sender
    from kvt_harness import PageAllocator, pump

    layout = request.module.LAYOUT
    a, b = agents
    sender = Sender(a, layout, post_margin_s=0.02)
    alloc = PageAllocator(layout)
    receiver = Receiver(b, alloc, layout, grace_s=0.1)
    sender.handshake("pb", b.metadata(), layout)
    yield sender, receiver, alloc
    for rid in list(receiver.held()):
        receiver.abort(rid)
    for rid in sender.holding():
        sender.abort(rid)
    pump(sender, receiver, lambda s, r: receiver.idle() and not sender.holding(), timeout=3)
    assert all(alloc.num_free(k) == alloc.total[k] for k in alloc.total)
