"""The fault matrix: what each scenario breaks, when, and which metric must count it.

Each `inject(bed, rng)` runs while the load is in flight, breaks one thing at a random point (a
random delay, or the first moment the state it targets exists: a transfer awaited, a request
decoding, a migration under way, a prompt queued), and returns a note of what it did. `counted`
reads the run's metrics and says whether (and by how much) the fault was counted.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Awaitable, Callable

from kvtransfer.faults import RECEIVER_BEFORE_VERIFY, SENDER_AFTER_POST, SENDER_BEFORE_DONE, FaultPlan
from tests.chaos.harness import Bed, Observed, metric, worker_sum

RETARGETS = "v4serve_retargeted_requests_total"
KV_FAILURES = "v4serve_kv_transfer_failures_total"


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str  # for the report
    inject: Callable[[Bed, random.Random], Awaitable[str]]
    counted: Callable[[Observed], tuple[bool, str]]  # (counted?, "metric = value")
    ci: bool = False  # in the short CI subset
    waves_s: float = 0.0  # > 0: every other request starts this much later (after a restart)
    allow_errors: bool = False  # reason-coded failures are acceptable here
    split: bool = False  # needs decode-1 behind a network namespace link (netns.py)
    supervised: bool = False  # the bed replaces dead workers, as `v4serve up` does
    hosts: bool = False  # runs on the bed of several hosts (hosts_bed.py, host_scenarios.py)


# --- injection helpers ----------------------------------------------------------------------
async def _pause(rng: random.Random, lo: float = 0.5, hi: float = 2.5) -> float:
    t = rng.uniform(lo, hi)
    await asyncio.sleep(t)
    return t


async def _window(bed: Bed, rng: random.Random, workers: tuple[str, ...], *, sender: FaultPlan | None = None,
                  receiver: FaultPlan | None = None, fired: tuple[str, ...]) -> str:
    """Turn a fault plan on at a random moment on `workers`, keep it until it fired on one of them
    (its injected counter at `fired` moved) or 20 s passed, then turn it off."""
    t = await _pause(rng)
    before = sum([await _injected(bed, w, fired) for w in workers])
    for w in workers:
        await (bed.actor(w).set_faults.remote(sender) if w.startswith("prefill")
               else bed.actor(w).set_faults.remote(sender=sender, receiver=receiver))

    async def hit() -> bool:
        return sum([await _injected(bed, w, fired) for w in workers]) > before

    ok = await bed.until(hit, 20.0, every_s=0.1)
    for w in workers:
        await (bed.actor(w).set_faults.remote(None) if w.startswith("prefill") else bed.actor(w).set_faults.remote())
    return f"on {', '.join(workers)} at {t:.1f}s, " + ("fired" if ok else "never fired")


async def _injected(bed: Bed, worker: str, path: tuple[str, ...]) -> int:
    value = await bed.accounting(worker)
    for key in path:
        value = value.get(key, 0) if isinstance(value, dict) else 0
    return value


async def _when(bed: Bed, worker: str, field: str, timeout_s: float = 30.0, at_least: int = 1) -> bool:
    """Wait for the first moment `worker`'s page_accounting[field] is at least `at_least`."""
    async def now() -> bool:
        return (await bed.accounting(worker)).get(field, 0) >= at_least

    return await bed.until(now, timeout_s, every_s=0.02)


async def _dies(bed: Bed, worker: str, timeout_s: float = 30.0) -> bool:
    import ray

    async def gone() -> bool:
        try:
            await bed.accounting(worker)
            return False
        except ray.exceptions.RayActorError:
            return True

    ok = await bed.until(gone, timeout_s, every_s=0.1)
    if ok:
        bed.dead.add(worker)
    return ok


def _counted(label: str, value: float, need: float = 1) -> tuple[bool, str]:
    return value >= need, f"{label} = {value:g}"


# --- injections -----------------------------------------------------------------------------
async def _nothing() -> str:
    return "no fault"


def message_fault(side: str, plan: FaultPlan, fired: str):
    """`plan` on the prefill worker's sender (side "prefill") or every decode worker's receiver."""
    async def inject(bed: Bed, rng: random.Random) -> str:
        if side == "prefill":
            return await _window(bed, rng, ("prefill-0",), sender=plan, fired=("transfers", "injected", fired))
        decode = tuple(w for w in bed.actors() if w.startswith("decode"))
        return await _window(bed, rng, decode, receiver=plan, fired=("transfers", "injected", fired))
    return inject


