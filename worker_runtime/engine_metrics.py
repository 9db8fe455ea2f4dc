"""Engine metrics of one worker, served by the worker itself, and its engine health.

    EngineStats            what an engine reports as it runs (one object per engine, filled by
                           one-line hooks): request phases (queued, scheduled, first token,
                           ended) → queue / prefill / decode / time-per-output-token histograms;
                           prefix-cache queries and hits; tokens; speculative drafts; steps
    WorkerMetrics          one worker's exposition: those, plus gauges read when scraped (running
                           and waiting requests, KV use per KV pool) and its transfer and
                           migration counters, every series labelled model_name and worker;
                           served on the worker's own port at /metrics, with /health, and the
                           periodic stats line

Why the worker's own endpoint (not Ray's metrics export, not the router): each worker's series
come from one place, the process that counts them, so a scrape of every worker counts each
request once (routers only see their own requests; every router sees every worker's load). It
needs no Ray metrics agent, has no export delay, and may use vLLM's metric names (`vllm:...`,
whose colon Ray's metric names do not allow), which vLLM/llm-d dashboards and the Gateway API
inference extension's endpoint picker read. docs/deploy.md ("Metrics") maps every name.

/health answers 503 once a step has been running longer than `stall_s` (a wedged model step, a
collective that never returns): the chart's liveness probe restarts such a worker. An idle
engine is healthy.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger(__name__)

_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
PORT_TRIES = 16  # workers sharing a node take the next free port from the configured one


@dataclass(frozen=True)
class MetricsOptions:
    port: int | None = 0  # first port tried (0: any free one; None: no endpoint)
    host: str = "0.0.0.0"  # Prometheus scrapes the worker from another pod
    model_name: str = "v4serve"  # the label model_name: the served model's name
    stall_s: float = 600.0  # a step running longer makes /health fail (the first steps compile kernels)

    def __post_init__(self):
        if self.port is not None and not 0 <= self.port <= 65535 - PORT_TRIES:
            raise ValueError(f"metrics port must be in 0..{65535 - PORT_TRIES} or None, got {self.port}")
        if self.stall_s <= 0:
            raise ValueError(f"stall_s must be positive, got {self.stall_s}")


class EngineStats:
    """Filled by an engine's hooks; read by WorkerMetrics. The hooks run on the engine's thread, the
    reads on the scraping thread: histograms lock, the rest are plain numbers."""

    def __init__(self):
        def histogram(name: str, doc: str, buckets=_PHASE_BUCKETS) -> Histogram:
            return Histogram(name, doc, namespace="v4serve_engine", registry=None, buckets=buckets)

        self.queue_time = histogram("request_queue_time_seconds", "Queued → first scheduled in a step.")
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled → its first token.")
        self.decode_time = histogram("request_decode_time_seconds", "First token → last token, on this worker.")
        self.time_per_output_token = histogram("time_per_output_token_seconds",
                                               "Decode time / (generated tokens - 1) of a finished request.",
                                               _TPOT_BUCKETS)
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found cached
        self.prompt_tokens = 0  # prompt tokens run through the model
        self.generation_tokens = 0
        self.spec_drafts = 0  # speculative tokens proposed
        self.spec_accepted = 0
        self.steps = 0
        self.step_since: float | None = None  # when the running step began (None: no step running)
        self._phases: dict[str, list] = {}  # request id → [queued, scheduled, first token]

    # --- request phases
    def queued(self, request_id: str) -> None:
        self._phases[request_id] = [time.monotonic(), None, None]

    def scheduled(self, request_id: str) -> None:
        t = self._phases.get(request_id)
        if t is not None and t[1] is None:
            t[1] = time.monotonic()
            self.queue_time.observe(t[1] - t[0])

    def first_token(self, request_id: str) -> None:
        """Its first token now (prefilled here, or arrived with its KV: then no phase before)."""
        now = time.monotonic()
        t = self._phases.setdefault(request_id, [None, None, None])
        if t[1] is not None:
            self.prefill_time.observe(now - t[1])
        t[2] = now

    def ended(self, request_id: str, generated: int = 0, finished: bool = False) -> None:
        """It left the engine; `finished` with `generated` tokens (else aborted, failed, moved)."""
        t = self._phases.pop(request_id, None)
        if finished and t is not None and t[2] is not None and generated > 1:
            decode = time.monotonic() - t[2]
            self.decode_time.observe(decode)
            self.time_per_output_token.observe(decode / (generated - 1))

    # --- counters
    def prefix_lookup(self, queried: int, hit: int) -> None:
        self.prefix_queries += queried
        self.prefix_hits += hit

    def computed(self, prompt_tokens: int = 0, generated: int = 0) -> None:
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generated

    def speculated(self, drafts: int, accepted: int) -> None:
        self.spec_drafts += drafts
        self.spec_accepted += accepted

    # --- liveness
    def step_began(self) -> None:
        self.step_since = time.monotonic()

    def step_ended(self) -> None:
        self.step_since = None
        self.steps += 1

    def stalled_for(self) -> float:
        """Seconds the running step has been running (0 when none runs)."""
        since = self.step_since
        return 0.0 if since is None else time.monotonic() - since


@dataclass(frozen=True)
class Sources:
    """Where a worker's scrape-time numbers come from (callables read on the scraping thread)."""

    load: Callable  # → WorkerLoad (running, waiting, queued prefill tokens)
    kv_usage: Callable[[], dict[str, float]]  # → KV pool kind → fraction of its pages in use
    transfers: Callable[[], dict] = dict  # → {"sent"/"received": TransferMetrics.snapshot()}
    counts: Callable[[], dict] = dict  # → {"migrations_in": n, "migrations_out_failed": n, "fallbacks": n, ...}


