"""Served load against a running v4serve: ISL/OSL requests through the router's OpenAI HTTP API,
streamed, at fixed concurrencies (closed loop, the way SGLang's `bench_serving --max-concurrency`
drives a server: each of c clients sends its next request when its last one ends), at fixed
request rates (open loop: Poisson arrivals, each request sent at its time whatever the others
do), and the goodput of each SLO tier (DistServe): the highest Poisson rate at which ≥ 90% of
the requests meet both the tier's TTFT and its ITL p99 target.

    v4serve up ... &                       # any deployment (P/D or aggregated)
    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --isl 8192 --osl 1024 \\
        --concurrency 1 16 64 256 --gpus 4 --label pd --out serve.json
    python benchmarks/serve_bench.py --isl 8192 --osl 1024 --gpus 4 --label pd --out goodput.json \\
        --goodput interactive batch --start-rate 1 --rate-requests 100

Prompts are random token ids (distinct per request, so no prefix-cache hits), sent as
`prompt` id lists with `ignore_eos` so every request produces exactly OSL tokens;
`return_token_ids` makes each streamed chunk carry its tokens. Per level:

* TTFT: request sent → first token; ITL: the gaps between a request's token chunks (one token
  each on a decode step); E2E: sent → last token. Percentiles over the level's requests / gaps,
  and over the requests' own ITL p99 (what a tier judges).
* output tok/s: tokens produced / (first request sent → last request done); total tok/s adds the
  prompt tokens; both also per GPU (`--gpus`).
* attainment per tier: the share of the level's requests that met it; a failed request (HTTP
  error, error in the stream, fewer tokens) meets none. Tiers: `--slo NAME:TTFT_S:ITL_P99_MS`,
  by default interactive (1.5 s, 30 ms) and batch (4 s, 100 ms) for ISL 8192 / OSL 1024; a small
  model on a CPU states its own.
* KV transfer per request: the router's `v4serve_kv_transfer_wire_seconds` histogram (the
  sender's first write posted → verified on the decode worker), its mean over the level from
  /metrics before and after; also reservation → verified (`v4serve_kv_transfer_seconds`, which
  holds the wait for the prefill), and the transfers that failed by reason.
* decode-side prefills: every request whose prompt its decode worker prefilled itself, by reason
  (the router's `v4serve_decode_prefills_total{reason}`, before and after the level):
  `short_prompt` / `no_prefill_worker` (placement), `expired`, `no_room`, `corrupt`, ... (the
  decode worker's). At ISL 8192 every request should be prefilled remotely: any count here is one
  the P/D figures partly measured as aggregated.

Goodput (`--goodput TIER...`): from `--start-rate`, double the rate while ≥ `--attainment` of a
level's requests meet the tier, halve while they do not, then bisect between the highest passing
and the lowest failing rate to `--precision` (relative) or `--max-levels` rates a tier. A level
holds `--rate-requests` requests; every rate of the run scales the same seeded arrival draw, and a
level measured for one tier serves the others. Every level run is kept in the JSON, with each
request's TTFT and ITL p99, so `--resume` of that file (same deployment) judges its levels
against the tiers of this run and runs only the rates it lacks: a search can go on across
commands of limited length.

Against: the same run on an aggregated deployment of the same GPUs (P/D is judged by what it
gains or loses there), and SGLang's published figures for V4-Flash on 4× H200 (TP4, FP4 experts;
total tok/s per GPU at the same ISL / OSL) for scale. `plot_results.py --latency-load` draws the
latency and attainment against rate of several runs on one figure.

A level stops sending new requests after `--level-budget-s` (the requests in flight finish), so
a slow level reports fewer requests than asked for rather than running on; the JSON says how many.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving_load import (TARGET, TIERS, Tier, closed_loop, meets, one, open_loop,  # noqa: E402
                                     poisson_arrivals, records_from_columns, search_goodput, summarize)
from benchmarks.serving_load import pct  # noqa: E402,F401  (pd_bench.py imports it from here)


async def transfer_totals(session: httpx.AsyncClient, url: str) -> dict[str, float]:
    """Sums and counts of the router's KV transfer histograms: `wire` (first write posted →
    verified) and `reserved` (decode reservation → verified, the wait for the prefill included)."""
    return parse_totals((await session.get(f"{url}/metrics")).text)


def parse_totals(text: str) -> dict[str, float]:
    """transfer_totals of a /metrics page."""
    got = {}
    for key, name in (("wire", "v4serve_kv_transfer_wire_seconds"), ("reserved", "v4serve_kv_transfer_seconds")):
        for suffix in ("sum", "count"):
            m = re.search(rf"^{name}_{suffix} ([0-9.e+-]+)$", text, re.M)
            got[f"{key}_{suffix}"] = float(m.group(1)) if m else 0.0
    for reason, value in re.findall(r'^v4serve_kv_transfer_failures_total\{reason="([^"]+)"\} ([0-9.e+-]+)$', text, re.M):
        got[f"failed_{reason}"] = float(value)
    for reason, value in re.findall(r'^v4serve_decode_prefills_total\{reason="([^"]+)"\} ([0-9.e+-]+)$', text, re.M):
        got[f"decode_prefill_{reason}"] = float(value)
    return got


def deltas(before: dict, after: dict, prefix: str) -> dict[str, int]:
    """Per reason, how much the counters named `prefix<reason>` grew over a level."""
    return {k.removeprefix(prefix): int(v - before.get(k, 0.0))
            for k, v in after.items() if k.startswith(prefix) and v > before.get(k, 0.0)}


def mean_ms(before: dict, after: dict, key: str) -> float | None:
    n = after[f"{key}_count"] - before[f"{key}_count"]
    return 1e3 * (after[f"{key}_sum"] - before[f"{key}_sum"]) / n if n else None


def dumps(obj) -> str:
    """Indented JSON with each list of numbers on one line (the per-request columns)."""
    return re.sub(r"\[[^\[\]{}\"]*\]", lambda m: re.sub(r"\s+", " ", m.group(0)).replace("[ ", "[").replace(" ]", "]"),
                  json.dumps(obj, indent=1))


class Bench:
    """One run: the levels measured so far (by concurrency and by rate, a resumed file's
    included) and the JSON they are written to after each."""

    def __init__(self, session: httpx.AsyncClient, args, tiers: tuple[Tier, ...]):
        self.session, self.args, self.tiers = session, args, tiers
        self.out = {"label": args.label, "gpus": args.gpus, "isl": args.isl, "osl": args.osl,
                    "rate_requests": args.rate_requests, "seed": args.seed,
                    "slo": {"target": args.attainment, "tiers": [t.as_json() for t in tiers],
                            "meets": "TTFT ≤ ttft_s and the request's own ITL p99 ≤ itl_p99_ms; a failed request meets none"},
                    "goodput": {}, "levels": []}
        self.by_rate: dict[float, dict] = {}
        self.by_concurrency: dict[int, dict] = {}

    def keep(self, level: dict) -> None:
        self.out["levels"].append(level)
        if level["mode"] == "poisson":
            self.by_rate[level["rate"]] = level
        else:
            self.by_concurrency[level["concurrency"]] = level
        self.save()

    def save(self) -> None:
        if self.args.out:  # after every level: a later one may not finish
            self.args.out.write_text(dumps(self.out))

    def resume(self, path: Path) -> None:
        """Keep the levels of an earlier run of the same shape, judged against this run's tiers."""
        old = json.loads(path.read_text())
        for key in ("isl", "osl", "rate_requests", "seed"):  # the same levels, or they would not compare
            if old.get(key) != self.out[key]:
                raise SystemExit(f"--resume {path}: its {key} is {old.get(key)}, this run's {self.out[key]}")
        for level in old["levels"]:
            records = records_from_columns(level["per_request"])
            level["attainment"] = {t.name: sum(meets(r, t) for r in records) / len(records) if records else 0.0
                                   for t in self.tiers}
            self.keep(level)

    async def level(self, mode: str, value: float, n: int) -> dict:
        a = self.args
        rng = random.Random(f"prompts {a.seed} {len(self.out['levels'])}")  # distinct from every other level's
        prompts = [[rng.randrange(2, a.vocab) for _ in range(a.isl)] for _ in range(n)]
        before = await transfer_totals(self.session, a.url)
        if mode == "closed":
            rows, start = await closed_loop(self.session, a.url, prompts, a.osl, int(value), a.level_budget_s)
            head = {"mode": "closed", "concurrency": int(value)}
        else:
            offsets = poisson_arrivals(n, value, a.seed)
            rows, start = await open_loop(self.session, a.url, prompts, a.osl, offsets, a.level_budget_s)
            head = {"mode": "poisson", "rate": value}
        after = await transfer_totals(self.session, a.url)
        level = {**head, "asked": n, **summarize(rows, start, a.isl, self.tiers)}
        level.update(
            output_tok_s_per_gpu=level["output_tok_s"] / a.gpus, total_tok_s_per_gpu=level["total_tok_s"] / a.gpus,
            kv_transfers=int(after["wire_count"] - before["wire_count"]),
            # KV the decode side recomputed instead (by reason: "expired" = its reservation's lease ran out)
            kv_transfer_failures=deltas(before, after, "failed_"),
            # requests prefilled on their decode worker, by reason (placement's or the decode worker's)
            decode_prefills=deltas(before, after, "decode_prefill_"),
            kv_transfer_ms_mean=mean_ms(before, after, "wire"),
            kv_reserved_to_verified_ms_mean=mean_ms(before, after, "reserved"))
        print(json.dumps({k: v for k, v in level.items() if k != "per_request"}), flush=True)
        self.keep(level)
        return level

    async def at_rate(self, rate: float) -> dict:
        return self.by_rate.get(rate) or await self.level("poisson", rate, self.args.rate_requests)


