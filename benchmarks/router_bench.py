"""Routing overhead: requests/s a router sustains and the latency it adds, in front of the same
stub OpenAI-compatible workers on loopback — ours next to sglang-router and vllm-router.

Fairness, by construction:
- the same stub workers (benchmarks/stub_http_worker.py, raw asyncio, cheap) behind every router,
  restarted for each setup; every router uses round-robin, so placement policy is not measured;
- the same client (`wrk` with the same Lua-scripted POST, connection count, threads and duration;
  a Python aiohttp client when wrk is missing), the same request body (a /v1/completions request,
  non-streaming), a warm-up before each measurement;
- "direct" is the client hitting the workers itself (round-robin over them by connection), the
  baseline every router's added latency is measured against;
- ours runs as its own process like the Rust routers: `serve()` with a backend that forwards the
  validated, tokenized request to the workers over HTTP (aiohttp) — the same hop the others make.
  `ours-inproc` is ours with the in-process StubBackend (no worker hop), the router alone.

    python benchmarks/router_bench.py [--concurrency 32] [--duration 10] [--workers 2] \\
        [--routers-python /path/venv/bin/python] [--setups direct,ours,ours-inproc,sglang,vllm]
    python benchmarks/router_bench.py --setups ours-inproc --request features   # the API features' cost

sglang-router / vllm-router are found as `python -m sglang_router.launch_router` and
`vllm-router` next to `--routers-python` (they install from PyPI: `pip install sglang-router
vllm-router`). A setup whose router is missing is skipped and reported as such.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Summarize the following: " + "the router forwards requests to workers " * 3  # ~145 tokens
BODY = {"model": "stub", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
_WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"], "additionalProperties": False}
# The same prompt as a chat request with the API features on: two tools offered, a named tool choice
# (a grammar built and checked at the router), logprobs with the top 5, a stop string, a penalty.
FEATURES_BODY = {"model": "stub", "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 5,
                 "stop": ["\n\n"], "presence_penalty": 0.5,
                 "messages": [{"role": "system", "content": "You answer briefly."},
                              {"role": "user", "content": PROMPT}],
                 "tools": [{"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                                             "parameters": _WEATHER}},
                           {"type": "function", "function": {"name": "time", "description": "Local time",
                                                             "parameters": {"type": "object", "properties": {
                                                                 "city": {"type": "string"}}}}}],
                 "tool_choice": {"type": "function", "function": {"name": "weather"}}}
# --request: (path, body) the client sends
REQUESTS = {"plain": ("/v1/completions", BODY), "features": ("/v1/chat/completions", FEATURES_BODY)}


# --------------------------------------------------------------------------- our router, as a process

class HTTPWorkerBackend:
    """A Backend (router protocol) that forwards to OpenAI-compatible workers round-robin."""

    def __init__(self, urls: list[str], tokenizer, max_model_len: int = 1 << 16):
        self.urls, self.tokenizer, self.max_model_len = urls, tokenizer, max_model_len
        self.model_name = "stub"
        self._next = 0
        self._session = None

    async def generate(self, req):
        import aiohttp

        from worker_runtime.wire import TokenChunk, Usage
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None))
        url = self.urls[self._next % len(self.urls)] + "/v1/completions"
        self._next += 1
        body = {"model": "stub", "prompt": list(req.prompt_ids), "max_tokens": req.max_tokens,
                "temperature": req.sampling.temperature, "seed": req.sampling.seed}
        async with self._session.post(url, json=body) as r:
            data = await r.json()
        c = data["choices"][0]
        yield TokenChunk(req.request_id, tuple(c["token_ids"]), c["text"], c["finish_reason"],
                         Usage(len(req.prompt_ids), len(c["token_ids"])))

    async def abort(self, request_id):
        pass

    def overloaded(self):
        return None

    def health(self):
        return {"ok": True}


def fast_byte_tokenizer(vocab_size: int):
    """model/tokenizer.ByteTokenizer with the same encode mapping done by one regex split instead of
    a per-character loop over the special strings (~270 us → ~10 us for this prompt); checked equal
    on the benchmark prompt at startup. The router's cost is what this benchmark is after."""
    import re as _re

    from model.tokenizer import ByteTokenizer

    class FastByteTokenizer(ByteTokenizer):
        def __init__(self, n):
            super().__init__(n)
            self._split = _re.compile("(" + "|".join(_re.escape(t) for t in self.special) + ")")

        def encode(self, text):
            ids = []
            for i, part in enumerate(self._split.split(text)):
                if i % 2:
                    ids.append(self.special[part])
                elif part:
                    ids.extend(part.encode("utf-8"))
            return ids

    tok = FastByteTokenizer(vocab_size)
    for text in (PROMPT, "<｜User｜>a<think>b</think>€"):
        assert tok.encode(text) == ByteTokenizer.encode(tok, text)
    return tok


