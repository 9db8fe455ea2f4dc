"""A decode worker's replica on the GPU, as `v4serve up --device cuda` builds it: the device format
through the Triton kernels, fp8_pack pools, CUDA graphs for decode steps (shared scratch request),
driven by the decode engine's continuous batching."""

import dataclasses

import pytest
import torch

from decode_worker.engine import DecodeConfig, DecodeEngine
from model.quantized import Fp8Linear
from model.tokenizer import ByteTokenizer
from worker_runtime.model_loader import DecodeGraphs, load_replica
from worker_runtime.options import WorkerOptions
from worker_runtime.wire import GenerateRequest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_TOKENS = 16


def _serve(engine: DecodeEngine, requests) -> dict[str, list[int]]:
    for r in requests:
        engine.submit(r)
    tokens = {r.request_id: [] for r in requests}
    while engine.has_work():
        for chunk in engine.step():
            assert chunk.error is None, chunk.error
            tokens[chunk.request_id] += chunk.token_ids
    return tokens


def test_gpu_replica_serves_with_decode_graphs(tiny_official_ckpt):
    options = WorkerOptions(str(tiny_official_ckpt), "", kv_dtype="fp8_pack", max_tokens=512, max_seqs=4,
                            device="cuda", kernels="triton", decode_graphs=(1, 2, 4))
    cfg, model, pools = load_replica(options)
    assert pools.buffers["swa"].is_cuda and any(isinstance(m, Fp8Linear) for m in model.modules())
    graphs = DecodeGraphs(model, pools, options.decode_graphs, options.max_tokens)
    tokenizer = ByteTokenizer(cfg.vocab_size)
    engine = DecodeEngine(model, pools, tokenizer, "d", DecodeConfig(max_running=4), graphs)
    g = torch.Generator().manual_seed(0)
    requests = [GenerateRequest(f"r{i}", tuple(torch.randint(0, 256, (n,), generator=g).tolist()),
                                max_tokens=MAX_TOKENS, ignore_eos=True) for i, n in enumerate((150, 37, 90))]
    got = _serve(engine, requests)
    assert all(len(t) == MAX_TOKENS for t in got.values())
    assert graphs.replays >= MAX_TOKENS - 1  # every all-decode step replayed a graph
    # the scratch request stays held; every request's pages came back
    assert pools.num_free() == engine.idle_free() and engine.idle_free() != pools.idle_free()

    # the same weights eagerly, in pools of their own: graphs pad rows to the bucket, so this is
    # not bitwise (no batch invariance on GPU, docs/gpu.md), but greedy tokens agree
    _, _, eager_pools = load_replica(dataclasses.replace(options, decode_graphs=()))
    eager = _serve(DecodeEngine(model, eager_pools, tokenizer, "e", DecodeConfig(max_running=4)), requests)
    assert all(got[r][0] == eager[r][0] for r in got)  # first tokens: the same prefill step
    assert sum(got[r] == eager[r] for r in got) >= 2