class WorkerMetrics:
    def __init__(self, worker_id: str, role: str, options: MetricsOptions, stats: EngineStats, sources: Sources):
        self.worker_id, self.role, self.options, self.stats, self.sources = worker_id, role, options, stats, sources
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self._server: ThreadingHTTPServer | None = None
        self.url: str | None = None

    @property
    def labels(self) -> dict[str, str]:
        return {"model_name": self.options.model_name, "worker": self.worker_id, "role": self.role}

    # --- the endpoint
    def serve(self, advertise_host: str) -> str | None:
        """Listen (the first free port from options.port on); → the /metrics URL at `advertise_host`."""
        if self.options.port is None or self._server is not None:
            return self.url
        handler = _handler(self)
        tries = 1 if self.options.port == 0 else PORT_TRIES
        for port in range(self.options.port, self.options.port + tries):
            try:
                self._server = ThreadingHTTPServer((self.options.host, port), handler)
                break
            except OSError as e:
                last = e
        else:
            raise OSError(f"{self.worker_id}: no free metrics port in {self.options.port}.."
                          f"{self.options.port + tries - 1}: {last}")
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name=f"metrics-{self.worker_id}", daemon=True).start()
        self.url = f"http://{advertise_host}:{self._server.server_address[1]}/metrics"
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def health(self) -> tuple[bool, str]:
        stalled = self.stats.stalled_for()
        if stalled > self.options.stall_s:
            return False, f"{self.worker_id}: a step has been running for {stalled:.0f} s (limit {self.options.stall_s:g} s)"
        return True, f"{self.worker_id}: ok, {self.stats.steps} steps"

    # --- the stats line
    async def log_stats(self, interval_s: float) -> None:
        """Every `interval_s`: running, waiting, KV use, tokens/s since the last line; an idle
        worker logs one line on turning idle, then none until it has work again."""
        last, prompt, generated = time.monotonic(), self.stats.prompt_tokens, self.stats.generation_tokens
        was_idle = False
        while True:
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            load, usage = _read(self.sources)
            idle = not (load.running or load.waiting or self.stats.prompt_tokens - prompt
                        or self.stats.generation_tokens - generated)
            if idle and was_idle:
                last = now
                continue
            was_idle = idle
            elapsed = max(now - last, 1e-9)
            log.info("%s: running %d, waiting %d, KV %.1f%% (fullest pool), prompt %.1f tok/s, generation %.1f tok/s",
                     self.worker_id, load.running, load.waiting, 100 * max(usage.values(), default=0.0),
                     (self.stats.prompt_tokens - prompt) / elapsed, (self.stats.generation_tokens - generated) / elapsed)
            last, prompt, generated = now, self.stats.prompt_tokens, self.stats.generation_tokens


def _handler(metrics: WorkerMetrics) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?")[0] == "/metrics":
                status, body, ctype = 200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST
            elif self.path == "/health":
                ok, text = metrics.health()
                status, body, ctype = (200 if ok else 503), text.encode(), "text/plain; charset=utf-8"
            else:
                status, body, ctype = 404, b"not found: /metrics, /health\n", "text/plain; charset=utf-8"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # scrapes are not news
            pass

    return Handler