async def warmup_for(session: httpx.AsyncClient, url: str) -> int:
    """Two warm-up requests per worker the router's /health counts: a worker that never saw a
    prompt compiles its prefill kernels on its first, which a measured level would otherwise pay
    (seconds of TTFT on a GPU)."""
    health = (await session.get(f"{url}/health")).json()
    return 2 * max(1, health.get("prefill", 0) + health.get("decode", 0))


async def main_async(args, tiers: tuple[Tier, ...]) -> dict:
    timeout = httpx.Timeout(args.read_timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as session:
        bench = Bench(session, args, tiers)
        if args.resume:
            bench.resume(args.resume)
        # sent at once, so the router spreads them over the workers: each worker process compiles
        # and allocates what its first prompt needs before the measured levels
        warmup = args.warmup if args.warmup is not None else await warmup_for(session, args.url)
        warm = await asyncio.gather(*(one(session, args.url, [random.Random(-1 - i).randrange(2, args.vocab)
                                                              for _ in range(args.isl)], 4) for i in range(warmup)))
        if any(r["error"] for r in warm):
            raise SystemExit(f"warm-up failed: {[r['error'] for r in warm if r['error']][:3]}")
        for c in args.concurrency:
            if c not in bench.by_concurrency:
                await bench.level("closed", c, max(c * args.rounds, args.min_requests))
        for rate in args.rates:
            await bench.at_rate(rate)
        for name in args.goodput:
            g = await search_goodput(bench.at_rate, name, args.attainment, args.start_rate, args.precision,
                                     args.max_levels)
            g["requests_per_s_per_gpu"] = g["requests_per_s"] / args.gpus
            bench.out["goodput"][name] = g
            bench.save()
        return bench.out


def report(out: dict) -> None:
    """The levels and the goodput as Markdown."""
    names = [t["name"] for t in out["slo"]["tiers"]]
    print(f"| level | requests (failed) | output tok/s/GPU | total tok/s/GPU | TTFT p50 / p90 / p99 ms | "
          f"ITL p50 / p90 / p99 ms | attainment {' / '.join(names)} | KV transfer ms |")
    print("|---|---|---|---|---|---|---|---|")

    def f(x, spec):
        return "–" if x is None else format(x, spec)
    for r in sorted(out["levels"], key=lambda r: (r["mode"], r.get("concurrency") or r.get("rate"))):
        name = f"c={r['concurrency']}" if r["mode"] == "closed" else f"rate={r['rate']:g}/s"
        t, i = r["ttft_ms"], r["itl_ms"]
        print(f"| {name} | {r['requests']} ({r['failed']}) | {r['output_tok_s_per_gpu']:.0f} | {r['total_tok_s_per_gpu']:.0f} | "
              f"{f(t['p50'], '.0f')} / {f(t['p90'], '.0f')} / {f(t['p99'], '.0f')} | "
              f"{f(i['p50'], '.1f')} / {f(i['p90'], '.1f')} / {f(i['p99'], '.1f')} | "
              f"{' / '.join(format(r['attainment'][n], '.0%') for n in names)} | {f(r['kv_transfer_ms_mean'], '.1f')} |")
    for name, g in out["goodput"].items():
        lo, hi = g["passing"], g["failing"]
        print(f"goodput {name}: {g['requests_per_s']:.3g} requests/s ({g['requests_per_s_per_gpu']:.3g} per GPU); "
              f"passing {f(lo and lo['rate'], '.3g')}, failing {f(hi and hi['rate'], '.3g')}"
              f"{'' if g['converged'] else ' (not converged)'}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--isl", type=int, default=8192)
    ap.add_argument("--osl", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, nargs="*", default=None,
                    help="closed-loop levels (default 1 16 64 256 unless --rates or --goodput is given)")
    ap.add_argument("--rounds", type=int, default=1, help="requests per closed-loop level = concurrency × rounds")
    ap.add_argument("--min-requests", type=int, default=1)
    ap.add_argument("--rates", type=float, nargs="*", default=[], help="open-loop levels: Poisson arrivals, requests/s")
    ap.add_argument("--rate-requests", type=int, default=100, help="requests per open-loop level")
    ap.add_argument("--seed", type=int, default=0, help="of the arrival draw (and the prompts)")
    ap.add_argument("--slo", type=Tier.parse, nargs="+", default=list(TIERS), metavar="NAME:TTFT_S:ITL_P99_MS",
                    help=f"the SLO tiers (default {' '.join(t.spec() for t in TIERS)})")
    ap.add_argument("--attainment", type=float, default=TARGET,
                    help="share of a level's requests that must meet a tier for the rate to count")
    ap.add_argument("--goodput", nargs="*", default=[], metavar="TIER", help="search the goodput of these tiers")
    ap.add_argument("--start-rate", type=float, default=1.0, help="the goodput search's first rate (requests/s)")
    ap.add_argument("--precision", type=float, default=0.1, help="stop when failing / passing rate - 1 ≤ this")
    ap.add_argument("--max-levels", type=int, default=8, help="at most this many rates a tier's search measures")
    ap.add_argument("--resume", type=Path, default=None, help="a JSON of an earlier run: its levels are not run again")
    ap.add_argument("--level-budget-s", type=float, default=600.0, help="stop sending new requests after this")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--gpus", type=int, default=1, help="GPUs of the deployment (per-GPU rates)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up requests, sent at once (default: 2 per worker the router's /health counts)")
    ap.add_argument("--read-timeout-s", type=float, default=600.0)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    tiers = tuple(args.slo)
    if len({t.name for t in tiers}) != len(tiers):
        ap.error("--slo: tier names must differ")
    unknown = set(args.goodput) - {t.name for t in tiers}
    if unknown:
        ap.error(f"--goodput {' '.join(sorted(unknown))}: not a tier of --slo ({' '.join(t.name for t in tiers)})")
    if args.concurrency is None:
        args.concurrency = [] if args.rates or args.goodput else [1, 16, 64, 256]
    out = asyncio.run(main_async(args, tiers))
    report(out)
    return out


if __name__ == "__main__":
    main()
