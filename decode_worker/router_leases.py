"""Which requests belong to a router that is gone: the router's lease in the registry lapsed.

A router streams each request from its decode worker through a Ray streaming call, and Ray does
not end that call when the caller's process dies. Without this a request of a crashed router
would decode to its length or deadline for nobody. Every router renews a lease key in Redis
(`Registry.renew_router`, each registry refresh); a request names the router that streams it
(`GenerateRequest.router`). A request is abandoned once its router's key has been missing for
`grace_s` on end: the key itself only disappears `ROUTER_LEASE_S` after the last renewal, and the
grace covers a Redis restart (the registry comes back empty; the router re-creates its key on its
next refresh). A failed registry read decides nothing: an outage of Redis abandons nobody.
"""

from __future__ import annotations


class RouterLeases:
    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self._router_of: dict[str, str] = {}        # request id → router id
        self._missing_since: dict[str, float] = {}  # router id → first check (unix s) its key was missing

    def add(self, request_id: str, router: str) -> None:
        if router:  # "" = no router lease (direct callers, tests): never abandoned
            self._router_of[request_id] = router

    def retain(self, live_requests) -> None:
        """Forget requests that ended (those not in `live_requests`)."""
        self._router_of = {rid: r for rid, r in self._router_of.items() if rid in live_requests}

    def routers(self) -> set[str]:
        return set(self._router_of.values())

    def abandoned(self, alive: set[str], now: float) -> list[str]:
        """Given the routers whose keys exist now, the request ids to abort (and forget)."""
        gone = []
        for router in self.routers():
            if router in alive:
                self._missing_since.pop(router, None)
            elif now - self._missing_since.setdefault(router, now) >= self.grace_s:
                gone.append(router)
        self._missing_since = {r: t for r, t in self._missing_since.items() if r in self.routers()}
        out = [rid for rid, r in self._router_of.items() if r in gone]
        for rid in out:
            del self._router_of[rid]
        return out
