"""Served load against a running v4serve: ISL/OSL requests at fixed concurrencies through the
router's OpenAI HTTP API, streamed, the way SGLang's `bench_serving --max-concurrency` drives a
server (closed loop: each of c clients sends its next request when its last one ends).

    v4serve up ... &                       # any deployment (P/D or aggregated)
    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --isl 8192 --osl 1024 \\
        --concurrency 1 16 64 256 --gpus 4 --label pd --out serve.json

Prompts are random token ids (distinct per request, so no prefix-cache hits), sent as
`prompt` id lists with `ignore_eos` so every request produces exactly OSL tokens;
`return_token_ids` makes each streamed chunk carry its tokens. Per level:

* TTFT: request sent → first token; ITL: the gaps between a request's token chunks (one token
  each on a decode step); E2E: sent → last token. Percentiles over the level's requests / gaps.
* output tok/s: tokens produced / (first request sent → last request done); total tok/s adds the
  prompt tokens; both also per GPU (`--gpus`).
* KV transfer per request: the router's `v4serve_kv_transfer_wire_seconds` histogram (the
  sender's first write posted → verified on the decode worker), its mean over the level from
  /metrics before and after; also reservation → verified (`v4serve_kv_transfer_seconds`, which
  holds the wait for the prefill), and the transfers that failed by reason (the decode worker then
  prefilled the request itself).

Against: the same run on an aggregated deployment of the same GPUs (P/D is judged by what it
gains or loses there, at each concurrency), and SGLang's published figures for V4-Flash on 4×
H200 (TP4, FP4 experts; total tok/s per GPU at the same ISL / OSL) for scale.

A level stops sending new requests after `--level-budget-s` (the requests in flight finish), so
a slow level reports fewer requests than asked for rather than running on; the JSON says how many.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from pathlib import Path

import httpx


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def percentiles_ms(xs: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 of seconds, in ms."""
    return {q: 1e3 * pct(xs, v) for q, v in (("p50", .5), ("p90", .9), ("p99", .99))}


async def one(session: httpx.AsyncClient, url: str, prompt: list[int], osl: int) -> dict:
    """One streamed request; a 429 (the router's admission control: every decode worker's queue
    is full) is retried after its Retry-After, as a client of an OpenAI API does. TTFT and E2E
    count from the first attempt."""
    body = {"model": "v4serve", "prompt": prompt, "max_tokens": osl, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    sent = time.perf_counter()
    stamps, tokens, retries = [], 0, 0
    while not stamps:
        async with session.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code == 429:
                retries += 1
                await resp.aread()
                await asyncio.sleep(float(resp.headers.get("retry-after", 1.0)))
                continue
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                n = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                if n:
                    stamps.append(time.perf_counter())
                    tokens += n
    if tokens != osl:
        raise RuntimeError(f"asked for {osl} tokens (ignore_eos), got {tokens}")
    return {"sent": sent, "ttft": stamps[0] - sent, "e2e": stamps[-1] - sent, "done": stamps[-1],
            "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": tokens, "retries": retries}


async def transfer_totals(session: httpx.AsyncClient, url: str) -> dict[str, float]:
    """Sums and counts of the router's KV transfer histograms: `wire` (first write posted →
    verified) and `reserved` (decode reservation → verified, the wait for the prefill included)."""
    text = (await session.get(f"{url}/metrics")).text
    got = {}
    for key, name in (("wire", "v4serve_kv_transfer_wire_seconds"), ("reserved", "v4serve_kv_transfer_seconds")):
        for suffix in ("sum", "count"):
            m = re.search(rf"^{name}_{suffix} ([0-9.e+-]+)$", text, re.M)
            got[f"{key}_{suffix}"] = float(m.group(1)) if m else 0.0
    for reason, value in re.findall(r'^v4serve_kv_transfer_failures_total\{reason="([^"]+)"\} ([0-9.e+-]+)$', text, re.M):
        got[f"failed_{reason}"] = float(value)
    return got


def mean_ms(before: dict, after: dict, key: str) -> float | None:
    n = after[f"{key}_count"] - before[f"{key}_count"]
    return 1e3 * (after[f"{key}_sum"] - before[f"{key}_sum"]) / n if n else None


async def level(session, url: str, c: int, n: int, isl: int, osl: int, vocab: int, seed: int,
                budget_s: float) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(isl)] for _ in range(n)]
    before = await transfer_totals(session, url)
    start = time.perf_counter()
    rows: list[dict] = []

    async def client():
        while prompts and time.perf_counter() - start < budget_s:
            rows.append(await one(session, url, prompts.pop(), osl))

    await asyncio.gather(*(client() for _ in range(c)))
    after = await transfer_totals(session, url)
    span = max(r["done"] for r in rows) - start
    itl = [g for r in rows for g in r["itl"]]
    out_tokens = sum(r["tokens"] for r in rows)
    return {"concurrency": c, "requests": len(rows), "asked": n, "seconds": span,
            "output_tok_s": out_tokens / span, "total_tok_s": (out_tokens + isl * len(rows)) / span,
            "ttft_ms": percentiles_ms([r["ttft"] for r in rows]), "itl_ms": percentiles_ms(itl),
            "e2e_ms_p50": 1e3 * statistics.median(r["e2e"] for r in rows),
            "retried_429": sum(r["retries"] for r in rows),
            "kv_transfers": int(after["wire_count"] - before["wire_count"]),
            # KV the decode side recomputed instead (by reason: "expired" = its reservation's lease ran out)
            "kv_transfer_failures": {k.removeprefix("failed_"): int(v - before.get(k, 0.0))
                                     for k, v in after.items() if k.startswith("failed_") and v > before.get(k, 0.0)},
            "kv_transfer_ms_mean": mean_ms(before, after, "wire"),
            "kv_reserved_to_verified_ms_mean": mean_ms(before, after, "reserved")}


