"""serve_bench.py's open-loop levels, SLO attainment and goodput search, driven against a small
OpenAI-style streaming server in the test whose latency steps up with load, so that its goodput
is known in advance: CPU only, no Ray."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import math
import threading
import time

import httpx
import pytest

from benchmarks import serve_bench
from benchmarks.serving_load import (Tier, attainment, columns, failed, finished, meets, open_loop, poisson_arrivals,
                                     records_from_columns, search_goodput, summarize, unit_arrivals)

INTERACTIVE, BATCH = Tier("interactive", 1.5, 0.030), Tier("batch", 4.0, 0.100)


class LoadServer:
    """`POST /v1/completions`, streamed as SSE with one token id a chunk (anything else: 404). A
    request's load is the number of requests that arrived within the last `window_s`, itself
    included (the ones in flight, for a service time of `window_s`). Above `ttft_knee` its first
    token comes after `ttft_s[1]` instead of `ttft_s[0]`; above `gap_knee` each later token after
    `gap_s[1]` instead of `gap_s[0]`. The steps are far wider than the scheduling noise of a busy
    machine, so whether a request meets a tier depends only on its load (`loads`, in the order
    the requests came)."""

    def __init__(self, window_s=0.05, ttft_knee=3, gap_knee=6, ttft_s=(0.01, 0.4), gap_s=(0.004, 0.2)):
        self.window_s, self.ttft_knee, self.gap_knee, self.ttft_s, self.gap_s = window_s, ttft_knee, gap_knee, ttft_s, gap_s
        self.arrivals: list[float] = []  # time.perf_counter() of each completion request
        self.loads: list[int] = []
        self.connections: set[asyncio.Task] = set()

    def __enter__(self) -> str:
        ready = threading.Event()

        def run():
            self.loop = asyncio.new_event_loop()
            self.server = self.loop.run_until_complete(asyncio.start_server(self._connection, "127.0.0.1", 0))
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()
            self.loop.close()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _close(self):
        self.server.close()
        for task in self.connections:
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)

    async def _connection(self, reader, writer):
        self.connections.add(asyncio.current_task())
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, path, _ = head[0].split(" ")
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if method == "POST" and path == "/v1/completions":
                    await self._complete(json.loads(body), writer)
                else:
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _complete(self, body: dict, writer):
        now = time.perf_counter()
        self.arrivals.append(now)
        load = len(self.arrivals) - bisect.bisect_right(self.arrivals, now - self.window_s)
        self.loads.append(load)

        async def send(data: bytes):
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()

        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        await asyncio.sleep(self.ttft_s[load > self.ttft_knee])
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(self.gap_s[load > self.gap_knee])
            chunk = {"choices": [{"index": 0, "text": "a", "token_ids": [97]}]}
            await send(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await send(b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")


def known_goodput(n: int, seed: int, window_s: float, knee: int, target: float) -> float:
    """The highest rate at which ≥ target of n requests (the run's arrival draw scaled to the rate)
    have a load of at most `knee` on LoadServer. Request k's load exceeds the knee once the
    knee-th request before it arrives within the window: at rates above (u_k - u_{k-knee}) / window."""
    u = unit_arrivals(n, seed)
    limits = sorted(((u[k] - u[k - knee]) / window_s if k >= knee else math.inf for k in range(n)), reverse=True)
    return limits[math.ceil(target * n) - 1]


# ---------------------------------------------------------------- arrivals


def test_poisson_arrivals_have_the_asked_mean_rate_exponential_gaps_and_a_seeded_draw():
    times = poisson_arrivals(4000, 5.0, seed=3)
    assert times[0] == 0.0 and times == sorted(times)
    assert (len(times) - 1) / times[-1] == pytest.approx(5.0, rel=0.05)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert cv == pytest.approx(1.0, abs=0.08)  # exponential gaps, not a regular ticker
    assert poisson_arrivals(4000, 5.0, seed=3) == times
    assert poisson_arrivals(4000, 5.0, seed=4) != times
    # every rate scales the same draw
    assert poisson_arrivals(50, 10.0, seed=3) == pytest.approx([t / 2 for t in poisson_arrivals(50, 5.0, seed=3)])


def test_open_loop_sends_each_request_at_its_time_while_earlier_ones_are_still_running():
    offsets = poisson_arrivals(12, 20.0, seed=1)
    server = LoadServer(ttft_knee=0, ttft_s=(0.3, 0.3))  # every request takes ≥ 0.3 s

    async def go(url):
        async with httpx.AsyncClient(timeout=30) as session:
            return await open_loop(session, url, [[1, 2, 3]] * 12, 2, offsets, budget_s=60)

    with server as url:
        rows, start = asyncio.run(go(url))
    assert [r["error"] for r in rows] == [None] * 12
    assert [a - start for a in server.arrivals] == pytest.approx(offsets, abs=0.03)
    assert all(r["ttft"] >= 0.3 for r in rows)
    in_flight = max(sum(r["sent"] <= q["sent"] < r["done"] for r in rows) for q in rows)
    assert in_flight >= 4  # a closed loop of one client would have had one
    level = summarize(rows, start, 3, (INTERACTIVE,))
    assert level["arrival_rate"] == pytest.approx(11 / offsets[-1], rel=0.1)
    assert level["send_lag_ms_max"] < 30


# ---------------------------------------------------------------- attainment of one request


def request(ttft: float, gaps: list[float]) -> dict:
    stamps = [100.0 + ttft]
    for g in gaps:
        stamps.append(stamps[-1] + g)
    return finished(100.0, stamps, len(stamps))


def test_a_request_meets_a_tier_by_its_ttft_and_its_own_itl_p99():
    assert meets(request(1.499, [0.02] * 100), INTERACTIVE)
    assert not meets(request(1.501, [0.02] * 100), INTERACTIVE)
    assert meets(request(1.501, [0.02] * 100), BATCH)
    assert not meets(request(0.1, [0.031] * 100), INTERACTIVE)
    # one slow gap among 200 is above the 99th percentile of its gaps; among 50 it is the p99
    assert meets(request(0.1, [0.01] * 199 + [0.5]), INTERACTIVE)
    assert not meets(request(0.1, [0.01] * 49 + [0.5]), INTERACTIVE)
    assert not meets(request(0.1, [0.01] * 49 + [0.5]), BATCH)
    # two slow gaps among 200: the p99 is the slower of the two
    assert not meets(request(0.1, [0.01] * 198 + [0.5, 0.5]), BATCH)
    assert meets(request(0.1, []), INTERACTIVE)  # one token: no gap to judge


def test_a_failed_request_meets_no_tier_and_counts_in_the_attainment():
    broken = failed(100.0, "HTTP 500: b'boom'")
    assert not meets(broken, BATCH) and not meets(broken, Tier("anything", 1e9, 1e9))
    records = [request(0.1, [0.01] * 10), request(2.0, [0.01] * 10), broken, request(0.1, [0.01] * 9 + [0.2])]
    assert attainment(records, INTERACTIVE) == 0.25
    assert attainment(records, BATCH) == 0.5
    level = summarize(records, 100.0, 8, (INTERACTIVE, BATCH))
    assert level["failed"] == 1 and level["requests"] == 4
    assert level["attainment"] == {"interactive": 0.25, "batch": 0.5}
    assert level["errors"] == ["HTTP 500: b'boom'"]
    # the per-request columns judge the same way when read back (serve_bench.py --resume)
    back = records_from_columns(json.loads(json.dumps(level["per_request"])))
    assert [meets(r, t) for r in back for t in (INTERACTIVE, BATCH)] == \
        [meets(r, t) for r in records for t in (INTERACTIVE, BATCH)]
    assert columns(records, 100.0)["ok"] == [1, 1, 0, 1]


def test_a_tier_is_parsed_from_name_ttft_seconds_and_itl_p99_milliseconds():
    assert Tier.parse("interactive:1.5:30") == INTERACTIVE
    assert Tier.parse(BATCH.spec()) == BATCH
    with pytest.raises(ValueError):
        Tier.parse("interactive:1.5")


# ---------------------------------------------------------------- the goodput search


def step(threshold: float, calls: list[float]):
    async def measure(rate):
        calls.append(rate)
        return {"attainment": {"t": 0.95 if rate <= threshold else 0.5}}
    return measure


@pytest.mark.parametrize("start", [1.0, 7.0, 40.0])
def test_the_search_brackets_the_threshold_to_the_asked_precision(start):
    calls = []
    g = asyncio.run(search_goodput(step(7.3, calls), "t", 0.9, start, 0.1, 12))
    lo, hi = g["passing"]["rate"], g["failing"]["rate"]
    assert lo <= 7.3 < hi and hi / lo - 1 <= 0.1 and g["converged"]
    assert g["requests_per_s"] == lo and g["passing"]["attainment"] == 0.95 and g["failing"]["attainment"] == 0.5
    assert [lv["rate"] for lv in g["levels"]] == calls


def test_the_search_stops_at_max_levels_and_reports_zero_when_nothing_passes():
    calls = []
    g = asyncio.run(search_goodput(step(7.3, calls), "t", 0.9, 1.0, 0.001, 5))
    assert len(calls) == 5 and not g["converged"] and g["passing"]["rate"] <= 7.3 < g["failing"]["rate"]
    g = asyncio.run(search_goodput(step(0.0, []), "t", 0.9, 1.0, 0.1, 4))
    assert g["requests_per_s"] == 0.0 and g["passing"] is None and g["failing"]["rate"] == 1 / 8
    g = asyncio.run(search_goodput(step(1e9, []), "t", 0.9, 1.0, 0.1, 4))
    assert g["requests_per_s"] == 8.0 and g["failing"] is None and not g["converged"]


# ---------------------------------------------------------------- the benchmark end to end

N, SEED, WINDOW = 30, 0, 0.05
TIERS_ARG = ["interactive:0.2:100", "batch:2:100"]  # LoadServer: load ≤ 3 meets the first, ≤ 6 the second


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "synthetic.json"
    server = LoadServer(window_s=WINDOW, ttft_knee=3, gap_knee=6)
    with server as url:
        argv = ["--url", url, "--isl", "16", "--osl", "4", "--vocab", "1000", "--warmup", "1", "--gpus", "2",
                "--label", "synthetic", "--concurrency", "2", "--rates", "16", "--rate-requests", str(N),
                "--seed", str(SEED), "--slo", *TIERS_ARG, "--goodput", "interactive", "batch", "--start-rate", "16",
                "--precision", "0.1", "--max-levels", "8"]
        result = serve_bench.main([*argv, "--out", str(out)])
        served_before = len(server.arrivals)
        resumed = serve_bench.main([*argv, "--warmup", "0", "--resume", str(out), "--out", str(out.with_suffix(".2.json"))])
        assert len(server.arrivals) == served_before  # every level came from the file
    return {"result": result, "file": json.loads(out.read_text()), "resumed": resumed, "loads": server.loads}


@pytest.mark.parametrize("tier, knee", [("interactive", 3), ("batch", 6)])
def test_goodput_search_brackets_the_servers_known_goodput(served, tier, knee):
    truth = known_goodput(N, SEED, WINDOW, knee, 0.9)
    g = served["result"]["goodput"][tier]
    lo, hi = g["passing"]["rate"], g["failing"]["rate"]
    assert g["converged"] and hi / lo - 1 <= 0.1
    # a late send (a busy machine) bunches arrivals, which can only raise the load: more room below
    assert lo <= 1.2 * truth and hi >= truth / 1.5, (lo, hi, truth)
    assert g["passing"]["attainment"] >= 0.9 > g["failing"]["attainment"]
    assert g["requests_per_s"] == lo and g["requests_per_s_per_gpu"] == lo / 2


def test_the_json_holds_every_level_its_mode_percentiles_attainment_and_the_goodput(served):
    r = served["file"]
    assert r == json.loads(json.dumps(served["result"]))
    assert (r["label"], r["gpus"], r["isl"], r["osl"]) == ("synthetic", 2, 16, 4)
    assert r["slo"]["target"] == 0.9
    assert r["slo"]["tiers"] == [{"name": "interactive", "ttft_s": 0.2, "itl_p99_ms": 100.0},
                                 {"name": "batch", "ttft_s": 2.0, "itl_p99_ms": 100.0}]
    closed = [lv for lv in r["levels"] if lv["mode"] == "closed"]
    poisson = {lv["rate"]: lv for lv in r["levels"] if lv["mode"] == "poisson"}
    assert [lv["concurrency"] for lv in closed] == [2] and closed[0]["requests"] == 2
    # the --rates level served the searches too: each rate ran once for both tiers
    assert 16.0 in poisson and len(poisson) == len(r["levels"]) - 1
    for tier, g in r["goodput"].items():
        assert {lv["rate"] for lv in g["levels"]} <= set(poisson)
        for lv in g["levels"]:
            assert poisson[lv["rate"]]["attainment"][tier] == lv["attainment"]
    for lv in r["levels"]:
        for key in ("ttft_ms", "itl_ms", "e2e_ms", "request_itl_p99_ms"):
            assert set(lv[key]) == {"p50", "p90", "p99"}
        assert lv["failed"] == 0 and lv["output_tok_s"] > 0 and lv["total_tok_s"] > lv["output_tok_s"]
        assert lv["total_tok_s_per_gpu"] == lv["total_tok_s"] / 2
        assert set(lv["attainment"]) == {"interactive", "batch"}
        assert len(lv["per_request"]["ttft_ms"]) == lv["requests"]
    for rate, lv in poisson.items():
        assert lv["requests"] == lv["asked"] == N
        assert lv["arrival_rate"] == pytest.approx(rate * (N - 1) / unit_arrivals(N, SEED)[-1], rel=0.15)
    # each level's attainment is the share of its requests the server loaded at most to the knee
    loads = served["loads"][3:]  # after the warm-up request and the closed-loop level's two
    assert [lv["mode"] for lv in r["levels"]] == ["closed"] + ["poisson"] * len(poisson)  # in the order run
    for i, lv in enumerate(r["levels"][1:]):
        level_loads = loads[i * N:(i + 1) * N]
        for tier, knee in (("interactive", 3), ("batch", 6)):
            assert lv["attainment"][tier] == pytest.approx(sum(x <= knee for x in level_loads) / N), (lv["rate"], tier)
    rates = sorted(poisson)
    assert poisson[rates[-1]]["ttft_ms"]["p90"] > 10 * poisson[rates[0]]["ttft_ms"]["p90"]


def test_a_resumed_run_judges_the_stored_levels_and_finds_the_same_goodput(served):
    assert served["resumed"]["goodput"] == served["result"]["goodput"]
    assert len(served["resumed"]["levels"]) == len(served["result"]["levels"])


# ---------------------------------------------------------------- the warm-up


@pytest.mark.parametrize("health, expected", [({"ok": True, "prefill": 2, "decode": 3}, 10),
                                              ({"ok": True, "prefill": 0, "decode": 4}, 8),
                                              ({"ok": False, "prefill": 0, "decode": 0}, 2)])
def test_the_default_warmup_is_two_requests_per_worker_the_router_counts(health, expected):
    import http.server
    import threading

    import httpx

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the handler's name is http.server's)
            body = json.dumps(health).encode() if self.path == "/health" else b"{}"
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        async def ask():
            async with httpx.AsyncClient() as session:
                return await serve_bench.warmup_for(session, f"http://127.0.0.1:{server.server_port}")
        assert asyncio.run(ask()) == expected
    finally:
        server.shutdown()
