"""The autoscaling policy (cluster/autoscaler.py), table-driven: signal arithmetic, single
decisions, and whole traces replayed against a fake clock — including flapping loads, which
must not make the pools flap."""

from __future__ import annotations

import math

import pytest

from cluster.autoscaler import (
    POOLS,
    Autoscaler,
    AutoscalerConfig,
    PoolPolicy,
    PoolState,
    decide,
    pd_ratio,
    recommend,
    signals,
)
from worker_runtime.wire import WorkerLoad


def pre(i, tokens=0, draining=False):
    return WorkerLoad(f"prefill-{i}", "prefill", queued_prefill_tokens=tokens, draining=draining)


def dec(i, waiting=0, free=100, total=100, running=0, draining=False):
    return WorkerLoad(f"decode-{i}", "decode", waiting=waiting, running=running, free_pages=free,
                      total_pages=total, draining=draining)


PREFILL = PoolPolicy(min_replicas=1, max_replicas=6, target=1000, hysteresis=0.2, up_window_s=0,
                     down_window_s=10, up_cooldown_s=5, down_cooldown_s=20, max_step_up=4, max_step_down=1)
DECODE = PoolPolicy(min_replicas=1, max_replicas=4, target=4, page_target=0.8, hysteresis=0.2, up_window_s=0,
                    down_window_s=10, up_cooldown_s=5, down_cooldown_s=20, max_step_up=2, max_step_down=1)


# --- one sample: (pool, policy, replicas, loads) → (up ask, floor) -----------------------------
@pytest.mark.parametrize("name,pool,policy,n,loads,up,floor", [
    ("idle prefill", "prefill", PREFILL, 2, [pre(0), pre(1)], 0, 1),
    ("inside the band: no ask", "prefill", PREFILL, 2, [pre(0, 1100), pre(1, 1100)], 0, 3),
    ("above the band: up to ceil(A/T)", "prefill", PREFILL, 2, [pre(0, 2000), pre(1, 1000)], 3, 4),
    ("exactly at the upper edge: no ask", "prefill", PREFILL, 1, [pre(0, 1200)], 0, 2),
    ("zero replicas with demand: up", "prefill", PREFILL, 0, [pre(0, 10)], 1, 1),
    ("decode waiting", "decode", DECODE, 1, [dec(0, waiting=9)], 3, 3),
    ("decode page pressure alone", "decode", DECODE, 1, [dec(0, free=2)], 2, 2),
    ("pages inside the band: no ask", "decode", DECODE, 1, [dec(0, free=5)], 0, 2),
    ("pages below the band", "decode", DECODE, 2, [dec(0, free=60), dec(1, free=60)], 0, 2),
    ("pages and waiting: the larger ask", "decode", DECODE, 1, [dec(0, waiting=5, free=0)], 2, 2),
    ("workers without pages ignored for pages", "decode", DECODE, 1, [dec(0, total=0, free=0)], 0, 1),
])
def test_recommend(name, pool, policy, n, loads, up, floor):
    rec = recommend(policy, n, signals(pool, policy, loads))
    assert (rec.up, rec.floor) == (up, floor), name


def test_pages_signal_ignored_without_page_target():
    assert [s.name for s in signals("decode", PREFILL, [dec(0, free=0)])] == ["waiting"]


# --- traces: [(t, loads)] → replicas after each step ----------------------------------------
def run(pool, policy, start, trace):
    state, out = PoolState(start), []
    for t, loads in trace:
        state = decide(pool, policy, state, loads, t)
        out.append(state.replicas)
    return out, state


def ticks(t0, t1, loads, dt=1.0):
    return [(t0 + k * dt, loads) for k in range(int((t1 - t0) / dt))]


