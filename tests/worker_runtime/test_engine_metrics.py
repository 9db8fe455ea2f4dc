"""A worker's engine metrics (worker_runtime/engine_metrics.py) over real engines in one process:
request phases become histograms only for what happened (an aborted request observes no decode
time), every series carries model_name / worker / role, the endpoint serves /metrics and /health
(503 once a step runs past stall_s), workers sharing a node take consecutive ports, and the
stats line reports and then stays quiet while idle."""

from __future__ import annotations

import asyncio
import logging
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from decode_worker.engine import DecodeConfig, DecodeEngine
from model.checkpoint import load_checkpoint
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from prefill_worker.engine import PrefillConfig, PrefillEngine
from worker_runtime.engine_metrics import EngineStats, MetricsOptions, Sources, WorkerMetrics
from worker_runtime.wire import GenerateRequest


@pytest.fixture(scope="module")
def engine(tiny_official_ckpt):
    cfg, model = load_checkpoint(tiny_official_ckpt)
    pools = KVPools(cfg, "fp32", max_tokens=256, max_seqs=4)
    return DecodeEngine(model, pools, ByteTokenizer(cfg.vocab_size), "decode-0", DecodeConfig(max_running=4))


def request(rid: str, n: int) -> GenerateRequest:
    return GenerateRequest(rid, tuple(range(40, 60)), n, SamplingParams(), ignore_eos=True)


def metrics_of(engine, port: int | None = 0, stall_s: float = 600.0) -> WorkerMetrics:
    pools = engine.pools

    def kv_usage():
        free = pools.num_free()
        return {k: 1 - free[k] / s.num_pages for k, s in pools.specs.items()}

    return WorkerMetrics("decode-0", "decode", MetricsOptions(port, host="127.0.0.1", model_name="tiny-v4",
                                                              stall_s=stall_s),
                         engine.stats, Sources(engine.load, kv_usage,
                                               lambda: {"received": {"transfers": 2, "bytes": 4096,
                                                                     "failures": {"checksum": 1}}},
                                               lambda: {"migrations_out": 3, "fallbacks": 1}))


def scrape(url: str) -> dict[str, list]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_phases_tokens_and_labels(engine):
    engine.stats = EngineStats()
    engine.submit(request("done", 5))
    engine.submit(request("cut", 50))
    for _ in range(6):
        engine.step()
    engine.abort("cut")
    m = metrics_of(engine, port=None)
    families = {f.name: f.samples for f in m.registry.collect()}
    for name, samples in families.items():
        for s in samples:
            assert {"model_name": "tiny-v4", "worker": "decode-0", "role": "decode"}.items() <= s.labels.items(), name

    def value(family, sample, **labels):
        return next(s.value for s in families[family] if s.name == sample and labels.items() <= s.labels.items())

    assert value("v4serve_engine_request_queue_time_seconds", "v4serve_engine_request_queue_time_seconds_count") == 2
    assert value("v4serve_engine_request_prefill_time_seconds",
                 "v4serve_engine_request_prefill_time_seconds_count") == 2
    # only the finished request has a decode time and a time per output token
    assert value("v4serve_engine_request_decode_time_seconds", "v4serve_engine_request_decode_time_seconds_count") == 1
    assert value("v4serve_engine_time_per_output_token_seconds",
                 "v4serve_engine_time_per_output_token_seconds_count") == 1
    assert value("v4serve_engine_generation_tokens", "v4serve_engine_generation_tokens_total") == 5 + 6
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") == 11
    assert value("v4serve_engine_prompt_tokens", "v4serve_engine_prompt_tokens_total") == 40
    assert value("v4serve_engine_kv_transfers", "v4serve_engine_kv_transfers_total", direction="received") == 2
    assert value("v4serve_engine_kv_transfer_failures", "v4serve_engine_kv_transfer_failures_total",
                 direction="received", reason="checksum") == 1
    assert value("v4serve_engine_migrations", "v4serve_engine_migrations_total", direction="out",
                 outcome="moved") == 3
    assert value("v4serve_engine_requests_running", "v4serve_engine_requests_running") == 0
    assert value("vllm:num_requests_waiting", "vllm:num_requests_waiting") == 0
    assert "v4serve_engine_spec_decode_draft_tokens" not in families  # no speculation ran
    assert engine.stats._phases == {}  # nothing left behind


def test_prefill_phases_and_an_abort_while_queued(tiny_official_ckpt):
    cfg, model = load_checkpoint(tiny_official_ckpt)
    pools = KVPools(cfg, "fp32", max_tokens=256, max_seqs=4)
    prefill = PrefillEngine(model, pools, "prefill-0", PrefillConfig(token_budget=64, max_running=1))
    prefill.submit(request("a", 1))
    prefill.submit(request("b", 1))  # queued behind a: max_running 1
    prefill.abort("b")
    done = []
    while prefill.has_work():
        done += prefill.step()
    assert [d.request_id for d in done] == ["a"]
    stats = prefill.stats
    assert stats._phases == {}  # the aborted one left nothing behind either
    for histogram in (stats.queue_time, stats.prefill_time):  # a's, not b's
        assert [s.value for s in histogram.collect()[0].samples if s.name.endswith("_count")] == [1]
    assert stats.prompt_tokens == 20 and stats.generation_tokens == 0 and stats.steps >= 1


def test_endpoint_health_and_ports(engine):
    engine.stats = EngineStats()
    first, second = metrics_of(engine, port=0, stall_s=0.05), None
    try:
        url = first.serve("127.0.0.1")
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert "v4serve_engine_requests_running" in scrape(url)
        health = url.replace("/metrics", "/health")
        assert urllib.request.urlopen(health, timeout=10).status == 200
        engine.stats.step_began()  # a step that never returns
        asyncio.run(asyncio.sleep(0.1))
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(health, timeout=10)
        assert err.value.code == 503 and b"a step has been running" in err.value.read()
        engine.stats.step_ended()
        assert urllib.request.urlopen(health, timeout=10).status == 200
        first.stop()
        # two workers of one node from the same configured port: the second takes a later one (the
        # freed port itself may meanwhile be a client socket's ephemeral port: `first` then moves on too)
        first, second = metrics_of(engine, port=port), metrics_of(engine, port=port)
        urls = [first.serve("127.0.0.1"), second.serve("127.0.0.1")]
        ports = [int(u.rsplit(":", 1)[1].split("/")[0]) for u in urls]
        assert port <= ports[0] < ports[1], urls
        assert all(scrape(u) for u in urls)
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_stats_line_then_quiet_while_idle(engine, caplog):
    engine.stats = EngineStats()
    m = metrics_of(engine, port=None)

    async def run():
        task = asyncio.create_task(m.log_stats(0.05))
        engine.submit(request("r", 3))
        for _ in range(3):
            engine.step()
        await asyncio.sleep(0.5)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="worker_runtime.engine_metrics"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records]
    assert lines and lines[0].startswith("decode-0: running ") and "generation " in lines[0] and "tok/s" in lines[0]
    assert "KV " in lines[0] and "waiting 0" in lines[0]
    assert len(lines) <= 2, lines  # the busy interval, then one idle line, then none
