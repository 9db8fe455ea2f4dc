"""Penalties, logit_bias and min_tokens in the engines give `generate`'s tokens (which applies
them as the reference): decoded with and without speculation (a draft is accepted iff it equals
the target's token under the same penalties state), and for the first token sampled on a prefill
engine."""

import random
from dataclasses import replace

import pytest

from decode_worker.engine import DecodeConfig, DecodeEngine
from model.generate import generate
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tiny import random_model, tiny_config
from model.tokenizer import ByteTokenizer
from prefill_worker.engine import PrefillEngine
from worker_runtime.wire import GenerateRequest


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), with_mtp=True)


def reference(model, req: GenerateRequest) -> list[int]:
    pools = KVPools(model.cfg, "fp32", max_tokens=len(req.prompt_ids) + req.max_tokens, max_seqs=1)
    stop = set(req.stop_token_ids) | (set() if req.ignore_eos else {model.cfg.eos_token_id})
    return generate(model, pools, list(req.prompt_ids), req.max_tokens, req.sampling, stop_ids=frozenset(stop)).token_ids


NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": ()}
# p1's bias makes 65 repeat, for its presence / frequency penalties to act on
PENALTIES = [{"repetition_penalty": 1.8}, {"frequency_penalty": 2.0, "presence_penalty": 1.0, "logit_bias": ((65, 6.0),)},
             {"logit_bias": ((65, 30.0), (66, 29.0))}, {"repetition_penalty": 0.6, "frequency_penalty": -1.0}]


def requests() -> list[GenerateRequest]:
    rng = random.Random(9)
    return [GenerateRequest(f"p{i}", tuple(rng.randrange(256) for _ in range(rng.randrange(8, 40))), max_tokens=8,
                            ignore_eos=True, sampling=SamplingParams(temperature=0.8 * (i in (0, 3)), seed=i, **kw))
            for i, kw in enumerate(PENALTIES)]


def run(engine, reqs) -> dict[str, list[int]]:
    out = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.submit(r)
    for _ in range(200):
        for chunk in engine.step():
            assert chunk.error is None
            out[chunk.request_id] += chunk.token_ids
        if engine.idle():
            return out
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("spec", [0, 2])
def test_penalised_requests_give_generates_tokens_with_and_without_speculation(model, spec):
    pools = KVPools(model.cfg, "fp32", max_tokens=512, max_seqs=4, with_mtp=True)
    e = DecodeEngine(model, pools, ByteTokenizer(model.cfg.vocab_size), "d0",
                     DecodeConfig(prefill_token_budget=64, speculative_tokens=spec))
    reqs = requests()
    got = run(e, reqs)
    changed = 0
    for r in reqs:
        assert got[r.request_id] == reference(model, r), r.request_id
        if spec:
            continue
        kw = PENALTIES[int(r.request_id[1:])]
        without = {k: NEUTRAL[k] for k in kw if k != "logit_bias" or len(kw) == 1}  # the penalties alone
        changed += got[r.request_id] != reference(model, replace(r, sampling=replace(r.sampling, **without)))
    assert spec or changed == len(reqs)  # every adjustment changes the output of its request
    assert got["p2"][0] == 65
    if spec:
        assert e.spec_proposed > 0


def test_min_tokens_and_the_prefill_engines_first_token(model):
    """min_tokens holds back a stop id the model would pick at once; the prefill engine's first
    token applies the prompt's repetition penalty and logit_bias as generate does."""
    base = GenerateRequest("m", tuple(range(40, 60)), max_tokens=6)
    first = reference(model, base)[0]
    req = replace(base, stop_token_ids=(first,), sampling=SamplingParams(min_tokens=3))
    pools = KVPools(model.cfg, "fp32", max_tokens=512, max_seqs=4, with_mtp=True)
    got = run(DecodeEngine(model, pools, ByteTokenizer(model.cfg.vocab_size), "d0"), [req])["m"]
    assert got == reference(model, req) and len(got) >= 3 and first not in got[:2]
    for kw in PENALTIES[:1] + PENALTIES[2:3] + [{"min_tokens": 1}]:
        r = replace(base, stop_token_ids=(first,), sampling=SamplingParams(**kw))
        pe = PrefillEngine(model, KVPools(model.cfg, "fp32", max_tokens=128, max_seqs=2, with_mtp=True), "p0")
        pe.submit(r)
        done = []
        while not done:
            done = pe.step()
        assert done[0].first_token == reference(model, r)[0]
        assert done[0].first_token != first or "repetition_penalty" in kw  # bias and min_tokens move it
