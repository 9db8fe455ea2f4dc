"""Prefill engine → (page copy) → decode engine gives exactly the tokens of `generate`."""

import random

import pytest

from decode_worker.engine import DecodeEngine
from model.generate import generate
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tiny import random_model, tiny_config
from model.tokenizer import ByteTokenizer
from prefill_worker.engine import PrefillConfig, PrefillEngine
from tests.model.invariance_cases import LogitRecorder, assert_same_as_alone, long_prompts, tie_model
from worker_runtime.wire import GenerateRequest


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config())


def run_pd(model, reqs, p_pools, prefill, d_pools, all_at_once=False, waves=None, decode=None):
    """Drive prefill → page copy → decode to completion; tokens per request. Requests go in one
    at a time (so later ones can reuse what earlier ones cached) unless `all_at_once`, or in the
    given `waves` (each waits for the one before to finish)."""
    decode = decode or DecodeEngine(model, d_pools, ByteTokenizer(model.cfg.vocab_size), "d0")
    by_id = {r.request_id: r for r in reqs}
    got = {r.request_id: [] for r in reqs}
    for batch in waves or ([reqs] if all_at_once else [[r] for r in reqs]):
        for r in batch:
            prefill.submit(r)
        while prefill.has_work() or decode.has_work():
            for done in prefill.step():
                src = {k: v for k, v in p_pools.resume_pages(done.seq).items()}
                dst = {k: d_pools.alloc(k, len(v)) for k, v in src.items()}
                for kind in src:
                    d_pools.buffers[kind][dst[kind]] = p_pools.buffers[kind][src[kind]]
                prefill.release(done)
                seq = d_pools.adopt(done.seq.num_tokens, dst)
                for c in decode.admit_transferred(by_id[done.request_id], seq, done.first_token):
                    got[c.request_id].extend(c.token_ids)
            for c in decode.step():
                got[c.request_id].extend(c.token_ids)
    return got


@pytest.mark.parametrize("fmt", ["fp32", "fp8_pack"])
def test_disaggregated_equals_generate(model, fmt):
    rng = random.Random(3)
    reqs = [GenerateRequest(f"r{i}", tuple(rng.randrange(256) for _ in range(rng.randrange(1, 300))),
                            max_tokens=rng.randrange(1, 12),
                            sampling=SamplingParams(temperature=0.8 * (i % 2), seed=i)) for i in range(8)]
    p_pools = KVPools(model.cfg, fmt, max_tokens=512, max_seqs=4)
    d_pools = KVPools(model.cfg, fmt, max_tokens=512, max_seqs=8)
    prefill = PrefillEngine(model, p_pools, "p0", PrefillConfig(token_budget=211, max_running=3))
    got = run_pd(model, reqs, p_pools, prefill, d_pools, all_at_once=True)
    for r in reqs:
        pools = KVPools(model.cfg, fmt, max_tokens=512, max_seqs=1)
        ref = generate(model, pools, list(r.prompt_ids), r.max_tokens, r.sampling,
                       stop_ids=frozenset({model.cfg.eos_token_id})).token_ids
        assert got[r.request_id] == ref, r.request_id
    assert p_pools.num_free() == p_pools.idle_free() and d_pools.num_free() == d_pools.idle_free()
    assert prefill.computed_tokens == sum(len(r.prompt_ids) for r in reqs)


@pytest.mark.parametrize("fmt", ["fp32", "fp8_pack"])
def test_prefix_cache_skips_repeated_prefixes_and_keeps_outputs(model, fmt):
    from prefill_worker.prefix_store import PrefixStore

    rng = random.Random(11)
    system = [rng.randrange(256) for _ in range(300)]
    turn1 = system + [rng.randrange(256) for _ in range(60)]
    turn2 = turn1 + [rng.randrange(256) for _ in range(230)]  # multi-turn: extends turn 1
    q = [system + [rng.randrange(256) for _ in range(rng.randrange(20, 90))] for _ in range(3)]
    prompts = [turn1, turn2] + q
    reqs = [GenerateRequest(f"c{i}", tuple(p), max_tokens=5, sampling=SamplingParams(temperature=0.7, seed=i))
            for i, p in enumerate(prompts)]
    p_pools = KVPools(model.cfg, fmt, page_size=128, max_tokens=1024, max_seqs=6)
    d_pools = KVPools(model.cfg, fmt, page_size=128, max_tokens=1024, max_seqs=6)
    store = PrefixStore(p_pools, "p0")
    prefill = PrefillEngine(model, p_pools, "p0", PrefillConfig(token_budget=100), store=store)
    got = run_pd(model, reqs, p_pools, prefill, d_pools)
    for r in reqs:
        pools = KVPools(model.cfg, fmt, max_tokens=1024, max_seqs=1)
        ref = generate(model, pools, list(r.prompt_ids), r.max_tokens, r.sampling,
                       stop_ids=frozenset({model.cfg.eos_token_id})).token_ids
        assert got[r.request_id] == ref, r.request_id
    total = sum(len(p) for p in prompts)
    # turn 1 caches its pages up to its last page boundary (256); turn 2 and each question
    # (which diverge from the tree at 300, inside the system prompt) resume from there
    assert prefill.computed_tokens == total - 4 * 256
    assert store.events and {e.kind for e in store.events} >= {"stored"}
    store.cache.evict_full(10 ** 9)
    assert p_pools.num_free() == p_pools.idle_free() and d_pools.num_free() == d_pools.idle_free()