TRACES = [
    # name, pool, policy, start, trace, expected replicas per step
    ("steady in-band load never moves", "prefill", PREFILL, 2,
     ticks(0, 60, [pre(0, 1150), pre(1, 1150)]), [2] * 60),
    ("spike goes up at once, capped by max_step_up", "prefill", PREFILL, 1,
     [(0, [pre(0, 9000)]), (1, [pre(0, 9000)])], [5, 5]),
    ("up is capped by max_replicas", "prefill", PREFILL, 5,
     [(0, [pre(0, 50_000)])], [6]),
    ("up cooldown: the second rise waits 5 s", "prefill", PREFILL, 1,
     [(0, [pre(0, 2000)]), (2, [pre(0, 6000), pre(1, 0)]), (4.9, [pre(0, 6000), pre(1, 0)]),
      (5, [pre(0, 6000), pre(1, 0)])], [2, 2, 2, 6]),
    ("down waits for the window to be observed, then one step per cooldown", "prefill", PREFILL, 3,
     ticks(0, 61, [pre(0), pre(1), pre(2)]),
     [3] * 10 + [2] * 20 + [1] * 31),
    ("down to the largest floor of the window, not the latest", "prefill", PREFILL, 4,
     [(0, [pre(i, 900) for i in range(4)])] + ticks(1, 12, [pre(i, 0) for i in range(4)]),
     [4] * 11 + [3]),
    ("draining workers count neither as demand nor capacity", "prefill", PREFILL, 1,
     [(0, [pre(0, 100), pre(1, 50_000, draining=True)])], [1]),
    ("no reports: hold", "prefill", PREFILL, 3, ticks(0, 30, []), [3] * 30),
    ("below min: raised at once", "decode", DECODE, 0, [(0, [])], [1]),
    ("decode: waiting goes up by max_step_up, down one step per cooldown", "decode", DECODE, 1,
     [(0, [dec(0, waiting=12)]), (1, [dec(0, waiting=6), dec(1, waiting=6)])]
     + ticks(2, 40, [dec(0), dec(1)]),
     [3] * 20 + [2] * 20),
    ("decode: page pressure scales, then its floor holds", "decode", DECODE, 1,
     [(0, [dec(0, free=2)])] + ticks(1, 40, [dec(0, free=30), dec(1, free=100)]),
     [2] + [2] * 39),
]


@pytest.mark.parametrize("name,pool,policy,start,trace,expected", TRACES, ids=[t[0] for t in TRACES])
def test_trace(name, pool, policy, start, trace, expected):
    got, _ = run(pool, policy, start, trace)
    assert got == expected


def test_up_window_ignores_a_single_spike():
    policy = PoolPolicy(min_replicas=1, max_replicas=6, target=1000, up_window_s=3, down_window_s=10)
    trace = [(0, [pre(0, 0)]), (1, [pre(0, 5000)]), (2, [pre(0, 0)]), (3, [pre(0, 5000)]),
             (4, [pre(0, 5000)]), (5, [pre(0, 5000)]), (6, [pre(0, 5000)])]
    got, _ = run("prefill", policy, 1, trace)
    assert got == [1, 1, 1, 1, 1, 1, 5]  # asks only once every sample of the last 3 s asks


