"""What `serve_bench.py` sends and how it judges the answers: streamed requests through the router's
OpenAI API, closed-loop and open-loop (Poisson) arrivals, per-request SLO attainment, and the
search for goodput.

Goodput, as DistServe (Zhong et al., OSDI 2024) defines it: the highest request rate, arrivals
Poisson, at which at least `target` (90%) of the requests meet both their TTFT target and their
inter-token latency target. A request's ITL figure is the p99 of its own gaps between tokens (a
request of one token has none and meets any ITL target); a request that failed meets no tier.
The tiers are data (`Tier`, parsed from `name:ttft_s:itl_p99_ms`), so a run on a small model states
its own targets.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

# ---------------------------------------------------------------- statistics


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def percentiles_ms(xs: list[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 of seconds, in ms (None without samples)."""
    return {q: 1e3 * pct(xs, v) if xs else None for q, v in (("p50", .5), ("p90", .9), ("p99", .99))}


# ---------------------------------------------------------------- SLO tiers


@dataclass(frozen=True)
class Tier:
    """A latency target: TTFT ≤ ttft_s and the request's own ITL p99 ≤ itl_p99_s."""
    name: str
    ttft_s: float
    itl_p99_s: float

    @classmethod
    def parse(cls, text: str) -> Tier:
        """`name:ttft_s:itl_p99_ms`, e.g. `interactive:1.5:30`."""
        try:
            name, ttft_s, itl_ms = text.split(":")
            return cls(name, float(ttft_s), float(itl_ms) / 1e3)
        except ValueError:
            raise ValueError(f"a tier is NAME:TTFT_S:ITL_P99_MS, not {text!r}") from None

    def spec(self) -> str:
        return f"{self.name}:{self.ttft_s:g}:{1e3 * self.itl_p99_s:g}"

    def as_json(self) -> dict:
        return {"name": self.name, "ttft_s": self.ttft_s, "itl_p99_ms": 1e3 * self.itl_p99_s}


# DistServe's two tiers at ISL 8192 / OSL 1024 (issue 50); the target share of requests that meet one
TIERS = (Tier("interactive", 1.5, 0.030), Tier("batch", 4.0, 0.100))
TARGET = 0.90


def meets(record: dict, tier: Tier) -> bool:
    """Whether one request met `tier`: it succeeded, its TTFT and its own ITL p99 are within."""
    if record["error"] is not None:
        return False
    return record["ttft"] <= tier.ttft_s and (record["itl_p99"] is None or record["itl_p99"] <= tier.itl_p99_s)


def attainment(records: list[dict], tier: Tier) -> float:
    """Share of a level's requests (failed ones included) that met `tier`."""
    return sum(meets(r, tier) for r in records) / len(records) if records else 0.0


# ---------------------------------------------------------------- one request


def failed(sent: float, error: str, tokens: int = 0, retries: int = 0) -> dict:
    return {"sent": sent, "error": error, "ttft": None, "e2e": None, "done": time.perf_counter(), "itl": [],
            "itl_p99": None, "tokens": tokens, "retries": retries}


def finished(sent: float, stamps: list[float], tokens: int, retries: int = 0) -> dict:
    """The record of a request whose token chunks arrived at `stamps` (perf_counter seconds)."""
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return {"sent": sent, "error": None, "ttft": stamps[0] - sent, "e2e": stamps[-1] - sent, "done": stamps[-1],
            "itl": itl, "itl_p99": pct(itl, .99) if itl else None, "tokens": tokens, "retries": retries}


