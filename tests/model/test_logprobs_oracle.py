"""The logprobs a decode engine sends agree with transformers' DeepseekV4ForCausalLM: the
log-softmax of its logits at every generated position, the sampled token's and the top 5, to 1e-4
(same random weights on both sides, fp32 pools; the pair of tests/model/test_oracle.py)."""

import pytest
import torch

pytest.importorskip("transformers")

from decode_worker.engine import DecodeEngine  # noqa: E402
from model.kv_pool import KVPools  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402
from model.tokenizer import ByteTokenizer  # noqa: E402
from tests.model.test_oracle import CONFIGS, Pair, random_ids  # noqa: E402
from worker_runtime.wire import GenerateRequest  # noqa: E402

TOL = 1e-4


def test_engine_logprobs_match_transformers():
    pair = Pair(CONFIGS["tiny"])
    prompt = random_ids(pair.cfg, 60, 5).tolist()
    engine = DecodeEngine(pair.ours, KVPools(pair.cfg, "fp32", max_tokens=128, max_seqs=2),
                          ByteTokenizer(pair.cfg.vocab_size), "d0")
    engine.submit(GenerateRequest("r", tuple(prompt), max_tokens=6, ignore_eos=True, logprobs=5,
                                  sampling=SamplingParams(temperature=1.0, seed=7)))
    lps = []
    while not engine.idle():
        for chunk in engine.step():
            lps += chunk.logprobs
    tokens = [lp.token for lp in lps]
    assert len(tokens) == 6
    ref = torch.log_softmax(pair.reference(torch.tensor(prompt + tokens)).double(), -1)[len(prompt) - 1:-1]
    for row, lp in zip(ref, lps):
        assert abs(lp.logprob - row[lp.token].item()) < TOL
        assert len(lp.top) == 5
        for t, v in lp.top:
            assert abs(v - row[t].item()) < TOL
        # the top 5 are the reference's top 5 but for near ties at the edge
        assert row[[t for t, _ in lp.top]].min() >= row.topk(5).values.min() - TOL