def test_long_prompts_batched_chunked_and_cached_give_the_logits_of_generate():
    """Prompts of 600+ tokens on the tie-heavy model (`invariance_cases`): two prefilled beside
    each other in 211-token budgets, then two that reuse the first's pages from the prefix cache
    (one sharing its first 520 tokens, one the whole prompt), each shipped to a decode engine:
    every request's logits, the first token's included, are generate's bits."""
    from prefill_worker.prefix_store import PrefixStore

    model = tie_model()
    recorder = LogitRecorder(model)
    system, own, other, tail = long_prompts(31, [520, 100, 650, 90])
    prompts = [system + own, other, system + tail, system + own]
    reqs = [GenerateRequest(f"k{i}", tuple(p), max_tokens=4, ignore_eos=True,
                            sampling=SamplingParams(temperature=0.7 * (i % 2), seed=i)) for i, p in enumerate(prompts)]
    p_pools = KVPools(model.cfg, "fp32", page_size=128, max_tokens=1024, max_seqs=4)
    d_pools = KVPools(model.cfg, "fp32", page_size=128, max_tokens=1024, max_seqs=4)
    store = PrefixStore(p_pools, "p0")
    prefill = PrefillEngine(recorder, p_pools, "p0", PrefillConfig(token_budget=211), store=store)
    decode = DecodeEngine(recorder, d_pools, ByteTokenizer(model.cfg.vocab_size), "d0")
    recorder.engines += [prefill, decode]
    got = run_pd(model, reqs, p_pools, prefill, d_pools, waves=[reqs[:2], reqs[2:]], decode=decode)
    assert prefill.computed_tokens <= sum(map(len, prompts)) - 2 * 512  # both late ones hit the cache
    assert_same_as_alone(model, recorder, got, reqs)
    store.cache.evict_full(10 ** 9)
    assert p_pools.num_free() == p_pools.idle_free() and d_pools.num_free() == d_pools.idle_free()


def test_divergence_point_snapshot_makes_shared_system_prompt_reusable(model):
    """q1 caches up to 640 with a state only at 640; q2 diverges at 600 and cannot resume, but
    snapshots at 512 where it diverged; q3 then resumes at 512."""
    from prefill_worker.prefix_store import PrefixStore

    rng = random.Random(12)
    system = [rng.randrange(256) for _ in range(600)]
    prompts = [system + [rng.randrange(256) for _ in range(50)] for _ in range(3)]
    reqs = [GenerateRequest(f"s{i}", tuple(p), max_tokens=3) for i, p in enumerate(prompts)]
    p_pools = KVPools(model.cfg, "fp32", page_size=128, max_tokens=1024, max_seqs=4)
    d_pools = KVPools(model.cfg, "fp32", page_size=128, max_tokens=1024, max_seqs=4)
    store = PrefixStore(p_pools, "p0")
    prefill = PrefillEngine(model, p_pools, "p0", PrefillConfig(token_budget=256), store=store)
    got = run_pd(model, reqs, p_pools, prefill, d_pools)
    for r in reqs:
        pools = KVPools(model.cfg, "fp32", max_tokens=1024, max_seqs=1)
        assert got[r.request_id] == generate(model, pools, list(r.prompt_ids), 3, r.sampling,
                                             stop_ids=frozenset({model.cfg.eos_token_id})).token_ids
    assert prefill.computed_tokens == 650 + 650 + (650 - 512)
    store.cache.evict_full(10 ** 9)
    assert p_pools.num_free() == p_pools.idle_free()
