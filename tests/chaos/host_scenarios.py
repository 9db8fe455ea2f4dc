"""Host and network faults: the scenarios that run on the bed of several hosts (hosts_bed.py).

Each breaks a whole host or a link between two hosts while the load runs, waits until the pools
are whole again (every worker registered and answering; a worker whose host went, replaced under
its name with a new epoch), and records that time as `recovered_s`. Partitions drop packets
silently (hosts.Hosts.partition: frames to a MAC nobody has), the way a failed link looks.
"""

from __future__ import annotations

import asyncio
import random
import time

from tests.chaos.harness import Observed
from tests.chaos.hosts_bed import REBOOT_S, ROUTER, VALKEY, HostsBed
from tests.chaos.scenarios import KV_FAILURES, Scenario, _pause, _when, metric, retargeted

DEATH_TIMEOUT_S = 40.0  # for the head to declare a cut-off node dead (10 missed checks, a loaded machine)


async def _reboot(bed: HostsBed, host: int) -> None:
    """Host `host`'s Ray starts again and joins the head (as after a machine restart)."""
    import ray

    await asyncio.to_thread(bed.ray_hosts.start_node, host, False)
    ip = bed.hosts[host].ip

    async def joined() -> bool:
        return any(n["Alive"] and n["NodeManagerAddress"] == ip for n in await asyncio.to_thread(ray.nodes))

    await bed.until(joined, 120.0, every_s=0.5)


def _recovered(bed: HostsBed, took: float | None) -> str:
    bed.extra["recovered_s"] = took
    return f"pools whole again {took:.1f}s after the fault" if took is not None else "pools NOT whole after 90s"


def crash_host(worker: str, field: str, at_least: int, doing: str):
    """Every process on `worker`'s host killed at a moment its page_accounting[field] ≥ at_least;
    the host comes back REBOOT_S later and the supervisor's replacement lands there."""
    async def inject(bed: HostsBed, rng: random.Random) -> str:
        host = await bed.host_of(worker)
        old = await bed.registered()
        await _pause(rng, 0.2, 1.2)
        found = await _when(bed, worker, field, at_least=at_least)
        t0 = time.monotonic()
        await asyncio.to_thread(bed.hosts.crash, host)
        bed.dead.add(worker)
        await asyncio.sleep(REBOOT_S)
        await _reboot(bed, host)
        took = await bed.recovered(t0, old, replaced=(worker,))
        if took is not None:
            bed.dead.discard(worker)
        return (f"host {host} ({worker}) crashed " + (doing if found else f"(no {field} seen)")
                + f", back after {REBOOT_S:.0f}s; " + _recovered(bed, took))
    return inject


async def crash_valkey_host(bed: HostsBed, rng: random.Random) -> str:
    old = await bed.registered()
    t = await _pause(rng)
    down = rng.uniform(1.0, 3.0)
    t0 = time.monotonic()
    await asyncio.to_thread(bed.hosts.crash, VALKEY)
    await asyncio.sleep(down)
    await asyncio.to_thread(bed.ray_hosts.start_valkey)  # the host is back, its registry empty
    took = await bed.recovered(t0, old)
    return f"host {VALKEY} (Valkey) crashed at {t:.1f}s, back empty {down:.1f}s later; " + _recovered(bed, took)


