"""Autoscaling policy for the prefill and decode pools: a pure function of load reports and time.

No I/O and no clock: `decide(policy, state, loads, now)` returns the next `PoolState` (whose
`replicas` is the desired size of the pool) and the actuator (cluster/autoscale_actuator.py)
makes it so. The same inputs always give the same answer, so the tests replay traces.

Signals, from the `WorkerLoad`s the workers publish (a draining worker is leaving: it counts
neither as capacity nor as demand):

    pool      signal                          per-worker target T
    prefill   queued prefill tokens           `target` tokens
    decode    waiting requests                `target` requests
    decode    KV pages in use (page pressure) `page_target` x the pages of one worker

For each signal with amount A, T and hysteresis h, with n the current replica count:

    scale up    when A / n > T·(1+h)               to ceil(A / T)          (each worker ≤ T)
    scale down  when floor = ceil(A / (T·(1-h))) < n  to floor             (each worker ≤ T·(1-h))

With several signals the pool goes up if any signal asks (to the largest ask) and down only as
far as the largest floor. A constant load cannot flap: after going up to ceil(A/T) every worker
holds ≤ T < T·(1+h) and the floor is ≥ ceil(A/T); after going down to the floor every worker
holds ≤ T·(1-h). Against loads that swing across the band there is more:

* scale up only if every sample of the last `up_window_s` asks for it (0: the latest alone), to
  the smallest of those asks; scale down to the largest floor of the last `down_window_s`, and
  only once the pool has been watched for that long;
* cooldowns: `up_cooldown_s` after a scale-up before the next one, `down_cooldown_s` after any
  change before a scale-down;
* at most `max_step_up` / `max_step_down` workers per decision, always within [min, max].

A pool with replicas but no reports at all (every worker still starting, or the registry down)
holds: there is nothing to decide on.

The P:D ratio (`pd_ratio`, docs/cluster.md "Choosing the P:D ratio"): at a steady arrival rate λ
the prefill pool must compute λ·I prompt tokens a second and the decode pool emit λ·O tokens,
so with X_P prefill tokens/s a prefill worker sustains within the TTFT target and X_D output
tokens/s a decode worker sustains within the ITL target,

    prefill workers / decode workers = (I / O) · (X_D / X_P)        (`pd_ratio(...)`)

The decode pool follows the steady load (its running batch and pages); the prefill signal, a
queue, only rises once requests already wait. So with a ratio r the decode pool is decided first
and the prefill pool's minimum is raised to ceil(r · decode replicas) (within its max): prefill
capacity arrives with the load that needs it, the queue signal still adds workers for bursts
above it, and a scale-down never goes below it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from worker_runtime.wire import WorkerLoad

POOLS = ("prefill", "decode")


# --- configuration ------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolPolicy:
    min_replicas: int
    max_replicas: int
    target: float  # per worker: queued prefill tokens (prefill) or waiting requests (decode)
    page_target: float | None = None  # fraction of a worker's KV pages in use; None: not a signal
    hysteresis: float = 0.2
    up_window_s: float = 0.0
    down_window_s: float = 60.0
    up_cooldown_s: float = 15.0
    down_cooldown_s: float = 120.0
    max_step_up: int = 4
    max_step_down: int = 1

    def __post_init__(self):
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, max >= 1; got {self.min_replicas}, "
                             f"{self.max_replicas}")
        if not self.target > 0:
            raise ValueError(f"target must be > 0, got {self.target}")
        if self.page_target is not None and not 0 < self.page_target <= 1:
            raise ValueError(f"page_target must be in (0, 1], got {self.page_target}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis must be in [0, 1), got {self.hysteresis}")
        for name in ("up_window_s", "down_window_s", "up_cooldown_s", "down_cooldown_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise ValueError("max_step_up and max_step_down must be >= 1")


def pd_ratio(prompt_tokens: float, output_tokens: float, prefill_tokens_per_s: float,
             decode_tokens_per_s: float) -> float:
    """Prefill workers per decode worker that keep both pools at their per-worker throughput at the
    SLO for a workload of `prompt_tokens` uncached prompt tokens and `output_tokens` generated
    tokens per request: (I / O) · (X_D / X_P). The rates are per worker (one replica, however
    many GPUs it spans), measured at the SLO: X_P the prefill tokens/s one prefill worker sustains
    with TTFT in target, X_D the output tokens/s one decode worker sustains with ITL in target."""
    for name, v in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens),
                    ("prefill_tokens_per_s", prefill_tokens_per_s), ("decode_tokens_per_s", decode_tokens_per_s)):
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    return (prompt_tokens / output_tokens) * (decode_tokens_per_s / prefill_tokens_per_s)


@dataclass(frozen=True)
class AutoscalerConfig:
    prefill: PoolPolicy = PoolPolicy(min_replicas=1, max_replicas=8, target=8192)
    decode: PoolPolicy = PoolPolicy(min_replicas=1, max_replicas=8, target=4, page_target=0.85)
    interval_s: float = 5.0  # how often the actuator observes and decides
    # prefill workers per decode worker (`pd_ratio`): the prefill pool keeps at least
    # ceil(pd_ratio · decode replicas); None: the pools scale on their own signals alone
    pd_ratio: float | None = None

    def __post_init__(self):
        if self.decode.min_replicas < 1:
            raise ValueError("decode.min_replicas must be >= 1: without a decode worker nothing is served")
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if self.pd_ratio is not None and not self.pd_ratio > 0:
            raise ValueError(f"pd_ratio must be > 0 or None, got {self.pd_ratio}")

    def pool(self, name: str) -> PoolPolicy:
        return {"prefill": self.prefill, "decode": self.decode}[name]

    @classmethod
    def from_dict(cls, d: dict) -> "AutoscalerConfig":
        """From JSON such as the Helm chart's autoscale ConfigMap:
        {"interval_s": 5, "prefill": {PoolPolicy fields}, "decode": {...}, "pd_ratio": 1.0}; unknown
        keys are errors."""
        unknown = set(d) - {"interval_s", "prefill", "decode", "pd_ratio"}
        if unknown:
            raise ValueError(f"unknown autoscaler settings: {sorted(unknown)}")
        base = cls()
        return cls(prefill=PoolPolicy(**d["prefill"]) if "prefill" in d else base.prefill,
                   decode=PoolPolicy(**d["decode"]) if "decode" in d else base.decode,
                   interval_s=float(d.get("interval_s", base.interval_s)),
                   pd_ratio=None if d.get("pd_ratio") is None else float(d["pd_ratio"]))


# --- state and decision -------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    t: float
    up: int  # replicas this sample asks to go up to; 0: no scale-up asked
    floor: int  # fewest replicas that keep every signal at or below its low band


@dataclass(frozen=True)
class PoolState:
    replicas: int
    watched_since: float | None = None  # time of the first observation with reports
    last_up: float = -math.inf
    last_change: float = -math.inf
    samples: tuple[Sample, ...] = ()
    reason: str = "start"  # why `replicas` is what it is (logs, tests)


@dataclass(frozen=True)
class Signal:
    name: str
    amount: float
    per_worker: float  # the target T


def signals(pool: str, policy: PoolPolicy, loads: Sequence[WorkerLoad]) -> list[Signal]:
    """The scaling signals of one pool from its (non-draining) workers' reports."""
    if pool == "prefill":
        return [Signal("queued_prefill_tokens", sum(l.queued_prefill_tokens for l in loads), policy.target)]
    out = [Signal("waiting", sum(l.waiting for l in loads), policy.target)]
    sized = [l for l in loads if l.total_pages > 0]
    if policy.page_target is not None and sized:
        used = sum(l.total_pages - l.free_pages for l in sized)
        out.append(Signal("pages_in_use", used, policy.page_target * sum(l.total_pages for l in sized) / len(sized)))
    return out