def kill_when(worker: str, field: str, doing: str, after_s: tuple[float, float] = (0.2, 1.5),
              then_s: tuple[float, float] = (0.0, 0.0), at_least: int = 1):
    """ray.kill(worker) at a moment, after a random pause, its page_accounting[field] is at least
    `at_least` (checked again right before the kill when `then_s` adds a random delay): e.g. while
    it awaits KV, decodes, or has prompts queued."""
    async def inject(bed: Bed, rng: random.Random) -> str:
        await _pause(rng, *after_s)
        found = await _when(bed, worker, field, at_least=at_least)
        if then_s[1] > 0:
            await asyncio.sleep(rng.uniform(*then_s))
            found = found and await _when(bed, worker, field, at_least=at_least)  # still so now
        bed.kill(worker)
        return f"ray.kill({worker}) " + (doing if found else f"(no {field} seen)")
    return inject


async def crash_decode_at_verify(bed: Bed, rng: random.Random) -> str:
    t = await _pause(rng, 0.0, 0.5)
    await _when(bed, "decode-0", "awaiting")  # arm it while a transfer into it is under way
    await bed.actor("decode-0").set_faults.remote(receiver=FaultPlan(kill_at=RECEIVER_BEFORE_VERIFY))
    died = await _dies(bed, "decode-0")
    return f"decode-0 exits at its next TransferDone (armed at {t:.1f}s)" + ("" if died else ": never reached")


async def kill_migration_source(bed: Bed, rng: random.Random) -> str:
    """Arm the kill, then migrate decode-0's running requests to decode-1. A request can finish
    between the moment it is seen running and the moment the migration pauses it (nothing moves,
    the kill point is never reached), so migrate again until one goes or the load is over."""
    import ray

    await _pause(rng, 0.5, 2.0)
    point = rng.choice([SENDER_AFTER_POST, SENDER_BEFORE_DONE])
    await bed.actor("decode-0").set_faults.remote(sender=FaultPlan(kill_at=point))
    attempts = 0
    while await _when(bed, "decode-0", "running", timeout_s=20.0):
        attempts += 1
        try:
            moved = await bed.actor("decode-0").migrate.remote(to="decode-1")
        except ray.exceptions.RayActorError:
            break  # the kill point was reached
        if any(m["moved"] for m in moved):
            break  # moved past the kill point without dying: _dies reports it
    died = await _dies(bed, "decode-0")
    return (f"decode-0 migrates to decode-1 and exits at {point}" + (f" (attempt {attempts})" if attempts > 1 else "")
            + ("" if died else ": never reached"))


async def kill_migration_target(bed: Bed, rng: random.Random) -> str:
    await _pause(rng, 1.0, 3.0)
    await _when(bed, "decode-0", "running")
    bed.actor("decode-0").migrate.remote(to="decode-1")
    found = await _when(bed, "decode-0", "migrating", timeout_s=10.0)
    await asyncio.sleep(rng.uniform(0.0, 0.1))
    bed.kill("decode-1")
    return "ray.kill(decode-1) " + ("while decode-0 migrated into it" if found else "(no migration seen)")


async def rebalance(bed: Bed, rng: random.Random) -> str:
    """Migrate decode-0's running requests away under load. Requests seen running may finish
    before the migration pauses them (nothing moves), so migrate again until one moves or the
    load is over."""
    t = await _pause(rng, 0.5, 2.0)
    moved, attempts = [], 0
    while not any(m["moved"] for m in moved) and await _when(bed, "decode-0", "tokens_left", timeout_s=20.0,
                                                             at_least=6):
        attempts += 1
        moved = await bed.actor("decode-0").migrate.remote()
    return (f"decode-0.migrate() at {t:.1f}s moved {sum(m['moved'] for m in moved)} of {len(moved)}"
            + (f" (attempt {attempts})" if attempts > 1 else ""))


async def restart_registry(bed: Bed, rng: random.Random) -> str:
    t = await _pause(rng)
    down = rng.uniform(1.0, 3.0)
    await bed.restart_registry(down)
    return f"Valkey stopped at {t:.1f}s, a fresh one up {down:.1f}s later"


def restart_worker(worker: str):
    async def inject(bed: Bed, rng: random.Random) -> str:
        t = await _pause(rng, 0.5, 2.0)
        old = (await bed.accounting(worker))["epoch"]
        new = await bed.restart(worker)
        bed.dead.discard(worker)
        return f"{worker} killed at {t:.1f}s, restarted under its name: epoch {old[:6]}→{new[:6]}"
    return inject


BACK_WITHIN_S = 30.0  # a replaced worker is in the registry again within this, on CPU


