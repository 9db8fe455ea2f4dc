"""Logprobs and the sampling controls over the whole request path in one process (router → prefill
worker → KV transfer → decode worker): the tokens are `generate`'s with the same penalties, and
each token's logprob (the first one sampled on the prefill worker and carried in the transfer's
header) is the log-softmax of the logits `generate` sampled it from."""

import asyncio

import pytest

httpx = pytest.importorskip("httpx")

import torch

from model.checkpoint import load_checkpoint
from model.generate import generate
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tokenizer import load_tokenizer
from tests.worker_runtime.pd_in_process import pd_in_process
from worker_runtime.options import WorkerOptions


def test_logprobs_and_penalties_through_prefill_and_decode_workers(tiny_official_ckpt, registry_url):
    cfg, model = load_checkpoint(tiny_official_ckpt)
    prompt = [(i * 37) % 250 for i in range(60)]
    sampling = SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.5, frequency_penalty=0.5,
                              logit_bias=((65, 2.0),), min_tokens=3)
    options = WorkerOptions(str(tiny_official_ckpt), registry_url, cluster="inproc", max_tokens=256, max_seqs=4,
                            prefill_token_budget=96, heartbeat_s=0.2)

    async def run():
        tokenizer = load_tokenizer(str(tiny_official_ckpt), cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
        async with pd_in_process(options, tokenizer) as pd, httpx.AsyncClient(
                base_url=pd.router.http_url, timeout=120) as client:
            r = await client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 6, "temperature": 0.7, "seed": 5, "repetition_penalty": 1.5,
                "frequency_penalty": 0.5, "logit_bias": {"65": 2.0}, "min_tokens": 3, "logprobs": 2,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.3)
            return r.json()["choices"][0], pd.decode.page_accounting()

    choice, d_acct = asyncio.run(run())
    assert d_acct["fallbacks"] == 0 and d_acct["transfers"]["transfers"] == 1  # the first token: prefill's
    pools = KVPools(cfg, "fp32", max_tokens=256, max_seqs=1)
    ref = generate(model, pools, prompt, 6, sampling, stop_ids=frozenset({cfg.eos_token_id}), keep_logits=True)
    assert choice["token_ids"] == ref.token_ids
    assert ref.token_ids != generate(model, pools, prompt, 6, sampling.unadjusted,
                                     stop_ids=frozenset({cfg.eos_token_id})).token_ids
    lp = torch.log_softmax(ref.logits.double(), -1)
    got = choice["logprobs"]["token_logprobs"]
    assert len(got) == len(ref.token_ids)
    for i, (t, v) in enumerate(zip(ref.token_ids, got)):
        assert abs(v - lp[i, t].item()) < 1e-5, i
        # the top dict is keyed by text: byte pieces of one character share the key U+FFFD
        assert choice["logprobs"]["top_logprobs"][i][choice["logprobs"]["tokens"][i]] >= v - 1e-6
