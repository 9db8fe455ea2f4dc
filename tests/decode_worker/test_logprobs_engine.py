"""Each token's logprobs, as the engines send them, are the log-softmax of the logits `generate`
samples from (model/logprobs.py): batched beside requests that ask for none, with speculation on,
and for the first token sampled on a prefill engine and shipped in the TransferHeader."""

import random

import pytest
import torch

from decode_worker.engine import DecodeConfig, DecodeEngine
from model.generate import generate
from model.kv_pool import KVPools
from model.logprobs import TokenLogprobs, log_softmax
from model.sampling import SamplingParams
from model.tiny import random_model, tiny_config
from model.tokenizer import ByteTokenizer
from prefill_worker.engine import PrefillEngine
from worker_runtime.wire import GenerateRequest, TransferHeader


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), with_mtp=True)


def expected(model, req: GenerateRequest) -> list[TokenLogprobs]:
    """From `generate`'s logits: each token's log-softmax value and the top ones (ties: lower id)."""
    pools = KVPools(model.cfg, "fp32", max_tokens=len(req.prompt_ids) + req.max_tokens, max_seqs=1)
    out = generate(model, pools, list(req.prompt_ids), req.max_tokens, req.sampling, keep_logits=True)
    lp = torch.log_softmax(out.logits.double(), -1)
    values, ids = lp.sort(dim=-1, descending=True, stable=True)
    k = req.logprobs
    return [TokenLogprobs(t, lp[i, t].item(), tuple(zip(ids[i, :k].tolist(), values[i, :k].tolist())))
            for i, t in enumerate(out.token_ids)]


def close(got: list[TokenLogprobs], want: list[TokenLogprobs]) -> None:
    assert [g.token for g in got] == [w.token for w in want]
    for g, w in zip(got, want):
        assert abs(g.logprob - w.logprob) < 1e-5
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert max((abs(a - b) for (_, a), (_, b) in zip(g.top, w.top)), default=0) < 1e-5
        assert all(a >= b for (_, a), (_, b) in zip(g.top, g.top[1:]))


def requests(max_tokens: int = 5) -> list[GenerateRequest]:
    rng = random.Random(3)
    return [GenerateRequest(f"r{i}", tuple(rng.randrange(256) for _ in range(n)), max_tokens=max_tokens,
                            ignore_eos=True, logprobs=k, sampling=SamplingParams(temperature=0.9 * (i % 2), seed=i))
            for i, (n, k) in enumerate([(20, 5), (40, None), (9, 0), (30, 20)])]


def collect(engine, reqs) -> dict[str, list]:
    out = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.submit(r)
    for _ in range(200):
        for chunk in engine.step():
            assert chunk.error is None
            lps = chunk.logprobs or (None,) * len(chunk.token_ids)
            assert len(lps) == len(chunk.token_ids)
            out[chunk.request_id] += list(zip(chunk.token_ids, lps))
        if engine.idle():
            return out
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("spec", [0, 2])
def test_decode_engine_logprobs_are_the_log_softmax_of_generates_logits(model, spec):
    """Batched requests, greedy and sampled, some asking for no logprobs; with speculation the
    accepted drafts carry the target's logprobs at their rows."""
    pools = KVPools(model.cfg, "fp32", max_tokens=512, max_seqs=4, with_mtp=True)
    e = DecodeEngine(model, pools, ByteTokenizer(model.cfg.vocab_size), "d0",
                     DecodeConfig(prefill_token_budget=64, speculative_tokens=spec))
    reqs = requests()
    got = collect(e, reqs)
    for r in reqs:
        if r.logprobs is None:
            assert all(lp is None for _, lp in got[r.request_id])
            continue
        assert all(lp.token == t for t, lp in got[r.request_id])
        close([lp for _, lp in got[r.request_id]], expected(model, r))
    if spec:
        assert e.spec_proposed > 0


def test_first_token_logprobs_travel_from_the_prefill_engine(model):
    """The prefill engine's first token carries its logprobs; the TransferHeader keeps them exactly;
    the decode engine refuses a transfer that lost them."""
    req = requests()[0]
    src = KVPools(model.cfg, "fp32", max_tokens=512, max_seqs=2, with_mtp=True)
    pe = PrefillEngine(model, src, "p0")
    pe.submit(req)
    done = []
    while not done:
        done = pe.step()
    first = done[0].first_logprobs
    close([first], expected(model, req)[:1])
    header = TransferHeader(done[0].seq.num_tokens, done[0].first_token, done[0].computed_tokens, first)
    assert TransferHeader.from_bytes(header.to_bytes()) == header
    pe.release(done[0])
    pools = KVPools(model.cfg, "fp32", max_tokens=512, max_seqs=2, with_mtp=True)
    e = DecodeEngine(model, pools, ByteTokenizer(model.cfg.vocab_size), "d0")
    with pytest.raises(ValueError, match="without them"):
        e.admit_transferred(req, pools.adopt(0, {}), done[0].first_token)


def test_log_softmax_is_batch_invariant_and_exact():
    x = torch.randn(5, 4099) * 7
    alone = torch.cat([log_softmax(x[i:i + 1]) for i in range(5)])
    assert torch.equal(log_softmax(x), alone)
    assert (log_softmax(x).double() - torch.log_softmax(x.double(), -1)).abs().max() < 1e-5
