"""Prompt logprobs (echo) where a prompt is prefilled: on a prefill engine, with and without a
prefix-cache hit, and on a decode engine prefilling locally (with and without speculation). Each
prompt token's logprob and top k agree with transformers' DeepseekV4ForCausalLM log-softmax to
1e-4 (same random weights, fp32 pools); a request without prompt logprobs gets none.

The engine cases against transformers are exhaustive: in CI, tests/router/test_echo_in_process.py
checks the same paths (prefill worker with a cache hit, decode-side chunked prefill, max_tokens 0)
against transformers through the router; the speculative case below is in CI."""

import pytest
import torch

pytest.importorskip("transformers")

from decode_worker.engine import DecodeConfig, DecodeEngine
from model.kv_pool import KVPools
from model.tiny import random_model, tiny_config
from model.tokenizer import ByteTokenizer
from prefill_worker.engine import PrefillConfig, PrefillEngine
from prefill_worker.prefix_store import PrefixStore
from tests.model.test_oracle import CONFIGS, Pair, random_ids
from worker_runtime.wire import GenerateRequest

TOL = 1e-4
TOP = 3


@pytest.fixture(scope="module")
def pair() -> Pair:
    return Pair(CONFIGS["tiny"])


def check(pair: Pair, prompt: list[int], lps) -> None:
    """lps: the logprobs of prompt tokens 1.. against the reference's log-softmax."""
    ref = torch.log_softmax(pair.reference(torch.tensor(prompt)).double(), -1)
    assert [lp.token for lp in lps] == prompt[1:]
    for row, lp in zip(ref[:-1], lps):
        assert abs(lp.logprob - row[lp.token].item()) < TOL
        assert len(lp.top) == TOP
        for t, v in lp.top:
            assert abs(v - row[t].item()) < TOL
        assert row[[t for t, _ in lp.top]].min() >= row.topk(TOP).values.min() - TOL


def prefill(engine: PrefillEngine, req: GenerateRequest):
    engine.submit(req)
    while engine.has_work():
        for done in engine.step():
            engine.release(done)
            return done


@pytest.mark.exhaustive
def test_prefill_engine_prompt_logprobs_with_and_without_a_cache_hit(pair):
    pools = KVPools(pair.cfg, "fp32", page_size=128, max_tokens=1024, max_seqs=4)
    engine = PrefillEngine(pair.ours, pools, "p0", PrefillConfig(token_budget=67), store=PrefixStore(pools, "p0"))
    prompt = random_ids(pair.cfg, 150, 3).tolist()
    plain = prefill(engine, GenerateRequest("a", tuple(prompt), 1))
    assert plain.prompt_logprobs is None
    # the prompt's pages are cached now: a request asking for prompt logprobs computes every position
    # anyway, and one that does not reuses them
    asked = prefill(engine, GenerateRequest("b", tuple(prompt), 1, prompt_logprobs=TOP))
    assert asked.computed_tokens == len(prompt)
    check(pair, prompt, asked.prompt_logprobs)
    assert asked.first_token == plain.first_token
    assert prefill(engine, GenerateRequest("c", tuple(prompt), 1)).computed_tokens < len(prompt)


@pytest.mark.exhaustive
@pytest.mark.parametrize("max_tokens", [0, 3])
def test_decode_engine_local_prefill_prompt_logprobs(pair, max_tokens):
    engine = DecodeEngine(pair.ours, KVPools(pair.cfg, "fp32", max_tokens=256, max_seqs=3),
                          ByteTokenizer(pair.cfg.vocab_size), "d0", DecodeConfig(prefill_token_budget=29))
    prompt = random_ids(pair.cfg, 61, 4).tolist()
    other = random_ids(pair.cfg, 40, 5).tolist()
    engine.submit(GenerateRequest("other", tuple(other), 8, ignore_eos=True))  # decodes beside it
    engine.submit(GenerateRequest("r", tuple(prompt), max_tokens, ignore_eos=True, prompt_logprobs=TOP, logprobs=1))
    chunks = {"r": [], "other": []}
    while not engine.idle():
        for c in engine.step():
            chunks[c.request_id].append(c)
    assert all(c.prompt_logprobs is None for c in chunks["other"])
    first, *rest = chunks["r"]
    check(pair, prompt, first.prompt_logprobs)
    assert all(c.prompt_logprobs is None for c in rest)
    tokens = [t for c in chunks["r"] for t in c.token_ids]
    assert len(tokens) == max_tokens and chunks["r"][-1].usage.completion_tokens == max_tokens
    assert chunks["r"][-1].finish_reason == "length"


def test_speculative_steps_give_the_prompt_logprobs_of_plain_steps():
    """A prompt prefilled in chunks beside another request's verify segments (speculation on)
    gets the prompt logprobs it gets without speculation."""
    model = random_model(tiny_config(), with_mtp=True)
    prompt = tuple(random_ids(model.cfg, 40, 6).tolist())

    def run(spec: int):
        engine = DecodeEngine(model, KVPools(model.cfg, "fp32", max_tokens=256, max_seqs=2, with_mtp=True),
                              ByteTokenizer(model.cfg.vocab_size), "d0",
                              DecodeConfig(prefill_token_budget=16, speculative_tokens=spec))
        engine.submit(GenerateRequest("other", tuple(range(5, 15)), 8, ignore_eos=True))
        engine.step()  # "other" decodes (and drafts) from here on
        engine.submit(GenerateRequest("r", prompt, 2, ignore_eos=True, prompt_logprobs=2))
        out = []
        while not engine.idle():
            out += [c for c in engine.step() if c.request_id == "r"]
        return out[0].prompt_logprobs, engine.spec_proposed

    (plain, _), (spec, proposed) = run(0), run(2)
    assert proposed > 0 and len(spec) == len(prompt) - 1
    assert [lp.token for lp in spec] == [lp.token for lp in plain]
    assert [lp.logprob for lp in spec] == pytest.approx([lp.logprob for lp in plain], abs=1e-6)
    assert [[t for t, _ in lp.top] for lp in spec] == [[t for t, _ in lp.top] for lp in plain]
