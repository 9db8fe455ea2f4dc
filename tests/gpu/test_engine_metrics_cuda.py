"""A GPU decode worker's engine metrics (worker_runtime/engine_metrics.py) as `v4serve up --device
cuda` serves: decode steps replayed from CUDA graphs still count steps, tokens and request phases,
every request's time per output token is observed, and /health stays 200 between steps and turns
503 once a step outlives the stall limit."""

import time
import urllib.error
import urllib.request

import pytest
import torch

from decode_worker.engine import DecodeConfig, DecodeEngine
from model.tokenizer import ByteTokenizer
from worker_runtime.engine_metrics import MetricsOptions, Sources, WorkerMetrics
from worker_runtime.model_loader import DecodeGraphs, load_replica
from worker_runtime.options import WorkerOptions
from worker_runtime.wire import GenerateRequest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_graph_replays_count_and_health(tiny_official_ckpt):
    options = WorkerOptions(str(tiny_official_ckpt), "", kv_dtype="fp8_pack", max_tokens=512, max_seqs=4,
                            device="cuda", kernels="triton", decode_graphs=(1, 2, 4))
    cfg, model, pools = load_replica(options)
    graphs = DecodeGraphs(model, pools, options.decode_graphs, options.max_tokens)
    engine = DecodeEngine(model, pools, ByteTokenizer(cfg.vocab_size), "decode-0", DecodeConfig(max_running=4), graphs)
    requests = [GenerateRequest(f"r{i}", tuple(range(30 + i, 90 + i)), max_tokens=12, ignore_eos=True)
                for i in range(3)]
    for r in requests:
        engine.submit(r)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    stats = engine.stats
    assert graphs.replays > 0 and stats.steps == steps
    assert stats.generation_tokens == 36 and stats.prompt_tokens == 180 and stats._phases == {}

    def count(h):
        return next(s.value for s in h.collect()[0].samples if s.name.endswith("_count"))

    assert count(stats.time_per_output_token) == count(stats.decode_time) == count(stats.queue_time) == 3
    metrics = WorkerMetrics("decode-0", "decode", MetricsOptions(0, host="127.0.0.1", stall_s=0.5), stats,
                            Sources(engine.load, lambda: {k: 1 - v / pools.specs[k].num_pages
                                                          for k, v in pools.num_free().items()}))
    url = metrics.serve("127.0.0.1").replace("/metrics", "/health")
    try:
        assert urllib.request.urlopen(url, timeout=10).status == 200
        stats.step_began()  # a step that does not come back within the stall limit
        time.sleep(0.6)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=10)
        assert err.value.code == 503
    finally:
        metrics.stop()