def recommend(policy: PoolPolicy, n: int, sigs: Sequence[Signal]) -> Sample:
    """One sample's asks (time filled in by the caller)."""
    up, floor = 0, policy.min_replicas
    for s in sigs:
        if s.amount > 0 and (n == 0 or s.amount / n > s.per_worker * (1 + policy.hysteresis)):
            up = max(up, math.ceil(s.amount / s.per_worker))
        floor = max(floor, math.ceil(s.amount / (s.per_worker * (1 - policy.hysteresis))))
    return Sample(0.0, up, floor)


def decide(pool: str, policy: PoolPolicy, state: PoolState, loads: Iterable[WorkerLoad], now: float) -> PoolState:
    """The next state of `pool` (its `replicas` is the desired size) given the latest reports."""
    live = [l for l in loads if l.role == pool and not l.draining]
    n = state.replicas
    bounded = min(max(n, policy.min_replicas), policy.max_replicas)
    if bounded != n:  # bounds apply at once, whatever the cooldowns
        return replace(state, replicas=bounded, last_change=now, last_up=now if bounded > n else state.last_up,
                       samples=(), reason=f"bounds [{policy.min_replicas}, {policy.max_replicas}]")
    if not live and n > 0:
        return replace(state, reason="no reports: hold")

    rec = replace(recommend(policy, n, signals(pool, policy, live)), t=now)
    keep = max(policy.up_window_s, policy.down_window_s)
    samples = tuple(s for s in state.samples if s.t >= now - keep) + (rec,)
    watched = state.watched_since if state.watched_since is not None else now
    state = replace(state, samples=samples, watched_since=watched)

    up_window = [s for s in samples if s.t >= now - policy.up_window_s]
    up_to = min(s.up for s in up_window)
    if up_to > n:
        if now - state.last_up < policy.up_cooldown_s:
            return replace(state, reason="up: cooling down")
        target = min(up_to, n + policy.max_step_up, policy.max_replicas)
        if target <= n:
            return replace(state, reason="up: at max_replicas")
        return replace(state, replicas=target, last_up=now, last_change=now, reason=f"up: asks {up_to}")

    floor = max(s.floor for s in samples if s.t >= now - policy.down_window_s)
    if floor < n:
        if now - watched < policy.down_window_s:
            return replace(state, reason="down: window not yet observed")
        if now - state.last_change < policy.down_cooldown_s:
            return replace(state, reason="down: cooling down")
        target = max(floor, n - policy.max_step_down, policy.min_replicas)
        return replace(state, replicas=target, last_change=now, reason=f"down: floor {floor}")
    return replace(state, reason="hold")


class Autoscaler:
    """Both pools' states; `step(loads, now)` → desired replicas per pool."""

    def __init__(self, config: AutoscalerConfig, replicas: dict[str, int]):
        self.config = config
        self.states = {p: PoolState(replicas[p]) for p in POOLS}

    def step(self, loads: Iterable[WorkerLoad], now: float) -> dict[str, int]:
        loads, cfg = list(loads), self.config
        self.states["decode"] = decide("decode", cfg.decode, self.states["decode"], loads, now)
        prefill = cfg.prefill
        if cfg.pd_ratio is not None:  # the ratio rule: a floor under the prefill pool, from the decode pool
            floor = min(math.ceil(cfg.pd_ratio * self.states["decode"].replicas - 1e-9), prefill.max_replicas)
            prefill = replace(prefill, min_replicas=max(prefill.min_replicas, floor))
        self.states["prefill"] = decide("prefill", prefill, self.states["prefill"], loads, now)
        return {p: s.replicas for p, s in self.states.items()}

    def reasons(self) -> dict[str, str]:
        return {p: s.reason for p, s in self.states.items()}
