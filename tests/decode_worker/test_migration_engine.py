"""Migration at the engine level, without the transport: a request paused at any token boundary,
its resume pages (SWA window, C4 / C4-indexer / C128 pages so far, compress-state rings) copied
byte for byte into another engine's pools and resumed there, yields exactly the tokens of
`generate` — here bounced between two engines several times, in every storage format. The
cluster tests (tests/cluster/test_migration.py) do the same over NIXL between Ray actors."""

import random

import pytest

from decode_worker.engine import DecodeConfig, DecodeEngine
from model.generate import generate
from model.kv_pool import KVPools, SeqKV
from model.sampling import SamplingParams
from model.tiny import random_model, tiny_config
from model.tokenizer import ByteTokenizer
from tests.model.invariance_cases import LogitRecorder, assert_same_as_alone, long_prompts, tie_model
from worker_runtime.wire import GenerateRequest, RequestState


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(index_topk=128))


def move(src: DecodeEngine, dst: DecodeEngine, rid: str) -> list:
    """What a migration does, minus NIXL: pause, copy the resume pages, adopt, hand off. → the
    chunks the pause settled (a step queued ahead, `decode_worker/overlap.py`), which the worker
    streams before the migration starts: the caller takes them in that order."""
    r = src.pause(rid)
    settled = src.take_failed()
    if r is None:  # it ended in a settled step (this one's, or an earlier pause's)
        assert rid not in src.running
        return settled
    assert r.state is RequestState.MIGRATING
    pages = {k: v for k, v in src.pools.resume_pages(r.seq).items() if v}
    got = {k: dst.pools.alloc(k, len(v)) for k, v in pages.items()}
    for kind, ids in pages.items():
        dst.pools.buffers[kind][got[kind]] = src.pools.buffers[kind][ids]
    seq = dst.pools.adopt(r.seq.num_tokens, got)
    extra = SeqKV()
    for kind, n in dst.pools.pages_needed(seq, dst.tokens_held(r.req)).items():
        extra.pages[kind] = dst.pools.alloc(kind, n)
    dst.admit_migrated(r.req, seq, r.migration_header(), extra)
    src.hand_off(rid)
    assert rid not in src.running
    return settled


# the production encoding in the CI subset; the others add ~20 s on a 2-core machine
@pytest.mark.parametrize("kv_dtype", [pytest.param("fp32", marks=pytest.mark.exhaustive),
                                      pytest.param("bf16", marks=pytest.mark.exhaustive), "fp8_pack"])
def test_bounced_requests_equal_generate(model, kv_dtype):
    rng = random.Random(1)
    engines = [DecodeEngine(model, KVPools(model.cfg, kv_dtype, max_tokens=512, max_seqs=4),
                            ByteTokenizer(model.cfg.vocab_size), f"d{i}") for i in range(2)]
    # prompts shorter than a compression window, across C4 / C128 boundaries and the sliding window
    reqs = [GenerateRequest(f"m{i}", tuple(rng.randrange(256) for _ in range(n)), max_tokens=40, ignore_eos=True,
                            sampling=SamplingParams(temperature=0.9 * (i % 2), top_k=20 * (i % 3), seed=i))
            for i, n in enumerate((3, 61, 130, 257))]
    for r in reqs:
        engines[0].submit(r)
    where = {r.request_id: 0 for r in reqs}
    out = {r.request_id: [] for r in reqs}
    text = {r.request_id: "" for r in reqs}
    done, step = set(), 0
    while len(done) < len(reqs):
        for e in engines:
            for chunk in e.step():
                out[chunk.request_id].extend(chunk.token_ids)
                text[chunk.request_id] += chunk.text
                if chunk.finish_reason:
                    done.add(chunk.request_id)
        step += 1
        for rid in list(where):  # every few steps, some decoding request changes engine
            e = engines[where[rid]]
            if rid not in done and rid in e.running and e.running[rid].state is RequestState.DECODING \
                    and rng.random() < 0.3:
                for chunk in move(e, engines[1 - where[rid]], rid):
                    out[chunk.request_id].extend(chunk.token_ids)
                    text[chunk.request_id] += chunk.text
                    if chunk.finish_reason:
                        done.add(chunk.request_id)
                where[rid] = 1 - where[rid]
        assert step < 500
    tok = ByteTokenizer(model.cfg.vocab_size)
    for r in reqs:
        pools = KVPools(model.cfg, kv_dtype, max_tokens=512, max_seqs=1)
        ref = generate(model, pools, list(r.prompt_ids), r.max_tokens, r.sampling).token_ids
        assert out[r.request_id] == ref, r.request_id
        assert text[r.request_id] == tok.decode(ref)
    for e in engines:
        assert e.pools.num_free() == e.pools.idle_free()


