"""RouterLeases: which requests a decode worker aborts because their router's lease lapsed."""

from decode_worker.router_leases import RouterLeases


def test_requests_of_a_router_missing_for_the_grace_are_abandoned_once():
    leases = RouterLeases(grace_s=5.0)
    leases.add("a1", "ra")
    leases.add("a2", "ra")
    leases.add("b1", "rb")
    assert leases.abandoned({"rb"}, now=100.0) == []  # ra missing since 100: within the grace
    assert leases.abandoned({"rb"}, now=104.9) == []
    assert sorted(leases.abandoned({"rb"}, now=105.0)) == ["a1", "a2"]
    assert leases.abandoned(set(), now=106.0) == [] and leases.routers() == {"rb"}  # forgotten once returned


def test_a_router_back_within_the_grace_restarts_its_clock():
    """A Redis restart: the registry comes back empty until the router's next renewal."""
    leases = RouterLeases(grace_s=5.0)
    leases.add("a1", "ra")
    assert leases.abandoned(set(), now=0.0) == []
    assert leases.abandoned({"ra"}, now=1.0) == []  # renewed again
    assert leases.abandoned(set(), now=4.0) == []
    assert leases.abandoned(set(), now=8.9) == []  # missing since 4.0, not since 0.0
    assert leases.abandoned(set(), now=9.0) == ["a1"]


def test_requests_without_a_router_or_ended_are_never_abandoned():
    leases = RouterLeases(grace_s=1.0)
    leases.add("direct", "")  # no lease: a caller that is not a router
    leases.add("done", "ra")
    leases.add("live", "ra")
    leases.retain({"direct", "live"})  # "done" ended
    assert leases.routers() == {"ra"}
    assert leases.abandoned(set(), now=0.0) == []
    assert leases.abandoned(set(), now=2.0) == ["live"]
