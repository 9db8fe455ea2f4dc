"""Decode engine: continuous batching gives exactly the tokens of `generate` (invariant 1)."""

import random

import pytest

from decode_worker.engine import DecodeConfig, DecodeEngine
from model.generate import generate
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tiny import random_model, tiny_config
from model.tokenizer import ByteTokenizer
from tests.model.invariance_cases import LogitRecorder, assert_same_as_alone, long_prompts, tie_model
from worker_runtime.wire import GenerateRequest


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config())


def reference(model, req: GenerateRequest) -> list[int]:
    pools = KVPools(model.cfg, "fp32", max_tokens=len(req.prompt_ids) + req.max_tokens, max_seqs=1)
    return generate(model, pools, list(req.prompt_ids), req.max_tokens, req.sampling,
                    stop_ids=frozenset({model.cfg.eos_token_id})).token_ids


def run_all(engine: DecodeEngine, requests, arrivals) -> dict[str, list[int]]:
    """Submit requests at the given steps (new arrivals join between steps); collect tokens."""
    out = {r.request_id: [] for r in requests}
    finished, step = set(), 0
    while len(finished) < len(requests):
        for r, at in zip(requests, arrivals):
            if at == step:
                engine.submit(r)
        for chunk in engine.step():
            out[chunk.request_id].extend(chunk.token_ids)
            if chunk.finish_reason or chunk.error:
                finished.add(chunk.request_id)
        step += 1
        assert step < 2000
    return out


def test_batched_outputs_equal_single_request_outputs(model):
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(150)]
    requests = []
    for i in range(12):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(256) for _ in range(rng.randrange(5, 200))]
        sampling = SamplingParams() if i % 2 else SamplingParams(temperature=0.9, top_p=0.95, seed=i)
        requests.append(GenerateRequest(f"r{i}", tuple(prompt), max_tokens=rng.randrange(4, 24), sampling=sampling))
    pools = KVPools(model.cfg, "fp32", max_tokens=512, max_seqs=6)  # fewer slots than requests: some wait
    engine = DecodeEngine(model, pools, ByteTokenizer(model.cfg.vocab_size), "d0", DecodeConfig(prefill_token_budget=97))
    got = run_all(engine, requests, arrivals=[rng.randrange(0, 30) for _ in requests])
    for r in requests:
        assert got[r.request_id] == reference(model, r), r.request_id
    assert pools.num_free() == pools.idle_free()


def test_long_prompts_batched_with_other_requests_give_the_logits_of_generate():
    """Prompts of 600+ tokens on the tie-heavy model (`invariance_cases`), prefilled locally in
    chunks of a 97-token budget beside other requests' chunks and decode steps, arriving at
    different steps: each request's logits, every one it sampled from, are generate's bits."""
    model = tie_model()
    recorder = LogitRecorder(model)
    prompts = long_prompts(21, [610, 680, 25, 640])
    requests = [GenerateRequest(f"L{i}", tuple(p), max_tokens=5, ignore_eos=True,
                                sampling=SamplingParams(temperature=0.9 * (i % 2), seed=i)) for i, p in enumerate(prompts)]
    pools = KVPools(model.cfg, "fp32", max_tokens=700, max_seqs=4)
    engine = DecodeEngine(recorder, pools, ByteTokenizer(model.cfg.vocab_size), "d0", DecodeConfig(prefill_token_budget=97))
    recorder.engines.append(engine)
    got = run_all(engine, requests, arrivals=[0, 2, 3, 9])
    assert_same_as_alone(model, recorder, got, requests)
    assert pools.num_free() == pools.idle_free()


def test_stop_conditions(model):
    prompt = tuple(range(60, 90))
    ref = reference(model, GenerateRequest("x", prompt, max_tokens=12))
    stop_tok = ref[5]
    pools = KVPools(model.cfg, "fp32", max_tokens=256, max_seqs=4)
    engine = DecodeEngine(model, pools, ByteTokenizer(model.cfg.vocab_size), "d0")
    reqs = [GenerateRequest("len", prompt, max_tokens=7),
            GenerateRequest("tok", prompt, max_tokens=12, stop_token_ids=(stop_tok,))]
    chunks = {}
    for r in reqs:
        engine.submit(r)
    while engine.has_work():
        for c in engine.step():
            chunks.setdefault(c.request_id, []).append(c)
    assert [t for c in chunks["len"] for t in c.token_ids] == ref[:7] and chunks["len"][-1].finish_reason == "length"
    assert [t for c in chunks["tok"] for t in c.token_ids] == ref[:ref.index(stop_tok) + 1]
    assert chunks["tok"][-1].finish_reason == "stop" and chunks["tok"][-1].usage.completion_tokens == ref.index(stop_tok) + 1
    assert pools.num_free() == pools.idle_free()