def serve_ours(port: int, worker_urls: list[str], inproc: bool, slow_tokenizer: bool) -> None:
    sys.path.insert(0, str(ROOT))
    from model.tokenizer import ByteTokenizer
    from router.app import serve
    from router.config import RouterConfig
    from router.stub_backend import StubBackend, StubConfig
    tok = ByteTokenizer(512) if slow_tokenizer else fast_byte_tokenizer(512)
    backend = StubBackend(tok, StubConfig(max_model_len=1 << 16)) if inproc else HTTPWorkerBackend(worker_urls, tok)
    config = RouterConfig(http_port=port, grpc_port=None, max_concurrent_requests=100000)

    async def main():
        await serve(config, backend)
        await asyncio.Event().wait()
    try:
        import uvloop
        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


# --------------------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    data = json.dumps(BODY).encode()
    while time.monotonic() < end:
        try:
            req = urllib.request.Request(url + "/v1/completions", data, {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200 and json.loads(r.read())["choices"]:
                    return True
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.2)
    return False


def router_command(setup: str, port: int, workers: list[str], routers_python: str) -> list[str] | None:
    if setup in ("ours", "ours-inproc", "ours-slowtok"):
        cmd = [sys.executable, __file__, "--serve-ours", str(port), "--worker-urls", ",".join(workers)]
        return cmd + {"ours": [], "ours-inproc": ["--inproc"], "ours-slowtok": ["--slow-tokenizer"]}[setup]
    if setup == "sglang":
        probe = subprocess.run([routers_python, "-c", "import sglang_router"], capture_output=True)
        if probe.returncode != 0:
            return None
        return [routers_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *workers, "--policy", "round_robin", "--log-level", "error",
                "--disable-retries", "--disable-circuit-breaker", "--max-concurrent-requests", "100000"]
    if setup == "vllm":
        exe = Path(routers_python).parent / "vllm-router"
        if not exe.exists():
            return None
        return [str(exe), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                "--policy", "round_robin", "--log-level", "error", "--disable-retries", "--disable-circuit-breaker"]
    raise ValueError(setup)


# --------------------------------------------------------------------------- clients

_WRK_LUA = """
wrk.method = "POST"
wrk.body = [[%s]]
wrk.headers["Content-Type"] = "application/json"
"""


def _ms(value: str) -> float:
    num, unit = re.match(r"([\d.]+)(\w+)", value).groups()
    return float(num) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]


