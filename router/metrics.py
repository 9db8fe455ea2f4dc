"""Prometheus metrics of one router, in its own CollectorRegistry (never the process-global one,
so several routers — or a router and its tests — in one process never collide).

The router observes latencies and outcomes itself; the backend reports what only it knows (pool
queue depths, KV transfer bytes/time/failures) through the small API below, on the same object.
Prefix-cache hit tokens are counted from `Usage.cached_tokens` of finished requests.

`watch_pools` adds gauges computed when scraped from what the backend holds: the workers' latest
load reports (the autoscaling signals for scalers outside v4serve such as KEDA: queued prefill
tokens and KV pages in use per pool; the workers this router routes to) and its prefix index. Every router replica reads the same reports
and the same KV-event stream from the registry, so all replicas export the same values.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

POOLS = ("prefill", "decode")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class RouterMetrics:
    def __init__(self, namespace: str = "v4serve"):
        self.registry = CollectorRegistry(auto_describe=True)
        r, ns = self.registry, namespace
        self.namespace = namespace
        self.ttft = Histogram("time_to_first_token_seconds", "Arrival to first generated token.",
                              namespace=ns, registry=r, buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Gap between consecutive generated tokens.",
                             namespace=ns, registry=r, buckets=_ITL_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Arrival to last token (or error).",
                             namespace=ns, registry=r, buckets=_LATENCY_BUCKETS)
        self.requests = Counter("requests", "Finished requests by outcome and reason.",
                                ["outcome", "reason"], namespace=ns, registry=r)
        self.in_flight = Gauge("requests_in_flight", "Generations in progress.", namespace=ns, registry=r)
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens of finished requests.", namespace=ns, registry=r)
        self.generation_tokens = Counter("generation_tokens", "Generated tokens.", namespace=ns, registry=r)
        self.prefix_cache_hit_tokens = Counter("prefix_cache_hit_tokens", "Prompt tokens served from a prefix cache.",
                                               namespace=ns, registry=r)
        self.queue_depth = Gauge("queue_depth", "Requests waiting per pool (the autoscaler's signal).",
                                 ["pool"], namespace=ns, registry=r)
        self.kv_transfer_bytes = Counter("kv_transfer_bytes", "KV bytes moved between workers.",
                                         namespace=ns, registry=r)
        self.kv_transfer_seconds = Histogram("kv_transfer_seconds", "Duration of one request's KV transfer.",
                                             namespace=ns, registry=r, buckets=_LATENCY_BUCKETS)
        self.kv_transfer_wire_seconds = Histogram(
            "kv_transfer_wire_seconds", "One request's KV transfer proper: first write posted to verified.",
            namespace=ns, registry=r, buckets=_LATENCY_BUCKETS)
        self.kv_transfer_failures = Counter("kv_transfer_failures", "Failed KV transfers by reason.",
                                            ["reason"], namespace=ns, registry=r)
        self.retargets = Counter("retargeted_requests", "Requests that continued on another decode worker, by "
                                 "how their state got there: migrate (live KV migration), repull (KV re-sent by "
                                 "the prefill worker that still held it), recompute (prompt + tokens so far).",
                                 ["path"], namespace=ns, registry=r)
        self.decode_prefills = Counter(
            "decode_prefills", "Requests prefilled on their decode worker, by reason: short_prompt and "
            "no_prefill_worker (placement), prefill_unreachable, no_room, expired, corrupt, prefill_failed, ... "
            "(the decode worker's, with the request's first chunk). None is caused by a wait in a prefill queue.",
            ["reason"], namespace=ns, registry=r)
        self.prefill_waits = Counter("prefill_waits", "Requests held at the router because every prefill "
                                     "worker's queue was deeper than the bound.", namespace=ns, registry=r)
        self.registry_errors = Counter("registry_errors", "Failed reads of the worker registry (Redis down).",
                                       namespace=ns, registry=r)

    def watch_pools(self, loads: Callable[[], Iterable], index_pages: Callable[[], Mapping[str, int]]) -> None:
        """Export gauges of the pools, read at scrape time: `loads()` gives the latest `WorkerLoad`s,
        `index_pages()` the prefix index's page count per prefill worker."""
        self.registry.register(_PoolCollector(self.namespace, loads, index_pages))

    # --- router side
    def request_finished(self, outcome: str, reason: str) -> None:
        """outcome: success | error | cancelled; reason: finish reason or error code."""
        self.requests.labels(outcome, reason).inc()

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if cached_tokens:
            self.prefix_cache_hit_tokens.inc(cached_tokens)

    # --- backend side
    def set_queue_depth(self, pool: str, value: int) -> None:
        self.queue_depth.labels(pool).set(value)

    def add_prefix_cache_hit_tokens(self, n: int) -> None:
        """For backends that learn of hits outside `Usage` (do not report them in both)."""
        self.prefix_cache_hit_tokens.inc(n)

    def kv_transfer_done(self, nbytes: int, seconds: float, wire_seconds: float = 0.0) -> None:
        """`seconds`: reservation → verified (the wait for the prefill included); `wire_seconds`:
        the transfer proper, when known (> 0)."""
        self.kv_transfer_bytes.inc(nbytes)
        self.kv_transfer_seconds.observe(seconds)
        if wire_seconds > 0:
            self.kv_transfer_wire_seconds.observe(wire_seconds)

    def kv_transfer_failed(self, reason: str) -> None:
        self.kv_transfer_failures.labels(reason).inc()

    def request_retargeted(self, path: str) -> None:
        """path: migrate | repull | recompute."""
        self.retargets.labels(path).inc()

    def decode_prefill(self, reason: str) -> None:
        """A request's prompt is prefilled on its decode worker; `reason` says why."""
        self.decode_prefills.labels(reason).inc()

    def prefill_wait(self) -> None:
        self.prefill_waits.inc()

    def registry_error(self) -> None:
        self.registry_errors.inc()

    # --- exposition
    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def sample(self, name: str, labels: dict | None = None) -> float:
        """Current value of one sample (tests and benchmarks); 0 when absent."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else v


class _PoolCollector:
    """Gauges over the workers' latest load reports and the prefix index. Draining workers are left
    out of the scaling signals (queued tokens, pages), as the autoscaling policy leaves them out
    (cluster/autoscaler.py: signals): they are leaving, so their load asks for no new capacity."""

    def __init__(self, namespace: str, loads: Callable[[], Iterable], index_pages: Callable[[], Mapping[str, int]]):
        self.namespace, self.loads, self.index_pages = namespace, loads, index_pages

    def collect(self):
        ns = self.namespace
        tokens = GaugeMetricFamily(f"{ns}_queued_prefill_tokens",
                                   "Prompt tokens waiting to be prefilled per pool (the prefill autoscaling signal).",
                                   labels=["pool"])
        workers = GaugeMetricFamily(f"{ns}_worker_info", "Workers this router sees in the registry (1 each; state ready or draining).",
                                    labels=["worker", "pool", "state"])
        in_use = GaugeMetricFamily(f"{ns}_kv_pages_in_use", "KV pages in use per pool (the page-pressure signal).",
                                   labels=["pool"])
        per_worker = GaugeMetricFamily(f"{ns}_kv_pages_per_worker", "KV pages of one worker of the pool (mean).",
                                       labels=["pool"])
        queued, used, sized = dict.fromkeys(POOLS, 0), dict.fromkeys(POOLS, 0), {p: [] for p in POOLS}
        for load in self.loads():
            workers.add_metric([load.worker_id, load.role, "draining" if load.draining else "ready"], 1)
            if not load.draining and load.role in queued:
                queued[load.role] += load.queued_prefill_tokens
                if load.total_pages > 0:
                    used[load.role] += load.total_pages - load.free_pages
                    sized[load.role].append(load.total_pages)
        for pool in POOLS:
            tokens.add_metric([pool], queued[pool])
            in_use.add_metric([pool], used[pool])
            per_worker.add_metric([pool], sum(sized[pool]) / len(sized[pool]) if sized[pool] else 0)
        index = GaugeMetricFamily(f"{ns}_prefix_index_pages",
                                  "KV pages the router's prefix index holds per prefill worker.", labels=["worker"])
        for worker, pages in sorted(self.index_pages().items()):
            index.add_metric([worker], pages)
        yield from (tokens, in_use, per_worker, workers, index)