def test_abort_at_random_points_leaves_pools_idle(model):
    rng = random.Random(1)
    pools = KVPools(model.cfg, "fp32", max_tokens=256, max_seqs=8)
    engine = DecodeEngine(model, pools, ByteTokenizer(model.cfg.vocab_size), "d0", DecodeConfig(prefill_token_budget=64))
    live = []
    for i in range(60):
        req = GenerateRequest(f"a{i}", tuple(rng.randrange(256) for _ in range(rng.randrange(1, 120))), max_tokens=20)
        engine.submit(req)
        live.append(req.request_id)
        if rng.random() < 0.7:
            engine.step()
        if rng.random() < 0.5:
            engine.abort(live.pop(rng.randrange(len(live))))
    for rid in live:
        engine.abort(rid)
    assert not engine.has_work()
    assert pools.num_free() == pools.idle_free()


def test_a_step_settled_between_steps_still_returns_its_chunks(model):
    """A request's step in flight is settled outside `step` (a pause, an abort of another request)
    and ends that request: its last chunk waits in the engine, which has work until it returns
    it, so the owner's loop steps once more. An abort of a request that ended already (a stream's
    cleanup) settles nothing."""
    req = GenerateRequest("last", tuple(range(30)), max_tokens=5, ignore_eos=True)
    e = DecodeEngine(model, KVPools(model.cfg, "fp32", max_tokens=512, max_seqs=2),
                     ByteTokenizer(model.cfg.vocab_size), "d", DecodeConfig())
    e.submit(req)
    chunks = []
    while e.has_work():
        chunks += e.step()
        if e.ahead is not None and len(e.running["last"].tokens) == req.max_tokens - 1:
            assert not e.abort("ended-before") and e.ahead is not None  # nothing settled
            e.pause("no-such-request")  # settles the step in flight, which ends the request
            assert e.ahead is None and "last" not in e.running and e.has_work() and not e.idle()
    assert [t for c in chunks for t in c.token_ids] == reference(model, req)
    assert chunks[-1].finish_reason == "length" and e.idle()
    assert e.pools.num_free() == e.pools.idle_free()


def test_overlapped_steps_queue_the_next_step_and_change_no_token(model):
    """With overlap (the default) a decode-only step queues the next one before its ids reach the
    host: the engine holds a step in flight between calls while its requests decode. The tokens
    are those of an engine stepping one at a time (greedy and drawn, requests ending at different
    steps); an abort while a step is in flight drops the aborted request's token there, the others
    go on unchanged, and every page comes back."""
    rng = random.Random(5)
    reqs = [GenerateRequest(f"o{i}", tuple(rng.randrange(256) for _ in range(20 + 30 * i)), max_tokens=14 - 3 * i,
                            ignore_eos=True, sampling=SamplingParams(temperature=0.8 * (i % 2), seed=i))
            for i in range(3)]

    def serve(overlap: bool, abort_after: int = 0):
        e = DecodeEngine(model, KVPools(model.cfg, "fp32", max_tokens=512, max_seqs=4),
                         ByteTokenizer(model.cfg.vocab_size), "d", DecodeConfig(overlap=overlap))
        for r in reqs:
            e.submit(r)
        out, ahead, steps = {r.request_id: [] for r in reqs}, 0, 0
        while e.has_work():
            for chunk in e.step():
                out[chunk.request_id] += chunk.token_ids
            ahead += e.ahead is not None
            steps += 1
            if steps == abort_after:
                assert e.ahead is not None and e.abort("o0")
        assert e.pools.num_free() == e.pools.idle_free() and e.idle()
        return out, ahead

    plain, ahead = serve(False)
    assert ahead == 0
    assert all(plain[r.request_id] == reference(model, r) for r in reqs)
    got, ahead = serve(True)
    assert got == plain and ahead >= 8
    cut, _ = serve(True, abort_after=5)
    assert cut["o1"] == plain["o1"] and cut["o2"] == plain["o2"]
    assert 0 < len(cut["o0"]) < len(plain["o0"]) and cut["o0"] == plain["o0"][: len(cut["o0"])]