def run_wrk(url: str, concurrency: int, duration: float, threads: int, request: str = "plain") -> dict:
    path, body = REQUESTS[request]
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(_WRK_LUA % json.dumps(body))
    proc = subprocess.run(["wrk", "-t", str(min(threads, concurrency)), "-c", str(concurrency), "-d", f"{max(1, round(duration))}s", "--latency",
                           "-s", f.name, url + path], capture_output=True, text=True)
    os.unlink(f.name)
    out = proc.stdout
    if "Requests/sec" not in out:
        raise RuntimeError(f"wrk failed: {proc.stdout}{proc.stderr}")
    lat = dict(re.findall(r"^\s+(50|75|90|99)%\s+(\S+)", out, re.M))
    errors = sum(int(x) for x in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    errors += sum(int(x) for x in re.findall(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                                             out)[0]) if "Socket errors" in out else 0
    return {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
            "p50_ms": _ms(lat["50"]), "p90_ms": _ms(lat["90"]), "p99_ms": _ms(lat["99"]),
            "requests": int(re.search(r"(\d+) requests in", out).group(1)), "errors": errors}


def run_python_client(urls: list[str], concurrency: int, duration: float, request: str = "plain") -> dict:
    import aiohttp

    path, body = REQUESTS[request]

    async def main():
        lat, errors, stop = [], 0, time.perf_counter() + duration
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
            async def loop(i):
                nonlocal errors
                n = 0
                while time.perf_counter() < stop:
                    t0 = time.perf_counter()
                    async with s.post(urls[(i + n) % len(urls)] + path, json=body) as r:
                        await r.read()
                        errors += r.status != 200
                    lat.append(time.perf_counter() - t0)
                    n += 1
            t0 = time.perf_counter()
            await asyncio.gather(*(loop(i) for i in range(concurrency)))
            elapsed = time.perf_counter() - t0
        lat.sort()
        q = lambda p: 1e3 * lat[min(len(lat) - 1, int(p * len(lat)))]  # noqa: E731
        return {"rps": len(lat) / elapsed, "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99),
                "requests": len(lat), "errors": errors}
    return asyncio.run(main())


# --------------------------------------------------------------------------- orchestration

def measure(setup: str, args) -> dict:
    worker_ports = [free_port() for _ in range(args.workers)]
    workers = [f"http://127.0.0.1:{p}" for p in worker_ports]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "benchmarks/stub_http_worker.py"), "--port", str(p),
                               "--delay-ms", str(args.worker_delay_ms)]) for p in worker_ports]
    try:
        for w in workers:
            if not wait_ready(w, 20):
                raise RuntimeError(f"stub worker {w} did not start")
        url = None
        if setup != "direct":
            port = free_port()
            cmd = router_command(setup, port, workers, args.routers_python)
            if cmd is None:
                return {"setup": setup, "skipped": "router not installed"}
            log = open(Path(tempfile.gettempdir()) / f"router_bench_{setup}.log", "w")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            url = f"http://127.0.0.1:{port}"
            if not wait_ready(url, 60):
                return {"setup": setup, "skipped": f"router did not become ready (log: {log.name})"}
        use_wrk = shutil.which("wrk") is not None and not args.python_client
        if not use_wrk:
            run = lambda d: run_python_client([url] if url else workers, args.concurrency, d, args.request)  # noqa: E731
        elif url:
            run = lambda d: run_wrk(url, args.concurrency, d, args.threads, args.request)  # noqa: E731
        else:  # wrk keeps each connection on one host: one wrk per worker, connections split evenly
            run = lambda d: _direct_wrk(workers, args, d)  # noqa: E731
        run(args.warmup)
        result = run(args.duration)
        return {"setup": setup, "client": "wrk" if use_wrk else "aiohttp", **result}
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _direct_wrk(workers: list[str], args, duration: float) -> dict:
    """Baseline: one wrk per worker in parallel, the connections split as evenly as possible; rates
    add up, percentiles are averaged weighted by connections."""
    import concurrent.futures as cf
    n = len(workers)
    conns = [c for c in (args.concurrency // n + (i < args.concurrency % n) for i in range(n)) if c]
    with cf.ThreadPoolExecutor(len(conns)) as ex:
        parts = list(ex.map(lambda wc: run_wrk(wc[0], wc[1], duration, max(1, args.threads // len(conns))),
                            zip(workers, conns)))
    total = sum(conns)
    return {"rps": sum(p["rps"] for p in parts), "requests": sum(p["requests"] for p in parts),
            "errors": sum(p["errors"] for p in parts),
            **{k: sum(p[k] * c for p, c in zip(parts, conns)) / total for k in ("p50_ms", "p90_ms", "p99_ms")}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", default="direct,ours,ours-inproc,sglang,vllm")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=2, help="wrk threads")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--worker-delay-ms", type=float, default=0.0)
    ap.add_argument("--routers-python", default=sys.executable)
    ap.add_argument("--python-client", action="store_true", help="use the aiohttp client even if wrk exists")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--serve-ours", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker-urls", default="", help=argparse.SUPPRESS)
    ap.add_argument("--inproc", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--slow-tokenizer", action="store_true", help="ours with model/'s ByteTokenizer as is")
    ap.add_argument("--request", choices=tuple(REQUESTS), default="plain",
                    help="plain: the /v1/completions request; features: the chat request with tools, a named "
                         "tool choice, logprobs, a stop string and a penalty (ours-inproc only: the stub "
                         "workers serve completions without logprobs)")
    args = ap.parse_args()
    if args.request != "plain" and args.serve_ours is None and set(args.setups.split(",")) - {"ours-inproc"}:
        ap.error("--request features measures our router alone: --setups ours-inproc")
    if args.serve_ours is not None:
        return serve_ours(args.serve_ours, [u for u in args.worker_urls.split(",") if u], args.inproc,
                          args.slow_tokenizer)
    results = []
    for setup in args.setups.split(","):
        r = measure(setup, args)
        results.append(r)
        print(json.dumps(r), flush=True)
    base = next((r for r in results if r["setup"] == "direct" and "rps" in r), None)
    print(f"\n| setup | client | req/s | p50 ms | p90 ms | p99 ms | added p50 ms | added p99 ms | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "rps" not in r:
            print(f"| {r['setup']} | skipped: {r['skipped']} |||||||")
            continue
        add = (f"{r['p50_ms'] - base['p50_ms']:.2f} | {r['p99_ms'] - base['p99_ms']:.2f}"
               if base and r is not base else "– | –")
        print(f"| {r['setup']} | {r['client']} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p90_ms']:.2f} | "
              f"{r['p99_ms']:.2f} | {add} | {r['errors']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
