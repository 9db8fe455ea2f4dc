"""The whole request path in one process: the router's HTTP API → placement → a prefill worker →
KV over the in-process transport → a decode worker, with a real Valkey registry and no Ray or
NIXL. Tokens equal `generate` for each request alone (invariant 1), every request's KV came from
the prefill worker (no fallback to a local prefill), and pages return to idle."""

import asyncio
import random

import pytest

httpx = pytest.importorskip("httpx")

from model.checkpoint import load_checkpoint  # noqa: E402
from model.generate import generate  # noqa: E402
from model.kv_pool import KVPools  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402
from tests.worker_runtime.pd_in_process import pd_in_process  # noqa: E402
from worker_runtime.options import WorkerOptions  # noqa: E402
from worker_runtime.wire import GenerateRequest  # noqa: E402

MAX_TOKENS = 512


def reference(cfg, model, prompt, max_tokens, sampling):
    pools = KVPools(cfg, "fp32", max_tokens=MAX_TOKENS, max_seqs=1)
    return generate(model, pools, list(prompt), max_tokens, sampling, stop_ids=frozenset({cfg.eos_token_id})).token_ids


def test_http_router_prefill_decode_in_one_process(tiny_official_ckpt, registry_url):
    cfg, model = load_checkpoint(tiny_official_ckpt)
    rng = random.Random(11)
    shared = [rng.randrange(256) for _ in range(150)]  # a prefix the prefill worker caches
    prompts = [(shared if i % 2 else []) + [rng.randrange(256) for _ in range(rng.randrange(20, 160))]
               for i in range(6)]
    seeded = [SamplingParams(temperature=1.0, top_k=40, seed=100 + i) for i in range(3)]
    options = WorkerOptions(str(tiny_official_ckpt), registry_url, cluster="inproc", max_tokens=MAX_TOKENS,
                            max_seqs=16, prefill_token_budget=96, heartbeat_s=0.2)

    async def run():
        tokenizer = load_tokenizer(str(tiny_official_ckpt), cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
        async with pd_in_process(options, tokenizer) as pd:
            backend, prefill, decode = pd.backend, pd.prefill, pd.decode
            async with httpx.AsyncClient(base_url=pd.router.http_url, timeout=120) as client:
                async def complete(prompt):
                    r = await client.post("/v1/completions", json={
                        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                        "return_token_ids": True})
                    assert r.status_code == 200, r.text
                    return r.json()["choices"][0]["token_ids"]

                async def stream(i, prompt):
                    req = GenerateRequest(f"seeded-{i}", tuple(prompt), max_tokens=6, sampling=seeded[i])
                    tokens = []
                    async for chunk in backend.generate(req):
                        assert chunk.error is None, chunk.error
                        tokens.extend(chunk.token_ids)
                    return tokens

                served = await asyncio.gather(*(complete(p) for p in prompts),
                                              *(stream(i, p) for i, p in enumerate(prompts[:3])))
            await asyncio.sleep(0.5)  # acks and releases settle
            return (served, prefill.page_accounting(drop_cache=True), decode.page_accounting(),
                    prefill.engine.computed_tokens)

    served, p_acct, d_acct, computed = asyncio.run(run())
    for prompt, tokens in zip(prompts, served[:len(prompts)]):
        assert tokens == reference(cfg, model, prompt, 8, SamplingParams(temperature=0.0))
    for i, (prompt, tokens) in enumerate(zip(prompts[:3], served[len(prompts):])):
        assert tokens == reference(cfg, model, prompt, 6, seeded[i])
    assert d_acct["fallbacks"] == 0, d_acct  # every KV arrived from the prefill worker
    assert computed > 0 and d_acct["transfers"]["transfers"] == len(prompts) + 3, d_acct["transfers"]
    assert p_acct["free"] == p_acct["idle"], p_acct
    assert d_acct["free"] == d_acct["idle"], d_acct


def test_a_step_out_of_gpu_memory_fails_its_requests_by_name_and_the_next_ones_serve(
        tiny_official_ckpt, registry_url, monkeypatch):
    """A decode step that runs out of GPU memory (raised here: a CPU cannot run out of it for
    real) fails the requests it carried with an error naming the cause and the flags that size
    a worker's memory, not an opaque one; the worker goes on and serves the next request."""
    import torch

    cfg, model = load_checkpoint(tiny_official_ckpt)
    options = WorkerOptions(str(tiny_official_ckpt), registry_url, cluster="oom", max_tokens=MAX_TOKENS,
                            max_seqs=4, prefill_token_budget=96, heartbeat_s=0.2)
    prompt = list(range(3, 60))

    async def run():
        tokenizer = load_tokenizer(str(tiny_official_ckpt), cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
        async with pd_in_process(options, tokenizer) as pd:
            engine, real = pd.decode.engine, pd.decode.engine.step
            raised = []

            def step():
                if not raised:
                    raised.append(1)
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")
                return real()

            monkeypatch.setattr(engine, "step", step)

            async def one(name):
                errors, tokens = [], []
                async for chunk in pd.backend.generate(GenerateRequest(name, tuple(prompt), max_tokens=6)):
                    tokens += chunk.token_ids
                    if chunk.error is not None:
                        errors.append(chunk.error)
                return errors, tokens

            return await one("first"), await one("second")

    (errors, _), (after, tokens) = asyncio.run(run())
    assert len(errors) == 1 and errors[0].code.http_status == 500
    assert "ran out of GPU memory" in errors[0].message and "--max-seqs" in errors[0].message
    assert after == [] and tokens == reference(cfg, model, prompt, 6, SamplingParams())


def test_a_prefill_step_that_raises_fails_over_to_the_decode_worker(tiny_official_ckpt, registry_url, monkeypatch):
    """A prefill step that raises (out of GPU memory, raised here) may leave its chunks' KV
    unwritten, so the prompts it touched must not go on there: they fail over to their decode
    worker at once, which recomputes them, and the tokens are still `generate`'s. (The worker used
    to go on planning the prompt's next chunks on the progress the failed step had counted, three
    more steps whose KV the decode side then dropped.)"""
    import torch

    cfg, model = load_checkpoint(tiny_official_ckpt)
    options = WorkerOptions(str(tiny_official_ckpt), registry_url, cluster="pfail", max_tokens=MAX_TOKENS,
                            max_seqs=4, prefill_token_budget=32, heartbeat_s=0.2)
    prompt = [(7 * i) % 250 + 3 for i in range(150)]  # five chunks of 32: the second raises

    async def run():
        tokenizer = load_tokenizer(str(tiny_official_ckpt), cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
        async with pd_in_process(options, tokenizer) as pd:
            engine, real, calls = pd.prefill.engine, pd.prefill.engine.run, []

            def run_step(*args):
                calls.append(1)
                if len(calls) == 2:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")
                return real(*args)

            monkeypatch.setattr(engine, "run", run_step)
            tokens, errors = [], []
            async for chunk in pd.backend.generate(GenerateRequest("r", tuple(prompt), max_tokens=8)):
                tokens += chunk.token_ids
                errors += [chunk.error] if chunk.error is not None else []
            return tokens, errors, len(calls), pd.decode.inbound.counts["fallbacks"]

    tokens, errors, calls, fallbacks = asyncio.run(run())
    assert calls == 2 and errors == []  # no chunk after the failed one ran on the prefill worker
    assert fallbacks == 1  # recomputed on the decode worker
    assert tokens == reference(cfg, model, prompt, 8, SamplingParams())
