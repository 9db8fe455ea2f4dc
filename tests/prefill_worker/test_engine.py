"""Prefill engine → (page copy) → decode engine gives exactly the tokens of `generate`."""

import random

import pytest

from cluster.messages import GenerateRequest
from decode_worker.engine import DecodeEngine
from model.generate import generate
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tiny import random_weights, tiny_config
from model.tokenizer import ByteTokenizer
from model.transformer import Transformer
from prefill_worker.engine import PrefillConfig, PrefillEngine


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    m = Transformer(cfg)
    m.load_state_dict(random_weights({k: v.shape for k, v in m.state_dict().items()}, cfg, 0))
    return m


@pytest.mark.parametrize("fmt", ["fp32", "fp8_pack"])
def test_disaggregated_equals_generate(model, fmt):
    rng = random.Random(3)
    reqs = [GenerateRequest(f"r{i}", tuple(rng.randrange(256) for _ in range(rng.randrange(1, 300))),
                            max_tokens=rng.randrange(1, 12),
                            sampling=SamplingParams(temperature=0.8 * (i % 2), seed=i)) for i in range(8)]
    p_pools = KVPools(model.cfg, fmt, max_tokens=512, max_seqs=4)
    d_pools = KVPools(model.cfg, fmt, max_tokens=512, max_seqs=8)
    prefill = PrefillEngine(model, p_pools, "p0", PrefillConfig(token_budget=211, max_running=3))
    decode = DecodeEngine(model, d_pools, ByteTokenizer(model.cfg.vocab_size), "d0")
    for r in reqs:
        prefill.submit(r)
    by_id = {r.request_id: r for r in reqs}
    got = {r.request_id: [] for r in reqs}
    while prefill.has_work() or decode.has_work():
        for done in prefill.step():
            src = p_pools.resume_pages(done.seq)
            dst = {k: d_pools.alloc(k, len(v)) for k, v in src.items()}
            for kind in src:
                d_pools.buffers[kind][dst[kind]] = p_pools.buffers[kind][src[kind]]
            prefill.release(done)
            seq = d_pools.adopt(done.seq.num_tokens, dst)
            for c in decode.admit_transferred(by_id[done.request_id], seq, done.first_token):
                got[c.request_id].extend(c.token_ids)
        for c in decode.step():
            got[c.request_id].extend(c.token_ids)
    for r in reqs:
        pools = KVPools(model.cfg, fmt, max_tokens=512, max_seqs=1)
        ref = generate(model, pools, list(r.prompt_ids), r.max_tokens, r.sampling,
                       stop_ids=frozenset({model.cfg.eos_token_id})).token_ids
        assert got[r.request_id] == ref, r.request_id
    assert p_pools.num_free() == p_pools.idle_free() and d_pools.num_free() == d_pools.idle_free()
    assert prefill.computed_tokens == sum(len(r.prompt_ids) for r in reqs)