class _Collector:
    """Every series of one worker, each labelled model_name, worker and role."""

    def __init__(self, metrics: WorkerMetrics):
        self.m = metrics

    def collect(self):
        m, stats = self.m, self.m.stats
        base = m.labels
        names, values = list(base), list(base.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        load, usage = _read(m.sources)
        fullest = max(usage.values(), default=0.0)
        yield gauge("v4serve_engine_requests_running", "Requests in the running batch.", load.running)
        yield gauge("v4serve_engine_requests_waiting", "Requests queued for admission.", load.waiting)
        yield gauge("v4serve_engine_queued_prefill_tokens", "Prompt tokens still to prefill here.",
                    load.queued_prefill_tokens)
        kv = GaugeMetricFamily("v4serve_engine_kv_usage_ratio", "Fraction of the KV pool's pages in use.",
                               labels=[*names, "kv_pool"])
        for pool, ratio in sorted(usage.items()):
            kv.add_metric([*values, pool], ratio)
        yield kv
        for h in (stats.queue_time, stats.prefill_time, stats.decode_time, stats.time_per_output_token):
            yield from _labelled(h.collect(), base)
        yield counter("v4serve_engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_queries)
        yield counter("v4serve_engine_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      stats.prefix_hits)
        yield counter("v4serve_engine_prompt_tokens", "Prompt tokens run through the model.", stats.prompt_tokens)
        yield counter("v4serve_engine_generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield counter("v4serve_engine_steps", "Model steps run.", stats.steps)
        if stats.spec_drafts:
            yield counter("v4serve_engine_spec_decode_draft_tokens", "Speculative tokens proposed.", stats.spec_drafts)
            yield counter("v4serve_engine_spec_decode_accepted_tokens", "Speculative tokens accepted.",
                          stats.spec_accepted)
        yield from self._transfers(names, values)
        # vLLM's names for what a vLLM dashboard or an inference-extension endpoint picker reads
        yield gauge("vllm:num_requests_running", "Requests in the running batch (v4serve_engine_requests_running).",
                    load.running)
        yield gauge("vllm:num_requests_waiting", "Requests queued (v4serve_engine_requests_waiting).", load.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV use of the fullest KV pool, 0..1.", fullest)
        yield gauge("vllm:gpu_cache_usage_perc", "KV use of the fullest KV pool, 0..1 (vLLM's former name).", fullest)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_hits)
        yield counter("vllm:generation_tokens", "Tokens generated.", stats.generation_tokens)

    def _transfers(self, names: list[str], values: list[str]):
        transfers, counts = self.m.sources.transfers(), dict(self.m.sources.counts())
        done = CounterMetricFamily("v4serve_engine_kv_transfers", "KV transfers completed, by direction.",
                                   labels=[*names, "direction"])
        nbytes = CounterMetricFamily("v4serve_engine_kv_transfer_bytes", "KV bytes written (sent) or verified "
                                     "(received).", labels=[*names, "direction"])
        failed = CounterMetricFamily("v4serve_engine_kv_transfer_failures", "Failed KV transfers by direction and "
                                     "reason.", labels=[*names, "direction", "reason"])
        for direction in ("sent", "received"):
            snap = transfers.get(direction) or {"transfers": 0, "bytes": 0, "failures": {}}
            done.add_metric([*values, direction], snap["transfers"])
            nbytes.add_metric([*values, direction], snap["bytes"])
            for reason, n in sorted(snap["failures"].items()):
                failed.add_metric([*values, direction, reason], n)
        migrations = CounterMetricFamily("v4serve_engine_migrations", "Live migrations of running requests, by "
                                         "direction and outcome.", labels=[*names, "direction", "outcome"])
        for direction in ("in", "out"):
            migrations.add_metric([*values, direction, "moved"], counts.get(f"migrations_{direction}", 0))
            migrations.add_metric([*values, direction, "failed"], counts.get(f"migrations_{direction}_failed", 0))
        fallbacks = CounterMetricFamily("v4serve_engine_kv_transfer_fallbacks", "Requests recomputed here because "
                                        "their KV transfer failed.", labels=names)
        fallbacks.add_metric(values, counts.get("fallbacks", 0))
        yield from (done, nbytes, failed, migrations, fallbacks)


def _read(sources: Sources, tries: int = 5):
    """(load, KV usage), read from another thread than the engine's: a queue that changed while
    it was iterated raises RuntimeError; the next read sees it settled."""
    for attempt in range(tries):
        try:
            return sources.load(), sources.kv_usage()
        except RuntimeError:
            if attempt == tries - 1:
                raise
            time.sleep(0.001)


def _labelled(families, labels: dict[str, str]):
    """`families` (of an unregistered, unlabelled metric) with `labels` added to every sample."""
    for family in families:
        out = Metric(family.name, family.documentation, family.type)
        for s in family.samples:
            out.add_sample(s.name, {**labels, **s.labels}, s.value)
        yield out