async def kill9_replaced(bed: Bed, rng: random.Random) -> str:
    """SIGKILL decode-0 while it decodes, and prefill-0 with it; supervision must bring both
    back under their names (new epochs) in the registry within BACK_WITHIN_S."""
    from worker_runtime.registry import Registry

    registry = Registry(bed.cluster.registry_url)
    victims = ("prefill-0", "decode-0")
    old = {w.worker_id: w.epoch for w in await asyncio.to_thread(registry.workers)}
    await _pause(rng, 0.3, 1.5)
    found = await _when(bed, "decode-0", "tokens_left", at_least=6)
    for w in victims:
        bed.kill9(w)
    t0 = asyncio.get_running_loop().time()

    async def back() -> bool:
        now = {w.worker_id: w.epoch for w in await asyncio.to_thread(registry.workers)}
        return all(now.get(v) not in (None, old.get(v)) for v in victims)

    ok = await bed.until(back, BACK_WITHIN_S, every_s=0.2)
    if ok:
        bed.dead.difference_update(victims)
    took = asyncio.get_running_loop().time() - t0
    return ("SIGKILL prefill-0 and decode-0 " + ("while it decoded" if found else "(no decoding seen)")
            + (f", both registered again {took:.1f}s later" if ok else f", not both back after {took:.0f}s"))


def _replaced(o: Observed, workers: tuple[str, ...]) -> tuple[bool, str]:
    """Each of `workers` was replaced once, within BACK_WITHIN_S."""
    got = dict(o.extra.get("replaced", []))
    ok = sorted(w for w, _ in o.extra.get("replaced", [])) == sorted(workers) and all(
        s < BACK_WITHIN_S for s in got.values())
    return ok, "replaced: " + (", ".join(f"{w} in {s:.1f}s" for w, s in sorted(got.items())) or "none")


async def cut_network(bed: Bed, rng: random.Random) -> str:
    victim = await asyncio.to_thread(bed.namespaced)
    await _pause(rng, 0.0, 0.5)
    found = await _when(bed, victim, "awaiting", timeout_s=20.0)  # a transfer into it under way
    down = rng.uniform(4.0, 6.0)
    await asyncio.to_thread(bed.link.cut)
    await asyncio.sleep(down)
    await asyncio.to_thread(bed.link.heal)
    return f"link to {victim} cut for {down:.1f}s" + (" during a transfer" if found else "")


async def slow_network(bed: Bed, rng: random.Random) -> str:
    victim = await asyncio.to_thread(bed.namespaced)
    t = await _pause(rng, 0.2, 1.0)
    await asyncio.to_thread(bed.link.slow, "2mbit")
    await asyncio.sleep(12.0)
    await asyncio.to_thread(bed.link.heal)
    return f"link to {victim} limited to 2 Mbit/s at {t:.1f}s for 12s"


# --- what must be counted -------------------------------------------------------------------
def retargeted(o: Observed, *paths: str) -> float:
    return sum(metric(o, RETARGETS, path=p) for p in paths)


def _rebuilt(o: Observed, counted: tuple[bool, str]) -> tuple[bool, str]:
    """The registry holds every surviving worker again (rebuilt from heartbeats)."""
    ok = o.extra["registered"] == sorted(o.workers)
    return counted[0] and ok, f"{counted[1]}, registry rebuilt: {'yes' if ok else o.extra['registered']}"


