"""Placement quality: prefix-cache hit rate on a multi-turn, shared-prefix trace with 4 prefill
workers — our prefix-affinity policy vs the ideal (oracle) vs sglang-router's (and vllm-router's)
cache-aware policy, on the same trace and the same simulated workers.

The trace: conversations that share one of a few long system prompts, each with several turns;
turn k's prompt is the whole conversation so far in the DeepSeek-V4 chat encoding (byte tokens).
Conversations start staggered and their turns are spaced out, so turns of many conversations
interleave. Every request has an arrival time.

The workers (identical for every policy): each holds an LRU prefix cache of `--capacity-pages`
pages of `--page-size` tokens keyed by the chained page hashes of worker_runtime.wire (prefix pages
are evicted last, like a radix cache), and prefills FIFO at `--prefill-rate` tokens/s, paying only
for uncached tokens. A request's hit = the leading pages its worker already held.

How each policy is driven:
- ours: offline, in simulated time: at each arrival, the workers' queued prefill tokens and our
  PrefixIndex (fed by the workers' stored/evicted KVEvents as they happen) go to
  `router.placement.pick_prefill`. (Events reach the index instantly here; in the cluster they
  travel through Redis.)
- round-robin: the same simulation with a rotating choice (a floor).
- oracle: the longest page prefix seen in *any* earlier request (unbounded cache, placement-free):
  no placement can beat it.
- sglang-router / vllm-router `--policy cache_aware`: for real, over HTTP on loopback: the trace is
  replayed open-loop at its arrival times as /v1/completions requests through the router to 4
  in-process stub HTTP workers running the same cache and FIFO model in real time (their queues
  are what the router's load balancing sees). These routers place by an approximate radix tree of
  the *text* they routed, not by worker events.

    python benchmarks/placement_bench.py [--routers-python /path/venv/bin/python]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.router_bench import fast_byte_tokenizer, free_port  # noqa: E402
from router.chat_encoding import encode_messages, parse_messages  # noqa: E402
from router.config import PlacementConfig  # noqa: E402
from router.placement import pick_prefill, placement_request  # noqa: E402
from router.prefix_index import PrefixIndex  # noqa: E402
from worker_runtime.wire import KVEvent, WorkerLoad, page_hashes  # noqa: E402

WORDS = ("cache prefix token router worker decode prefill page hash batch queue model layer "
         "attention window sparse index latency stream chunk expert").split()


# --------------------------------------------------------------------------- trace

@dataclass(frozen=True)
class Request:
    rid: str
    at: float  # arrival, seconds from the start
    text: str


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_trace(args) -> list[Request]:
    rng = random.Random(args.seed)
    systems = [f"System {i}. " + _words(rng, args.system_words) for i in range(args.systems)]
    out = []
    for c in range(args.conversations):
        msgs = [{"role": "system", "content": rng.choice(systems)}]
        t = c * args.conv_gap_s + rng.uniform(0, args.conv_gap_s)
        for k in range(args.turns):
            msgs.append({"role": "user", "content": f"[{c}.{k}] " + _words(rng, args.user_words)})
            out.append(Request(f"c{c}t{k}", t, encode_messages(parse_messages(msgs), "chat")))
            msgs.append({"role": "assistant", "content": _words(rng, args.answer_words)})
            t += args.turn_gap_s * rng.uniform(0.7, 1.3)
    return sorted(out, key=lambda r: r.at)


# --------------------------------------------------------------------------- workers

class SimWorker:
    """LRU page cache by chained page hash + a FIFO prefill queue."""

    def __init__(self, wid: str, capacity_pages: int, page_size: int, rate: float):
        self.wid, self.cap, self.page_size, self.rate = wid, capacity_pages, page_size, rate
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.busy_until = 0.0
        self.prefill_tokens = 0
        self.hit_tokens = 0
        self.requests = 0

    def queued_tokens(self, now: float) -> int:
        return int(max(0.0, self.busy_until - now) * self.rate)

    def serve(self, ids: list[int], now: float) -> tuple[int, float, list[KVEvent]]:
        """(hit tokens, finish time, KV events) for one prefill arriving at `now`."""
        hashes = page_hashes(ids, self.page_size)
        hit = next((i for i, h in enumerate(hashes) if h not in self.lru), len(hashes))
        stored = [h for h in hashes if h not in self.lru]
        for h in reversed(hashes):  # prefix pages most recent: evicted last (leaves first)
            self.lru[h] = None
            self.lru.move_to_end(h)
        evicted = []
        while len(self.lru) > self.cap:
            evicted.append(self.lru.popitem(last=False)[0])
        hit_tokens = hit * self.page_size
        self.busy_until = max(now, self.busy_until) + (len(ids) - hit_tokens) / self.rate
        self.prefill_tokens += len(ids) - hit_tokens
        self.hit_tokens += hit_tokens
        self.requests += 1
        events = [KVEvent(self.wid, "stored", tuple(stored))] + ([KVEvent(self.wid, "evicted", tuple(evicted))]
                                                                 if evicted else [])
        return hit_tokens, self.busy_until, events


def _workers(args) -> list[SimWorker]:
    return [SimWorker(f"p{i}", args.capacity_pages, args.page_size, args.prefill_rate) for i in range(args.n_workers)]


def _summary(name: str, workers: list[SimWorker], prompt_tokens: int, ttfts: list[float]) -> dict:
    load = [w.prefill_tokens for w in workers]
    ttfts = sorted(ttfts)
    return {"policy": name, "hit_rate": sum(w.hit_tokens for w in workers) / prompt_tokens,
            "requests_per_worker": [w.requests for w in workers],
            "max_over_mean_prefill_load": max(load) / (sum(load) / len(load)) if sum(load) else 1.0,
            "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2], "ttft_p99_ms": 1e3 * ttfts[int(0.99 * (len(ttfts) - 1))]}


# --------------------------------------------------------------------------- offline policies

def simulate(trace: list[Request], tok, args, policy: str) -> dict:
    workers, index = _workers(args), PrefixIndex(args.page_size)
    cfg = PlacementConfig(page_size=args.page_size)
    total, ttfts = 0, []
    for n, r in enumerate(trace):
        ids = tok.encode(r.text)
        total += len(ids)
        if policy == "ours":
            loads = [WorkerLoad(w.wid, "prefill", queued_prefill_tokens=w.queued_tokens(r.at)) for w in workers]
            chosen = pick_prefill(placement_request(ids, 0, index), loads, cfg, tie_key=r.rid).worker_id
            w = next(w for w in workers if w.wid == chosen)
        else:  # round robin
            w = workers[n % len(workers)]
        _, done, events = w.serve(ids, r.at)
        ttfts.append(done - r.at)
        for e in events:
            index.apply(e)
    return _summary(policy, workers, total, ttfts)


def oracle(trace: list[Request], tok, args) -> dict:
    seen, hit, total = set(), 0, 0
    for r in trace:
        ids = tok.encode(r.text)
        hashes = page_hashes(ids, args.page_size)
        hit += next((i for i, h in enumerate(hashes) if h not in seen), len(hashes)) * args.page_size
        seen.update(hashes)
        total += len(ids)
    return {"policy": "oracle (unbounded, placement-free)", "hit_rate": hit / total}


# --------------------------------------------------------------------------- a real router over HTTP

def router_cmd(kind: str, routers_python: str, port: int, urls: list[str]) -> list[str] | None:
    if kind == "sglang-router":
        if subprocess.run([routers_python, "-c", "import sglang_router"], capture_output=True).returncode:
            return None
        return [routers_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *urls, "--policy", "cache_aware", "--log-level", "error", "--disable-retries",
                "--disable-circuit-breaker"]
    exe = Path(routers_python).parent / "vllm-router"
    if not exe.exists():
        return None
    return [str(exe), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", "cache_aware",
            "--log-level", "error", "--disable-retries", "--disable-circuit-breaker"]


async def replay_through(kind: str, trace: list[Request], tok, args) -> dict:
    import aiohttp

    from benchmarks.router_bench import wait_ready
    from benchmarks.stub_http_worker import start_worker
    workers, ports = _workers(args), [free_port() for _ in range(args.n_workers)]
    t0 = [0.0]

    def hook(w):
        def on_request(body):
            now = time.perf_counter() - t0[0]
            hit, done, _ = w.serve(tok.encode(body["prompt"]), now)
            return hit, max(0.0, done - now)
        return on_request

    servers = [await start_worker("127.0.0.1", p, on_request=hook(w)) for p, w in zip(ports, workers)]
    port = free_port()
    cmd = router_cmd(kind, args.routers_python, port, [f"http://127.0.0.1:{p}" for p in ports])
    if cmd is None:
        return {"policy": f"{kind} cache_aware", "skipped": "not installed"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        if not await asyncio.to_thread(wait_ready, url, 60):
            return {"policy": f"{kind} cache_aware", "skipped": "router did not start"}
        for w in workers:  # forget the readiness probes
            w.__init__(w.wid, w.cap, w.page_size, w.rate)
        ttfts, total = [], 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def send(r: Request):
                await asyncio.sleep(max(0.0, r.at - (time.perf_counter() - t0[0])))
                start = time.perf_counter()
                body = {"model": "stub", "prompt": r.text, "max_tokens": 1, "temperature": 0}
                async with s.post(url + "/v1/completions", json=body) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status
                ttfts.append(time.perf_counter() - start)
            t0[0] = time.perf_counter()
            await asyncio.gather(*(send(r) for r in trace))
        total = sum(len(tok.encode(r.text)) for r in trace)
        return _summary(f"{kind} cache_aware (HTTP, real time)", workers, total, ttfts)
    finally:
        proc.terminate()
        proc.wait(10)
        for srv in servers:
            srv.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=250)  # ~1.6k tokens
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-words", type=int, default=40)
    ap.add_argument("--answer-words", type=int, default=30)
    ap.add_argument("--conv-gap-s", type=float, default=0.03)
    ap.add_argument("--turn-gap-s", type=float, default=0.2)
    ap.add_argument("--n-workers", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--capacity-pages", type=int, default=96)
    ap.add_argument("--prefill-rate", type=float, default=200_000.0, help="tokens/s per prefill worker")
    ap.add_argument("--routers", default="sglang-router,vllm-router")
    ap.add_argument("--routers-python", default=sys.executable)
    ap.add_argument("--json")
    args = ap.parse_args()
    tok = fast_byte_tokenizer(512)
    trace = make_trace(args)
    n_tokens = sum(len(tok.encode(r.text)) for r in trace)
    print(f"trace: {len(trace)} requests, {n_tokens} prompt tokens, {args.n_workers} workers x "
          f"{args.capacity_pages} pages of {args.page_size}", flush=True)
    results = [oracle(trace, tok, args), simulate(trace, tok, args, "ours"), simulate(trace, tok, args, "round_robin")]
    for kind in [k for k in args.routers.split(",") if k]:
        results.append(asyncio.run(replay_through(kind, trace, tok, args)))
    print("\n| policy | hit rate | requests per worker | max/mean prefill load | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if "skipped" in r:
            print(f"| {r['policy']} | skipped: {r['skipped']} |||||")
            continue
        print(f"| {r['policy']} | {r['hit_rate']:.3f} | {r.get('requests_per_worker', '–')} | "
              f"{r.get('max_over_mean_prefill_load', float('nan')):.2f} | {r.get('ttft_p50_ms', float('nan')):.1f} | "
              f"{r.get('ttft_p99_ms', float('nan')):.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