def partition(a: str, b: str, seconds: tuple[float, float], field: str, at_least: int, doing: str):
    """Hosts of `a` and `b` ("router" = host 0) cut off from each other for a random time in
    `seconds`, from a moment decode-0's page_accounting[field] ≥ at_least; then joined again."""
    async def inject(bed: HostsBed, rng: random.Random) -> str:
        ha = ROUTER if a == "router" else await bed.host_of(a)
        hb = await bed.host_of(b)
        old = await bed.registered()
        await _pause(rng, 0.0, 0.8)
        found = await _when(bed, "decode-0", field, timeout_s=20.0, at_least=at_least)
        down = rng.uniform(*seconds)
        before = (await bed.accounting("decode-0"))["transfers"]["duration_s_sum"]
        t0 = time.monotonic()
        await asyncio.to_thread(bed.hosts.partition, ha, hb)
        await asyncio.sleep(down)
        await asyncio.to_thread(bed.hosts.heal, ha, hb)
        bed.extra["partition_s"] = down
        took = await bed.recovered(t0, old)
        # seconds that transfers into decode-0 ending in the window took: one held up by the
        # partition took about as long as it
        await asyncio.sleep(1.0)
        bed.extra["held_s"] = (await bed.accounting("decode-0"))["transfers"]["duration_s_sum"] - before
        return (f"hosts {ha} ({a}) and {hb} ({b}) partitioned for {down:.1f}s "
                + (doing if found else f"(no {field} seen)") + "; " + _recovered(bed, took))
    return inject


def _stale_handshake(self, name: str, metadata: bytes, layout: str) -> str:
    """Inside a prefill worker: handshake `name` with an old incarnation's metadata."""
    from kvtransfer import LayoutDescriptor
    from kvtransfer.sender import StaleTarget

    try:
        self.sender.handshake(name, metadata, LayoutDescriptor.from_bytes(layout))
    except StaleTarget:
        return "refused"
    return "accepted"


async def node_rejoin(bed: HostsBed, rng: random.Random) -> str:
    """decode-1's host cut off from the head until the head declares its node dead (decode-1 is
    then dead to Ray, and replaced as soon as a node can take it); joined again, its raylet finds
    itself declared dead and exits, and the host restarts Ray: the node joins again and the pool
    grows back. Then prefill-0, once it has met the new decode-1, must refuse the old
    incarnation's metadata in the handshake."""
    import ray

    victim = "decode-1"
    host = await bed.host_of(victim)
    info = next(w for w in await asyncio.to_thread(bed.registry().workers) if w.worker_id == victim)
    old = await bed.registered()
    await _pause(rng, 0.2, 1.2)
    found = await _when(bed, victim, "tokens_left", timeout_s=20.0, at_least=6)
    t0 = time.monotonic()
    await asyncio.to_thread(bed.hosts.partition, ROUTER, host)
    ip = bed.hosts[host].ip

    async def declared_dead() -> bool:
        return not any(n["Alive"] and n["NodeManagerAddress"] == ip for n in await asyncio.to_thread(ray.nodes))

    lost = await bed.until(declared_dead, DEATH_TIMEOUT_S, every_s=0.5)
    lost_s = time.monotonic() - t0
    bed.dead.add(victim)
    await asyncio.to_thread(bed.hosts.heal, ROUTER, host)
    await asyncio.sleep(1.0)  # its raylet learns it was declared dead and exits
    await asyncio.to_thread(bed.hosts.crash, host)  # the host restarts: what was left of it is gone
    await _reboot(bed, host)
    took = await bed.recovered(t0, old, replaced=(victim,))
    if took is not None:
        bed.dead.discard(victim)

    async def met_new() -> bool:
        peers = await bed.actor("prefill-0").__ray_call__.remote(lambda s: dict(s.shipping.peers))
        return peers.get(victim) not in (None, info.epoch)

    # the second wave (waves_s) brings prefill-0 transfers for the new decode-1; until it has met
    # it, the old epoch is not retired yet, so the replay would prove nothing
    met = await bed.until(met_new, 90.0, every_s=0.5)
    stale = (await bed.actor("prefill-0").__ray_call__.remote(_stale_handshake, victim, info.metadata, info.layout)
             if met else f"not tried (the new {victim} never met prefill-0)")
    bed.extra.update(stale_handshake=stale, node_lost_s=lost_s)
    return (f"host {host} ({victim}) cut off from the head " + ("while decoding" if found else "(no decoding seen)")
            + (f", node declared dead after {lost_s:.0f}s" if lost else ", node NOT declared dead")
            + f", rejoined; old epoch's handshake {stale}; " + _recovered(bed, took))