async def one(session: httpx.AsyncClient, url: str, prompt: list[int], osl: int) -> dict:
    """One streamed request; a 429 (the router's admission control: every decode worker's queue
    is full) is retried after its Retry-After, as a client of an OpenAI API does. TTFT and E2E
    count from the first attempt. A request that fails (HTTP error, error in the stream, fewer
    tokens than asked) is recorded with its error, not raised: it counts against attainment."""
    body = {"model": "v4serve", "prompt": prompt, "max_tokens": osl, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    sent = time.perf_counter()
    stamps, tokens, retries = [], 0, 0
    try:
        while not stamps:
            async with session.stream("POST", f"{url}/v1/completions", json=body) as resp:
                if resp.status_code == 429:
                    retries += 1
                    await resp.aread()
                    await asyncio.sleep(float(resp.headers.get("retry-after", 1.0)))
                    continue
                if resp.status_code != 200:
                    return failed(sent, f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}", 0, retries)
                async for line in resp.aiter_lines():
                    line = line.strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return failed(sent, f"stream error: {chunk['error']}", tokens, retries)
                    n = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                    if n:
                        stamps.append(time.perf_counter())
                        tokens += n
                if not stamps:
                    return failed(sent, "the stream ended without a token", 0, retries)
    except (httpx.HTTPError, ValueError) as e:  # ValueError: a chunk that is not JSON
        return failed(sent, f"{type(e).__name__}: {e}", tokens, retries)
    if tokens != osl:
        return failed(sent, f"asked for {osl} tokens (ignore_eos), got {tokens}", tokens, retries)
    return finished(sent, stamps, tokens, retries)


# ---------------------------------------------------------------- arrivals


def unit_arrivals(n: int, seed: int) -> list[float]:
    """Send times of n requests of a Poisson process of rate 1 (seeded exponential gaps), the
    first at 0. A run scales the same draw to every rate (`poisson_arrivals`), so two levels
    differ by their rate and not by their luck: the bisection of `search_goodput` compares like
    with like."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(1.0)
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the level's start) of n requests arriving at `rate` per second."""
    return [u / rate for u in unit_arrivals(n, seed)]


async def closed_loop(session, url: str, prompts: list[list[int]], osl: int, c: int, budget_s: float):
    """c clients, each sending its next request when its last one ends, until the prompts run
    out or `budget_s` has passed (requests in flight then finish). → (records, start)."""
    queue, rows = list(prompts), []
    start = time.perf_counter()

    async def client():
        while queue and time.perf_counter() - start < budget_s:
            rows.append(await one(session, url, queue.pop(), osl))

    await asyncio.gather(*(client() for _ in range(c)))
    return rows, start


async def open_loop(session, url: str, prompts: list[list[int]], osl: int, offsets: list[float], budget_s: float):
    """Each request sent at its own time (`offsets`, s from the start) whatever the others are
    doing; none is sent after `budget_s`. Each record holds its `scheduled` time. → (records, start)."""
    start = time.perf_counter()
    tasks = []
    for prompt, at in zip(prompts, offsets):
        if at > budget_s:
            break
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append((start + at, asyncio.create_task(one(session, url, prompt, osl))))
    rows = []
    for scheduled, task in tasks:
        rows.append(await task)
        rows[-1]["scheduled"] = scheduled
    return rows, start


# ---------------------------------------------------------------- a level's figures


def columns(records: list[dict], start: float) -> dict[str, list]:
    """Per-request figures, one list each (None where the request failed): enough to judge the
    level against other tiers later without running it again (`records_from_columns`)."""
    def ms(x):
        return None if x is None else round(1e3 * x, 3)
    return {"sent_s": [round(r["sent"] - start, 4) for r in records], "ttft_ms": [ms(r["ttft"]) for r in records],
            "itl_p99_ms": [ms(r["itl_p99"]) for r in records], "e2e_ms": [ms(r["e2e"]) for r in records],
            "ok": [int(r["error"] is None) for r in records]}


def records_from_columns(cols: dict[str, list]) -> list[dict]:
    """The records `meets` needs, back from `columns`."""
    def s(x):
        return None if x is None else x / 1e3
    return [{"error": None if ok else "failed", "ttft": s(t), "itl_p99": s(i)}
            for ok, t, i in zip(cols["ok"], cols["ttft_ms"], cols["itl_p99_ms"])]


def summarize(records: list[dict], start: float, isl: int, tiers: tuple[Tier, ...]) -> dict:
    """A level's figures: rates over (start → last token), TTFT / ITL (every gap of the level) /
    E2E / TPOT percentiles, the percentiles of the requests' own ITL p99, attainment per tier."""
    ok = [r for r in records if r["error"] is None]
    span = max((r["done"] for r in records), default=start) - start
    span = span if span > 0 else float("nan")
    out_tokens = sum(r["tokens"] for r in ok)
    errors = sorted({r["error"] for r in records if r["error"] is not None})
    level = {"requests": len(records), "failed": len(records) - len(ok), "seconds": span,
             "requests_per_s": len(ok) / span, "output_tok_s": out_tokens / span,
             "total_tok_s": (out_tokens + isl * len(ok)) / span,
             "ttft_ms": percentiles_ms([r["ttft"] for r in ok]),
             "itl_ms": percentiles_ms([g for r in ok for g in r["itl"]]),
             "e2e_ms": percentiles_ms([r["e2e"] for r in ok]),
             # time per output token after the first: a speculative step's tokens arrive together,
             # so its gaps (itl_ms) are bursts and pauses, and this is the figure to compare
             "tpot_ms": percentiles_ms([(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]),
             "request_itl_p99_ms": percentiles_ms([r["itl_p99"] for r in ok if r["itl_p99"] is not None]),
             "attainment": {t.name: attainment(records, t) for t in tiers},
             "retried_429": sum(r["retries"] for r in records), "errors": errors[:5]}
    scheduled = [r for r in records if "scheduled" in r]
    if len(scheduled) > 1:  # open loop: the rate the requests went out at, and how late the client was
        sends = sorted(r["sent"] for r in scheduled)
        level["arrival_rate"] = (len(sends) - 1) / (sends[-1] - sends[0]) if sends[-1] > sends[0] else float("nan")
        level["send_lag_ms_max"] = 1e3 * max(r["sent"] - r["scheduled"] for r in scheduled)
    level["per_request"] = columns(records, start)
    return level


# ---------------------------------------------------------------- goodput


async def search_goodput(measure: Callable[[float], Awaitable[dict]], tier: str, target: float, start: float,
                         precision: float, max_levels: int) -> dict:
    """The highest rate whose level meets `tier` for ≥ `target` of its requests. From `start`,
    double while the level passes (halve while it fails), then bisect between the highest passing
    and the lowest failing rate until they are within `precision` of each other (relative) or
    `max_levels` rates were measured. `measure(rate)` returns the level (its `attainment` per tier);
    it may return a level already run. Goodput is the highest passing rate (0 if none passed)."""
    seen: dict[float, float] = {}
    lo = hi = None
    rate = start
    while len(seen) < max_levels:
        seen[rate] = (await measure(rate))["attainment"][tier]
        if seen[rate] >= target:
            lo = rate
        else:
            hi = rate
        if lo is None:
            rate = hi / 2
        elif hi is None:
            rate = lo * 2
        elif hi / lo - 1 <= precision:
            break
        else:
            rate = (lo + hi) / 2

    def bracket(r):
        return None if r is None else {"rate": r, "attainment": seen[r]}
    return {"requests_per_s": lo or 0.0, "passing": bracket(lo), "failing": bracket(hi),
            "converged": lo is not None and hi is not None and hi / lo - 1 <= precision,
            "levels": [{"rate": r, "attainment": a} for r, a in seen.items()]}
