"""Watching a real `v4serve up --model tiny` (1 prefill, 1 decode worker): each worker serves its
own /metrics, scraped once each; every engine series carries model_name, worker and role and
comes from that worker alone, so summing over workers counts each token once (the router's own
count agrees); every metric the shipped Grafana dashboard and alert rules query exists on the
running cluster; the console shows a progress line per pool before `ready` and the workers'
stats lines, prefixed with the worker."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.cluster  # starts Ray
pytest.importorskip("nixl")

FILES = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "v4serve" / "files"
WORKERS = {"prefill-0", "decode-0"}
METRIC = re.compile(r"\b(?:v4serve_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


class Up:
    """`v4serve up` as a subprocess; every console line is kept (a thread reads them all, so the
    pipe never fills)."""

    def __init__(self, tmp: Path):
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "up", "--model", "tiny", "--prefill", "1", "--decode", "1",
             "--http-port", "0", "--grpc-port", "0", "--max-model-len", "1024", "--remote-prefill-threshold", "64",
             "--stats-interval", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        self.lines: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                if line.startswith("v4serve ready"):
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        assert ready.wait(240) and self.proc.poll() is None, "\n".join(self.lines[-40:])
        ready_line = next(line for line in self.lines if line.startswith("v4serve ready"))
        self.before_ready = self.lines[:self.lines.index(ready_line)]
        self.http = dict(f.split("=", 1) for f in ready_line.split() if "=" in f)["http"]

    def worker_urls(self) -> dict[str, str]:
        found = {}
        for line in self.before_ready:
            m = re.search(r"cluster\.launcher: (\S+) serving after [\d.]+ s \((?:prefill|decode) \d+/\d+\), "
                          r"metrics (\S+)$", line)
            if m:
                found[m.group(1)] = m.group(2)
        return found

    def stop(self) -> int:
        os.killpg(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout=90)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    server = Up(tmp_path_factory.mktemp("cache"))
    yield server
    assert server.stop() == 0


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def scrape(url: str) -> dict[str, list]:
    """name → samples (names as exposed: counters with _total, histograms' _bucket/_sum/_count).
    A family declared without samples yet (a counter by reason before the first failure) is
    there with none: its queries return data once it happens."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            out.setdefault(family.name + suffix, [])
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


@pytest.fixture(scope="module")
def scraped(up):
    """Requests through the router (a shared 600-token prefix: the second ones hit the prefix
    cache; remote prefill from 64 tokens), then one scrape of every worker and of the router."""
    shared = "".join(chr(32 + (i * 7) % 90) for i in range(600))
    completion_tokens = 0
    with httpx.Client(base_url=up.http, timeout=120) as client:
        served = client.get("/v1/models").json()["data"][0]["id"]  # the model_name label
        for i in range(6):
            prompt = (shared if i % 2 == 0 else "") + f"request {i} " * 8
            r = client.post("/v1/completions", json={"model": served, "prompt": prompt, "max_tokens": 6,
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            completion_tokens += r.json()["usage"]["completion_tokens"]
    urls = up.worker_urls()
    time.sleep(2.5)  # a stats line per busy worker (--stats-interval 1)
    return {"workers": {w: scrape(u) for w, u in urls.items()}, "router": scrape(f"{up.http}/metrics"),
            "urls": urls, "completion_tokens": completion_tokens, "served": served}


def test_every_worker_is_scraped_once_with_its_labels(scraped):
    workers = scraped["workers"]
    assert set(workers) == WORKERS and len(set(scraped["urls"].values())) == len(WORKERS)
    for worker, samples in workers.items():
        role = worker.split("-")[0]
        engine = {n: s for n, s in samples.items() if n.startswith(("v4serve_engine_", "vllm:"))}
        assert {"v4serve_engine_requests_running", "v4serve_engine_kv_usage_ratio",
                "v4serve_engine_request_queue_time_seconds_bucket", "vllm:num_requests_waiting"} <= set(engine)
        for name, series in engine.items():
            for s in series:  # this worker's series only: nothing another process also exports
                assert (s.labels["model_name"], s.labels["worker"], s.labels["role"]) == (scraped["served"], worker,
                                                                                          role), name


def test_counts_add_up_across_workers(scraped):
    def total(name, role=None):
        return sum(s.value for w in scraped["workers"].values() for s in w.get(name, [])
                   if role is None or s.labels["role"] == role)

    generated = total("v4serve_engine_generation_tokens_total")
    assert generated == scraped["completion_tokens"] == 36
    router = scraped["router"]["v4serve_generation_tokens_total"][0].value
    assert router == generated  # one router: its count and the workers' sum agree
    assert total("v4serve_engine_prefix_cache_hits_total", "prefill") > 0  # the shared prefix was reused
    assert total("v4serve_engine_kv_transfers_total") > 0
    # every request was queued, prefilled and decoded somewhere exactly once
    assert total("v4serve_engine_request_decode_time_seconds_count", "decode") == 6
    assert total("v4serve_engine_request_queue_time_seconds_count") >= 6


def query_metrics() -> dict[str, set[str]]:
    """metric name → where (panel title / alert name), over the dashboard and the alert rules."""
    import json

    out: dict[str, set[str]] = {}
    dashboard = json.loads((FILES / "v4serve-dashboard.json").read_text())
    queries = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    queries.append(("variable model", dashboard["templating"]["list"][1]["query"]["query"]))
    rules = yaml.safe_load((FILES / "v4serve-alerts.yaml").read_text())
    queries += [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]
    for where, expr in queries:
        for name in METRIC.findall(expr):
            out.setdefault(name, set()).add(where)
    return out


def test_every_dashboard_and_alert_query_names_a_metric_that_exists(scraped):
    names = set(scraped["router"])
    for samples in scraped["workers"].values():
        names |= set(samples)
    used = query_metrics()
    assert len(used) >= 20
    missing = {name: sorted(where) for name, where in used.items() if name not in names}
    assert not missing, missing


def test_console_shows_progress_and_stats_lines(up, scraped):
    before = "\n".join(up.before_ready)
    for line in ("prefill: starting 1 workers (loading weights from", "decode: starting 1 workers",
                 "prefill: all 1 workers serving", "decode: all 1 workers serving"):
        assert line in before, line
    stats = [line for line in up.lines if re.search(r"\((decode-\d|prefill-0) pid=\d+\).*: running \d+, waiting", line)]
    assert any("generation " in line and "tok/s" in line for line in stats), up.lines[-30:]
    assert not any("Traceback" in line for line in up.lines)