def test_long_prompts_bounced_between_engines_give_the_logits_of_generate():
    """Prompts of 600+ tokens on the tie-heavy model (`invariance_cases`), prefilled locally beside
    each other, then moved to the other engine every other step while they decode beside whatever
    that engine runs: every logits row they sampled from is generate's bits."""
    model = tie_model()
    recorder = LogitRecorder(model)
    engines = [DecodeEngine(recorder, KVPools(model.cfg, "fp8_pack", max_tokens=720, max_seqs=3),
                            ByteTokenizer(model.cfg.vocab_size), f"d{i}", DecodeConfig(prefill_token_budget=256))
               for i in range(2)]
    recorder.engines += engines
    prompts = long_prompts(41, [630, 700, 33])
    reqs = [GenerateRequest(f"g{i}", tuple(p), max_tokens=6, ignore_eos=True,
                            sampling=SamplingParams(temperature=0.8 * (i % 2), seed=i)) for i, p in enumerate(prompts)]
    engines[0].submit(reqs[0])
    engines[0].submit(reqs[1])
    engines[1].submit(reqs[2])
    got = {r.request_id: [] for r in reqs}
    done, step, moves = set(), 0, 0
    while len(done) < len(reqs):
        for e in engines:
            for chunk in e.step():
                got[chunk.request_id].extend(chunk.token_ids)
                if chunk.finish_reason:
                    done.add(chunk.request_id)
        step += 1
        for i, e in enumerate(engines):
            for rid in (e.decoding() if step % 2 else []):
                if rid != "g2":
                    for chunk in move(e, engines[1 - i], rid):
                        got[chunk.request_id].extend(chunk.token_ids)
                        if chunk.finish_reason:
                            done.add(chunk.request_id)
                    moves += 1
        assert step < 200
    assert moves >= 4
    assert_same_as_alone(model, recorder, got, reqs, "fp8_pack")
    for e in engines:
        assert e.pools.num_free() == e.pools.idle_free()


def test_pause_resume_and_states(model):
    engine = DecodeEngine(model, KVPools(model.cfg, "fp32", max_tokens=256, max_seqs=2),
                          ByteTokenizer(model.cfg.vocab_size), "d0")
    req = GenerateRequest("p", tuple(range(40, 90)), max_tokens=6, ignore_eos=True)
    engine.submit(req)
    assert engine.pause("p") is None  # waiting, not decoding: cannot migrate
    tokens = []
    while not tokens:
        tokens += [t for c in engine.step() for t in c.token_ids]
    assert engine.decoding() == ["p"]
    assert engine.pause("p").state is RequestState.MIGRATING
    assert not engine.has_work() and not engine.idle()  # paused: nothing to step, pages held
    engine.resume("p")  # the migration failed: it continues where it paused
    while engine.has_work():
        tokens += [t for c in engine.step() for t in c.token_ids]
    pools = KVPools(model.cfg, "fp32", max_tokens=256, max_seqs=1)
    assert tokens == generate(model, pools, list(req.prompt_ids), 6, req.sampling).token_ids
    assert engine.idle() and engine.pools.num_free() == engine.pools.idle_free()