# --- what must be counted -------------------------------------------------------------------
def recovered(o: Observed, counted: tuple[bool, str] = (True, "")) -> tuple[bool, str]:
    took = o.extra.get("recovered_s")
    ok = took is not None and counted[0]
    return ok, (counted[1] + ", " if counted[1] else "") + (f"recovered in {took:.1f}s" if took is not None
                                                            else "not recovered")


def _expired(o: Observed) -> float:
    return metric(o, KV_FAILURES, reason="expired")


def _held_or_expired(o: Observed) -> tuple[bool, str]:
    """The partition caught a transfer into decode-0: its lease ran out (a local prefill took
    over), or it was held up by about the partition and then verified (the receiver takes a
    TransferDone that arrives before it noticed the deadline)."""
    held = o.extra.get("held_s", 0.0)
    ok = _expired(o) >= 1 or held >= 0.8 * o.extra.get("partition_s", float("inf"))
    return ok, f"kv_transfer_failures{{expired}} = {_expired(o):g}, transfers into decode-0 held {held:.1f}s"


def _rejoined(o: Observed) -> tuple[bool, str]:
    stale = o.extra.get("stale_handshake", "-")
    lost = f"stale epoch {stale}, node lost after {o.extra.get('node_lost_s', 0):.0f}s"
    return recovered(o, (stale == "refused", lost))


HOST_SCENARIOS: tuple[Scenario, ...] = (
    Scenario("crash_prefill_host", "host of prefill-0 crashes (every process killed), back 2 s later",
             crash_host("prefill-0", "queued", 1, "with prompts queued"),
             lambda o: recovered(o, (o.extra.get("recovered_s") is not None, "prefill-0 replaced")),
             hosts=True, waves_s=20.0),
    Scenario("crash_decode_host", "host of decode-0 crashes while it decodes, back 2 s later",
             crash_host("decode-0", "tokens_left", 6, "while it decoded"),
             lambda o: recovered(o, (retargeted(o, "repull", "recompute") >= 1,
                                     f"retargeted{{repull,recompute}} = {retargeted(o, 'repull', 'recompute'):g}")),
             hosts=True, waves_s=20.0),
    Scenario("crash_valkey_host", "host of Valkey crashes, back (empty) 1-3 s later", crash_valkey_host,
             lambda o: recovered(o, (metric(o, "v4serve_registry_errors_total") >= 1,
                                     f"registry_errors = {metric(o, 'v4serve_registry_errors_total'):g}")),
             hosts=True),
    Scenario("partition_router_decode", "router's host and decode-0's host cut off from each other for 3-5 s",
             partition("router", "decode-0", (3.0, 5.0), "tokens_left", 6, "while decode-0 decoded"),
             lambda o: recovered(o), hosts=True),
    Scenario("partition_prefill_decode",
             "prefill-0's and decode-0's hosts cut off for 10-12 s (past the lease) during a transfer",
             partition("prefill-0", "decode-0", (10.0, 12.0), "awaiting", 1, "during a transfer"),
             # the second wave starts while the link is down: its prefills for decode-0 are cut too
             lambda o: recovered(o, _held_or_expired(o)), hosts=True, waves_s=5.0),
    Scenario("partition_prefill_decode_within_lease",
             ("prefill-0's and decode-0's hosts cut off for 1-2 s during a transfer (within the lease)"),
             partition("prefill-0", "decode-0", (1.0, 2.0), "awaiting", 1, "during a transfer"),
             lambda o: recovered(o, (_expired(o) == 0, f"kv_transfer_failures{{expired}} = {_expired(o):g}")),
             hosts=True),
    Scenario("node_rejoin",
             ("decode-1's host cut off from the head until its node is declared dead, then restarted: joins again"),
             node_rejoin, _rejoined, hosts=True, waves_s=75.0),
)