# --- flapping -------------------------------------------------------------------------------
def flapping(period_s, high, seconds, n_workers=lambda: 1, dt=0.5):
    """Queue alternates high/empty every `period_s` (a load that sits on the band's edges)."""
    return [(k * dt, high if (k * dt // period_s) % 2 == 0 else 0) for k in range(int(seconds / dt))]


@pytest.mark.parametrize("period_s", [0.5, 2, 7, 15, 40])
def test_square_wave_load_does_not_flap(period_s):
    """A queue swinging between 4 workers' worth and nothing: the pool goes up once and comes
    down at most once per down cooldown — never up/down on every swing."""
    state, changes, prev = PoolState(1), [], 1
    for t, tokens in flapping(period_s, 4000, 300):
        loads = [pre(i, tokens // state.replicas) for i in range(state.replicas)]
        state = decide("prefill", PREFILL, state, loads, t)
        if state.replicas != prev:
            changes.append((t, prev, state.replicas))
            prev = state.replicas
    ups = [c for c in changes if c[2] > c[1]]
    downs = [c for c in changes if c[2] < c[1]]
    for t, _, _ in downs:  # a scale-down never follows any change closer than the down cooldown
        prior = max(c[0] for c in changes if c[0] < t)
        assert t - prior >= PREFILL.down_cooldown_s, changes
    peaks = len({int(t // period_s) for t, tokens in flapping(period_s, 4000, 300) if tokens})
    assert len(ups) <= peaks, changes  # never up twice for one peak
    assert all(1 <= c[2] <= 4 for c in changes), changes  # never above what the peak needs
    if period_s * 2 < PREFILL.down_window_s:  # every window of observation holds a peak: up once
        assert [c[2] for c in changes] == [4] and not downs, changes


def test_noisy_load_around_target_is_stable():
    """Per-worker load jittering ±15% around the target (inside the ±20% band): no change."""
    state = PoolState(3)
    for k in range(600):
        jitter = 0.85 + 0.3 * ((k * 7919) % 101) / 100
        state = decide("prefill", PREFILL, state, [pre(i, int(1000 * jitter)) for i in range(3)], k * 0.5)
        assert state.replicas == 3, (k, state.reason)


def test_autoscaler_steps_both_pools():
    scaler = Autoscaler(AutoscalerConfig(prefill=PREFILL, decode=DECODE, interval_s=1), {"prefill": 1, "decode": 1})
    got = scaler.step([pre(0, 3500), dec(0, waiting=10)], now=0)
    assert got == {"prefill": 4, "decode": 3}
    assert scaler.reasons()["prefill"].startswith("up")


def test_pd_ratio_from_the_workload_and_the_per_worker_rates_at_the_slo():
    # ISL 8192 / OSL 1024: 8 prompt tokens per output token; a prefill worker does 8x a decode worker's tokens/s
    assert pd_ratio(8192, 1024, 20000, 2500) == pytest.approx(1.0)
    assert pd_ratio(8192, 1024, 40000, 2500) == pytest.approx(0.5)  # twice the prefill rate: half the workers
    assert pd_ratio(1024, 1024, 20000, 2500) == pytest.approx(0.125)  # short prompts: decode-heavy
    with pytest.raises(ValueError, match="decode_tokens_per_s"):
        pd_ratio(8192, 1024, 20000, 0)


def test_the_ratio_rule_keeps_prefill_in_step_with_decode():
    """With pd_ratio 1.5, the prefill pool follows the decode pool up at once (its queue empty),
    keeps its queue-driven scale-up above the floor, and scales down no lower than the floor."""
    prefill = PoolPolicy(min_replicas=1, max_replicas=8, target=1000, down_window_s=10, up_cooldown_s=0,
                         down_cooldown_s=10)
    decode = PoolPolicy(min_replicas=2, max_replicas=4, target=4)  # two decode workers throughout
    scaler = Autoscaler(AutoscalerConfig(prefill=prefill, decode=decode, interval_s=1, pd_ratio=1.5),
                        {"prefill": 1, "decode": 2})
    got = scaler.step([pre(0, 0), dec(0, waiting=0), dec(1, waiting=0)], now=0)
    assert got["prefill"] == 3  # ceil(1.5 · 2), though nothing is queued
    got = scaler.step([pre(i, 3000) for i in range(3)] + [dec(0), dec(1)], now=1)
    assert got["prefill"] == 7  # bursts still add workers on the queue signal: ceil(9000 / 1000) in steps of 4
    for t in range(2, 60):  # the queue drains: down, one worker a cooldown, to the ratio floor and no lower
        got = scaler.step([pre(i, 0) for i in range(got["prefill"])] + [dec(0), dec(1)], now=t)
    assert got == {"prefill": 3, "decode": 2}
    without = Autoscaler(AutoscalerConfig(prefill=prefill, decode=decode, interval_s=1), {"prefill": 1, "decode": 2})
    assert without.step([pre(0, 0), dec(0), dec(1)], now=0)["prefill"] == 1


def test_the_ratio_floor_is_capped_by_the_prefill_maximum():
    prefill = PoolPolicy(min_replicas=1, max_replicas=4, target=1000)
    scaler = Autoscaler(AutoscalerConfig(prefill=prefill, decode=DECODE, interval_s=1, pd_ratio=3.0),
                        {"prefill": 1, "decode": 2})
    assert scaler.step([pre(0, 0), dec(0), dec(1)], now=0)["prefill"] == 4
    with pytest.raises(ValueError, match="pd_ratio"):
        AutoscalerConfig(pd_ratio=0)
    assert AutoscalerConfig.from_dict({"pd_ratio": 1.25}).pd_ratio == 1.25


@pytest.mark.parametrize("kwargs", [
    dict(min_replicas=2, max_replicas=1, target=1),
    dict(min_replicas=0, max_replicas=0, target=1),
    dict(min_replicas=1, max_replicas=2, target=0),
    dict(min_replicas=1, max_replicas=2, target=1, page_target=1.5),
    dict(min_replicas=1, max_replicas=2, target=1, hysteresis=1.0),
    dict(min_replicas=1, max_replicas=2, target=1, down_cooldown_s=-1),
    dict(min_replicas=1, max_replicas=2, target=1, max_step_down=0),
])
def test_bad_policies_rejected(kwargs):
    with pytest.raises(ValueError):
        PoolPolicy(**kwargs)


def test_decode_min_must_be_positive():
    with pytest.raises(ValueError, match="decode"):
        AutoscalerConfig(decode=PoolPolicy(min_replicas=0, max_replicas=2, target=1))


def test_config_from_dict():
    got = AutoscalerConfig.from_dict({"interval_s": 2, "decode": {"min_replicas": 2, "max_replicas": 5, "target": 3,
                                                                   "page_target": 0.8}})
    assert got.interval_s == 2 and got.decode.max_replicas == 5 and got.prefill == AutoscalerConfig().prefill
    with pytest.raises(ValueError):
        AutoscalerConfig.from_dict({"intervals": 2})
    with pytest.raises(TypeError):
        AutoscalerConfig.from_dict({"prefill": {"min_replicas": 1, "max_replicas": 2, "target": 1, "typo": 1}})


def test_config_is_frozen():
    with pytest.raises(Exception):
        AutoscalerConfig().interval_s = 1  # type: ignore[misc]
    assert math.isinf(PoolState(1).last_up)


# --- the actuator's bookkeeping, against a fake cluster (no Ray) -------------------------------
class FakeCluster:
    """LocalCluster's actuator surface: add_worker / remove_worker, plus what the registry shows."""

    def __init__(self, prefill=1, decode=1):
        from types import SimpleNamespace

        self.options = SimpleNamespace(prefill=prefill, decode=decode)
        self.loads = {f"prefill-{i}": pre(i) for i in range(prefill)}
        self.loads.update({f"decode-{i}": dec(i) for i in range(decode)})
        self.next, self.removed, self.drained = prefill + decode, [], []
        self.gate = None  # a threading.Event that add_worker waits on, when set

    def add_worker(self, role):
        if self.gate is not None:
            self.gate.wait(5)
        wid = f"{role}-{self.next}"
        self.next += 1
        self.loads[wid] = WorkerLoad(wid, role, total_pages=100, free_pages=100)
        return wid

    def remove_worker(self, wid):
        self.removed.append(wid)
        self.loads.pop(wid, None)

    # the registry
    def workers(self):
        from types import SimpleNamespace

        return [SimpleNamespace(worker_id=w, load=l) for w, l in self.loads.items()]


@pytest.fixture
def fake(monkeypatch):
    import cluster.autoscale_actuator as act

    cluster = FakeCluster(prefill=1, decode=3)

    class Handle:
        def __init__(self, wid):
            self.wid = wid
            self.drain = self

        async def _drain(self, **kw):
            cluster.drained.append(self.wid)
            return {"worker_id": self.wid, "idle": True}

        def remote(self, **kw):
            return self._drain(**kw)

    monkeypatch.setattr(act.ray, "get_actor", lambda wid: Handle(wid))
    return cluster


def actuate(cluster, plan, options=None, clock=None):
    """Run ticks with desired sizes from `plan` (a list of dicts, one per tick)."""
    import asyncio

    from cluster.autoscale_actuator import ActuatorOptions, RayActuator

    async def run():
        steps = iter(plan)
        actuator = RayActuator(cluster, cluster, lambda loads, now: next(steps), options or ActuatorOptions(),
                               clock=clock or (lambda: 0.0))
        for _ in plan:
            await actuator.tick()
            await asyncio.sleep(0.05)
        await actuator.stop()
        return actuator

    return asyncio.run(run())


def test_actuator_drains_the_least_busy_then_removes(fake):
    fake.loads["decode-0"] = dec(0, running=3)
    fake.loads["decode-1"] = dec(1, running=0)
    fake.loads["decode-2"] = dec(2, running=1)
    actuator = actuate(fake, [{"prefill": 1, "decode": 2}, {"prefill": 1, "decode": 2}])
    assert fake.drained == ["decode-1"] and fake.removed == ["decode-1"]
    assert actuator.counts() == {"prefill": 1, "decode": 2}
    assert [e.kind for e in actuator.events if e.worker_id == "decode-1"] == ["drain", "drained", "removed"]


def test_actuator_adds_and_never_double_counts(fake):
    actuator = actuate(fake, [{"prefill": 3, "decode": 3}] * 3)
    assert sorted(w for w in fake.loads if w.startswith("prefill")) == ["prefill-0", "prefill-4", "prefill-5"]
    assert actuator.counts() == {"prefill": 3, "decode": 3} and not fake.drained


def test_actuator_cancels_a_starting_worker_before_draining_a_ready_one(fake):
    import threading

    fake.gate = threading.Event()
    plan = [{"prefill": 2, "decode": 3}, {"prefill": 1, "decode": 3}, {"prefill": 1, "decode": 3}]

    def release_after_plan():
        import time

        time.sleep(0.3)
        fake.gate.set()

    threading.Thread(target=release_after_plan, daemon=True).start()
    actuator = actuate(fake, plan + [{"prefill": 1, "decode": 3}] * 6)
    assert fake.drained == ["prefill-4"] and fake.removed == ["prefill-4"]  # the new one, once up
    assert "prefill-0" in fake.loads and actuator.counts()["prefill"] == 1


def test_actuator_replaces_a_lost_worker(fake):
    from cluster.autoscale_actuator import ActuatorOptions

    now = [0.0]

    def clock():
        now[0] += 5.0
        return now[0]

    del fake.loads["decode-2"]  # died: gone from the registry
    actuator = actuate(fake, [{"prefill": 1, "decode": 3}] * 4, ActuatorOptions(lost_after_s=8), clock)
    kinds = [(e.kind, e.worker_id) for e in actuator.events]
    assert ("lost", "decode-2") in kinds and "decode-4" in fake.loads
    assert actuator.counts() == {"prefill": 1, "decode": 3}


def test_actuator_follow_mode_never_drains(fake):
    from cluster.autoscale_actuator import ActuatorOptions

    actuate(fake, [{"prefill": 1, "decode": 1}] * 2, ActuatorOptions(scale_down=False))
    assert not fake.drained and not fake.removed


# --- the actuator on a real local Ray cluster -------------------------------------------------
# A load trace through the router's ClusterBackend drives the queues up and down; the Ray actuator
# grows and shrinks both pools within their bounds and cooldowns, drains before removing, and
# every request ends with exactly the tokens `generate` gives it alone (invariant 1).

RAY_PREFILL = PoolPolicy(min_replicas=1, max_replicas=2, target=16, hysteresis=0.2, up_window_s=0,
                         down_window_s=3, up_cooldown_s=2, down_cooldown_s=4, max_step_up=1, max_step_down=1)
RAY_DECODE = PoolPolicy(min_replicas=1, max_replicas=3, target=2, page_target=0.9, hysteresis=0.2, up_window_s=0,
                        down_window_s=3, up_cooldown_s=2, down_cooldown_s=4, max_step_up=1, max_step_down=1)
# (start second, number of requests): two bursts, a trickle while the pools shrink, then quiet
WAVES = [(0.0, 10), (1.5, 10), (3.0, 10)] + [(6.0 + 0.7 * k, 1) for k in range(10)]


@pytest.mark.cluster
@pytest.mark.exhaustive  # ~45-60 s of Ray pools growing and shrinking; the policy's cases above stay in CI
def test_ray_actuator_follows_a_load_trace(tiny_official_ckpt, tmp_path):
    pytest.importorskip("nixl")
    import asyncio
    import random
    import time

    import ray
    import torch

    from cluster.autoscale_actuator import ActuatorOptions, RayActuator, drain_node
    from cluster.launcher import ClusterOptions, LocalCluster
    from cluster.settings import Environment
    from model.checkpoint import load_checkpoint
    from model.generate import generate
    from model.kv_pool import KVPools
    from model.sampling import SamplingParams
    from model.tokenizer import load_tokenizer
    from router.cluster_backend import ClusterBackend
    from router.config import PlacementConfig
    from router.metrics import RouterMetrics
    from worker_runtime.options import WorkerOptions
    from worker_runtime.registry import Registry
    from worker_runtime.wire import GenerateRequest

    rng = random.Random(11)
    reqs = []
    for w, (start, n) in enumerate(WAVES):
        for i in range(n):
            sampling = SamplingParams() if i % 3 else SamplingParams(temperature=1.0, top_k=40, seed=100 * w + i)
            prompt = tuple(rng.randrange(256) for _ in range(rng.randrange(100, 200)))
            reqs.append((start, GenerateRequest(f"w{w}r{i}", prompt, max_tokens=rng.randrange(6, 13),
                                                sampling=sampling)))
    cfg, model = load_checkpoint(tiny_official_ckpt)
    stop_ids = frozenset({cfg.eos_token_id})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # several OpenMP threads on a busy 2-core machine are 10x slower
    try:
        expected = {r.request_id: generate(model, KVPools(cfg, "fp32", max_tokens=256, max_seqs=1),
                                           list(r.prompt_ids), r.max_tokens, r.sampling, stop_ids=stop_ids).token_ids
                    for _, r in reqs}
    finally:
        torch.set_num_threads(threads)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(resources={"prefill": RAY_PREFILL.max_replicas, "decode": RAY_DECODE.max_replicas},
             include_dashboard=False, log_to_driver=False, configure_logging=False)
    worker = WorkerOptions(str(tiny_official_ckpt), "", max_tokens=256, max_seqs=2, prefill_token_budget=64,
                           heartbeat_s=0.2)
    cluster = LocalCluster(ClusterOptions(worker, prefill=1, decode=1), Environment(None, None, tmp_path)).start()
    decisions = []  # (t, desired) whenever the policy's answer changes

    async def run():
        registry = Registry(cluster.registry_url)
        metrics = RouterMetrics()
        backend = ClusterBackend(registry, load_tokenizer(tiny_official_ckpt, cfg.vocab_size, cfg.bos_token_id,
                                                          cfg.eos_token_id), "v4serve", 256,
                                 PlacementConfig(remote_prefill_threshold=0), metrics, refresh_s=0.1)
        metrics.watch_pools(lambda: backend.loads.values(), lambda: {})
        await backend.start()
        await backend.wait_for_workers(1, 1)  # the first heartbeats may not be in the registry yet
        scaler = Autoscaler(AutoscalerConfig(prefill=RAY_PREFILL, decode=RAY_DECODE, interval_s=0.25),
                            {"prefill": 1, "decode": 1})

        def desired(loads, now):
            got = scaler.step(loads, now)
            if not decisions or decisions[-1][1] != got:
                decisions.append((now, dict(got)))
            return got

        actuator = RayActuator(cluster, registry, desired, ActuatorOptions(interval_s=0.25, settle_s=2.0)).start()
        t0 = time.monotonic()
        active = []  # (t, counts) sampled through the run
        queued = []  # the router's prefill-token gauge (KEDA's prefill signal), sampled alike

        async def one(start, req):
            await asyncio.sleep(max(0.0, t0 + start - time.monotonic()))
            tokens, errors = [], []
            try:
                async for chunk in backend.generate(req):
                    tokens.extend(chunk.token_ids)
                    if chunk.error:
                        errors.append(chunk.error)
            except Exception as e:  # a dropped request, however it shows
                errors.append(repr(e))
            return req.request_id, tokens, errors

        async def watch(until):
            while not until.done():
                active.append((time.monotonic(), actuator.counts()))
                queued.append(metrics.sample("v4serve_queued_prefill_tokens", {"pool": "prefill"}))
                await asyncio.sleep(0.1)

        traffic = asyncio.gather(*(one(s, r) for s, r in reqs))
        watcher = asyncio.create_task(watch(traffic))
        results = await traffic
        # quiet: wait for both pools to come back to their minimum (bounded: the test fails otherwise)
        deadline = time.monotonic() + 40
        while (actuator.counts() != {"prefill": 1, "decode": 1} or actuator._tasks) and time.monotonic() < deadline:
            active.append((time.monotonic(), actuator.counts()))
            await asyncio.sleep(0.2)
        await watcher
        await actuator.stop()
        await backend.stop()
        return results, active, actuator.events, queued

    try:
        results, active, events, queued = asyncio.run(run())
        accounting = [ray.get(a.page_accounting.remote(drop_cache=True)) for a in cluster.prefill]
        accounting += [ray.get(a.page_accounting.remote()) for a in cluster.decode]
        # the preStop path (drain-node): finds this node's prefill worker by name and drains it
        left = {e.worker_id for e in events if e.kind == "ready" and e.role == "prefill"} | {"prefill-0"}
        left -= {e.worker_id for e in events if e.kind == "removed"}
        node_drained = drain_node(ray.get_runtime_context().get_node_id(), ("prefill",), settle_s=0.3)
    finally:
        cluster.stop()
        ray.shutdown()

    # no request dropped, every output exact
    for rid, tokens, errors in results:
        assert not errors, (rid, errors, decisions)
        assert tokens == expected[rid], rid
    # the pools grew with the queues and came back, always within their bounds
    peak = {p: max(c[p] for _, c in active) for p in POOLS}
    assert peak["decode"] >= 2 and peak["prefill"] >= 2, (peak, decisions)
    for _, c in active:
        assert RAY_PREFILL.min_replicas <= c["prefill"] <= RAY_PREFILL.max_replicas
        assert RAY_DECODE.min_replicas <= c["decode"] <= RAY_DECODE.max_replicas
    assert active[-1][1] == {"prefill": 1, "decode": 1}, (active[-1], decisions)
    # the gauge a KEDA prefill scaler reads rose with the queues the policy scaled prefill on
    assert max(queued) > RAY_PREFILL.target * (1 + RAY_PREFILL.hysteresis), max(queued)
    # ...at the policy's pace: ups at least up_cooldown apart, downs down_cooldown after any change
    for pool, policy in (("prefill", RAY_PREFILL), ("decode", RAY_DECODE)):
        changes = [(t, d[pool]) for t, d in decisions]
        changes = [c for i, c in enumerate(changes) if i == 0 or c[1] != changes[i - 1][1]][1:]
        prev_t, prev_n, last_up = -1e9, 1, -1e9
        for t, n in changes:
            if n > prev_n:
                assert t - last_up >= policy.up_cooldown_s - 1e-6, (pool, changes)
                last_up = t
            else:
                assert t - prev_t >= policy.down_cooldown_s - 1e-6, (pool, changes)
            prev_t, prev_n = t, n
    # scale-down drained first: every removed worker was drained idle, none was lost
    kinds = [(e.kind, e.worker_id) for e in events]
    removed = [w for k, w in kinds if k == "removed"]
    assert removed and not [w for k, w in kinds if k in ("lost", "add_failed")], kinds
    for w in removed:
        drained = [e for e in events if e.kind == "drained" and e.worker_id == w]
        assert drained and drained[0].detail["idle"], (w, kinds)
    for acct in accounting:  # the pages of the workers left are all back
        assert acct["free"] == acct["idle"], acct
    assert sorted((d["worker_id"], d["idle"]) for d in node_drained) == sorted((w, True) for w in left)