async def main_async(args) -> list[dict]:
    timeout = httpx.Timeout(args.read_timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as session:
        # sent at once, so the router spreads them over the workers: each worker process compiles
        # and allocates what its first prompt needs before the measured levels
        await asyncio.gather(*(one(session, args.url, [random.Random(-1 - i).randrange(2, args.vocab)
                                                       for _ in range(args.isl)], 4) for i in range(args.warmup)))
        out = []
        for k, c in enumerate(args.concurrency):
            n = max(c * args.rounds, args.min_requests)
            r = await level(session, args.url, c, n, args.isl, args.osl, args.vocab, seed=k, budget_s=args.level_budget_s)
            r.update(label=args.label, gpus=args.gpus, isl=args.isl, osl=args.osl,
                     output_tok_s_per_gpu=r["output_tok_s"] / args.gpus, total_tok_s_per_gpu=r["total_tok_s"] / args.gpus)
            print(json.dumps(r), flush=True)
            out.append(r)
            if args.out:  # after every level: a later one may not finish
                args.out.write_text(json.dumps(out, indent=1))
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--isl", type=int, default=8192)
    ap.add_argument("--osl", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--rounds", type=int, default=1, help="requests per level = concurrency × rounds")
    ap.add_argument("--min-requests", type=int, default=1)
    ap.add_argument("--level-budget-s", type=float, default=600.0, help="stop sending new requests after this")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--gpus", type=int, default=1, help="GPUs of the deployment (per-GPU rates)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests, sent at once (≥ 2 per worker)")
    ap.add_argument("--read-timeout-s", type=float, default=600.0)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = asyncio.run(main_async(args))
    print("| c | requests | output tok/s/GPU | total tok/s/GPU | TTFT p50 / p99 ms | ITL p50 / p90 / p99 ms | KV transfer ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        kv = "–" if r["kv_transfer_ms_mean"] is None else f"{r['kv_transfer_ms_mean']:.1f}"
        print(f"| {r['concurrency']} | {r['requests']} | {r['output_tok_s_per_gpu']:.0f} | {r['total_tok_s_per_gpu']:.0f} | "
              f"{r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f} | {r['itl_ms']['p50']:.1f} / {r['itl_ms']['p90']:.1f} / "
              f"{r['itl_ms']['p99']:.1f} | {kv} |")


if __name__ == "__main__":
    main()
