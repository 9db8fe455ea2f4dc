"""Disaggregated (1P1D) against aggregated (one worker prefills and decodes) on the same trace.

Real Ray actors, Valkey registry and NIXL transfers, driven through the router's ClusterBackend
(no HTTP, so the numbers are the serving stack's own). Poisson arrivals; per request TTFT,
inter-token latency and end-to-end time; throughput = output tokens / makespan. Both setups get
the same number of CPU threads in total (1P1D: 1 + 1, aggregated: 2). The aggregated setup is
the baseline: disaggregation is judged by the TTFT, ITL and throughput it gains or loses on the
same trace and the same threads (tiny model: the serving stack's overheads, not the GPU's).

    python benchmarks/pd_bench.py --requests 48 --rate 2 --out pd.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serve_bench import pct  # noqa: E402
from cluster.launcher import ClusterOptions, LocalCluster  # noqa: E402
from cluster.settings import Environment  # noqa: E402
from model.checkpoint import expected_shapes, write_checkpoint  # noqa: E402
from model.tiny import random_weights, tiny_config  # noqa: E402
from model.tokenizer import ByteTokenizer  # noqa: E402
from router.cluster_backend import ClusterBackend  # noqa: E402
from router.config import PlacementConfig  # noqa: E402
from worker_runtime.options import WorkerOptions  # noqa: E402
from worker_runtime.registry import Registry  # noqa: E402
from worker_runtime.wire import GenerateRequest  # noqa: E402


def trace(n: int, rate: float, seed: int, prompt: tuple[int, int], max_tokens: int):
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append((t, GenerateRequest(f"b{i}", tuple(rng.randrange(256) for _ in range(rng.randint(*prompt))),
                                       max_tokens=max_tokens)))
    return out


async def drive(backend: ClusterBackend, work) -> list[dict]:
    start = time.perf_counter()

    async def one(at, req):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        sent = time.perf_counter()
        stamps, tokens = [], 0
        async for chunk in backend.generate(req):
            assert chunk.error is None, chunk.error
            stamps.append(time.perf_counter())
            tokens += len(chunk.token_ids)
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        return {"ttft": stamps[0] - sent, "e2e": stamps[-1] - sent, "itl": gaps, "tokens": tokens,
                "end": stamps[-1] - start}

    return await asyncio.gather(*(one(at, req) for at, req in work))


async def run_mode(mode: str, model_dir: str, work, threads_total: int) -> dict:
    prefill = 1 if mode == "1P1D" else 0
    options = WorkerOptions(model_dir, "", max_tokens=1024, max_seqs=32, threads=threads_total // (1 + prefill),
                            prefix_cache=False)
    cluster = LocalCluster(ClusterOptions(options, prefill=prefill, decode=1), Environment(None, None, Path("/tmp")))
    await asyncio.to_thread(cluster.start)
    try:
        backend = ClusterBackend(Registry(cluster.registry_url), ByteTokenizer(320), "tiny", 1024,
                                 PlacementConfig(remote_prefill_threshold=0))
        await backend.start()
        await backend.wait_for_workers(prefill=prefill, decode=1)
        await drive(backend, work[:4])  # warm-up: first calls compile / allocate
        rows = await drive(backend, work)
        await backend.stop()
    finally:
        await asyncio.to_thread(cluster.stop)
    itl = [g for r in rows for g in r["itl"]]
    makespan = max(r["end"] for r in rows)
    return {"mode": mode, "requests": len(rows), "output_tok_s": sum(r["tokens"] for r in rows) / makespan,
            "ttft_p50_ms": 1000 * pct([r["ttft"] for r in rows], 0.5),
            "ttft_p99_ms": 1000 * pct([r["ttft"] for r in rows], 0.99),
            "itl_p50_ms": 1000 * pct(itl, 0.5), "itl_p99_ms": 1000 * pct(itl, 0.99),
            "e2e_p50_ms": 1000 * statistics.median(r["e2e"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    ap.add_argument("--prompt", type=int, nargs=2, default=(200, 600))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads per setup, split over its workers")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    work = trace(args.requests, args.rate, 0, tuple(args.prompt), args.max_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = tiny_config()
        write_checkpoint(tmp, cfg, random_weights(expected_shapes(cfg, True), cfg, 0), "official")
        rows = [asyncio.run(run_mode(mode, tmp, work, args.threads)) for mode in ("aggregated", "1P1D")]
    print(f"requests={args.requests} rate={args.rate}/s prompt={args.prompt} max_tokens={args.max_tokens}")
    print("| setup | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | e2e p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['output_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
              f"{r['itl_p50_ms']:.0f} | {r['itl_p99_ms']:.0f} | {r['e2e_p50_ms']:.0f} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