def _failures(o: Observed, reason: str) -> float:
    return metric(o, KV_FAILURES, reason=reason)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("baseline", "none", lambda bed, rng: _nothing(), lambda o: (True, "-")),
    Scenario("drop_done", "TransferDone dropped (prefill → decode)",
             message_fault("prefill", FaultPlan(drop=frozenset({"TransferDone"})), "drop_TransferDone"),
             lambda o: _counted("kv_transfer_failures{expired}", _failures(o, "expired"))),
    Scenario("delay_done", "TransferDone delayed 1 s (within the lease)",
             message_fault("prefill", FaultPlan(delay=frozenset({"TransferDone"}), delay_s=1.0),
                           "delay_TransferDone"),
             lambda o: _counted("prefill injected delay_TransferDone",
                                worker_sum(o, "transfers", "injected", "delay_TransferDone"))),
    Scenario("delay_done_past_lease", "TransferDone delayed past the lease",
             message_fault("prefill", FaultPlan(delay=frozenset({"TransferDone"}), delay_s=4.5),
                           "delay_TransferDone"),
             lambda o: _counted("kv_transfer_failures{expired}", _failures(o, "expired"))),
    Scenario("duplicate_done", "TransferDone sent twice",
             message_fault("prefill", FaultPlan(duplicate=frozenset({"TransferDone"})),
                           "duplicate_TransferDone"),
             lambda o: _counted("decode ignored{duplicate}", worker_sum(o, "transfers", "ignored", "duplicate"))),
    Scenario("drop_ack", "Ack dropped (decode → prefill)",
             message_fault("decode", FaultPlan(drop=frozenset({"Ack"})), "drop_Ack"),
             lambda o: _counted("prefill failures{lease_expired}",
                                worker_sum(o, "transfers", "failures", "lease_expired"))),
    Scenario("truncated_write", "writes truncated to half", ci=True,
             inject=message_fault("prefill", FaultPlan(truncate_write=0.5), "truncate_write"),
             counted=lambda o: _counted("kv_transfer_failures{corrupt}", _failures(o, "corrupt"))),
    Scenario("corrupted_write", "one byte flipped after the write",
             message_fault("decode", FaultPlan(corrupt_after_write=True), "corrupt_after_write"),
             lambda o: _counted("kv_transfer_failures{corrupt}", _failures(o, "corrupt"))),
    Scenario("stall_past_lease", "sender stalls past the lease before writing",
             message_fault("prefill", FaultPlan(stall_before_write_s=3.5), "stall_before_write"),
             lambda o: _counted("kv_transfer_failures{expired}", _failures(o, "expired"))),
    Scenario("kill_decode_mid_transfer", "decode actor killed while awaiting KV",
             kill_when("decode-0", "awaiting", "while it awaited KV", after_s=(0.0, 0.5)),
             lambda o: _counted("retargeted{repull,recompute}", retargeted(o, "repull", "recompute"))),
    Scenario("crash_decode_at_verify", "decode process exits when TransferDone arrives", crash_decode_at_verify,
             lambda o: _counted("retargeted{repull}", retargeted(o, "repull"))),
    Scenario("kill_decode_mid_decode", "decode actor killed while decoding",
             # a request with tokens still to go, so the kill lands before it can finish
             # looked for from early on: a late look can find decode-0's share of the load done
             kill_when("decode-0", "tokens_left", "while it decoded", after_s=(0.3, 1.5), then_s=(0.0, 1.0),
                       at_least=6),
             lambda o: _counted("retargeted{recompute,repull}", retargeted(o, "recompute", "repull"))),
    Scenario("rebalance", "none: running requests migrated under load", rebalance,
             lambda o: _counted("retargeted{migrate}", retargeted(o, "migrate"))),
    Scenario("kill_migration_source", "migration source exits mid-migration", kill_migration_source,
             lambda o: _counted("retargeted{recompute,repull}", retargeted(o, "recompute", "repull"))),
    Scenario("kill_migration_target", "migration target killed mid-migration", kill_migration_target,
             lambda o: _counted("migrations_out_failed + retargeted{recompute}",
                                worker_sum(o, "counts", "migrations_out_failed") + retargeted(o, "recompute"))),
    Scenario("kill_prefill_mid_prefill", "prefill actor killed with prompts queued",
             kill_when("prefill-0", "queued", "with prompts queued", after_s=(0.0, 0.5)),
             lambda o: _counted("kv_transfer_failures{prefill_failed}", _failures(o, "prefill_failed"))),
    Scenario("restart_redis", "Valkey stopped and restarted empty", restart_registry,
             lambda o: _rebuilt(o, _counted("registry_errors", metric(o, "v4serve_registry_errors_total")))),
    Scenario("restart_decode_same_name", "decode-0 killed and restarted under its name",
             restart_worker("decode-0"), waves_s=9.0,
             counted=lambda o: _counted("new decode-0 finished requests", o.workers["decode-0"]["finished"])),
    Scenario("restart_prefill_same_name", "prefill-0 killed and restarted under its name",
             restart_worker("prefill-0"), waves_s=9.0,
             counted=lambda o: _counted("new prefill-0 transfers", o.workers["prefill-0"]["transfers"]["transfers"])),
    Scenario("kill9_replaced", "prefill-0 and decode-0 processes SIGKILLed; supervision replaces them",
             kill9_replaced, lambda o: _replaced(o, ("decode-0", "prefill-0")), waves_s=9.0, supervised=True),
    Scenario("cut_network", "veth link to decode-1's namespace drops every packet for 4-6 s", cut_network,
             lambda o: _counted("kv_transfer_failures{expired}", _failures(o, "expired")), split=True),
    Scenario("slow_network", "veth link to decode-1's namespace limited to 2 Mbit/s for 12 s", slow_network,
             lambda o: _counted("kv_transfer_failures{expired}", _failures(o, "expired")), split=True),
)
