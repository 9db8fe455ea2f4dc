"""A prefill worker kept busy far longer than the decode reservation's lease, in one process (the
router's HTTP API → placement → prefill worker → KV over the in-process transport → decode worker,
worker_runtime/in_process.py): the decode worker reserves only when the prefill worker is about
to start a request, so however long a request waits in that queue, its KV still arrives over the
transfer, its last chunk written layer by layer as the forward computes it. Zero decode-side prefills (the router's `decode_prefills` metric says so), every
request's tokens equal `generate`'s, pages idle at the end."""

import asyncio
import math
import random
import time

import pytest

httpx = pytest.importorskip("httpx")

from model.checkpoint import load_checkpoint  # noqa: E402
from model.generate import generate  # noqa: E402
from model.kv_pool import KVPools  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402
from prefill_worker.engine import PrefillConfig, PrefillEngine  # noqa: E402
from router.metrics import RouterMetrics  # noqa: E402
from tests.worker_runtime.pd_in_process import pd_in_process  # noqa: E402
from worker_runtime.options import WorkerOptions  # noqa: E402
from worker_runtime.wire import GenerateRequest  # noqa: E402

MAX_TOKENS = 512
LEASE_S = 3.0
BUDGET = 64  # prefill tokens per step
PROMPT = 64  # tokens per prompt: one step each


def reference(cfg, model, prompt, max_tokens):
    pools = KVPools(cfg, "fp32", max_tokens=MAX_TOKENS, max_seqs=1)
    return generate(model, pools, list(prompt), max_tokens, SamplingParams(temperature=0.0),
                    stop_ids=frozenset({cfg.eos_token_id})).token_ids


def step_seconds(cfg, model) -> float:
    """The fastest of a few prefill steps of BUDGET tokens on this machine (the queue's length
    scales with it, so that a fast machine still holds the queue for more than two leases)."""
    engine = PrefillEngine(model, KVPools(cfg, "fp32", max_tokens=MAX_TOKENS, max_seqs=1), "probe",
                           PrefillConfig(token_budget=BUDGET, max_running=1))
    times = []
    for i in range(4):
        engine.submit(GenerateRequest(f"probe-{i}", tuple(range(2, 2 + BUDGET)), 1))
        t = time.perf_counter()
        engine.release(engine.step()[0])
        times.append(time.perf_counter() - t)
    return min(times[1:])


def decode_prefills(text: str) -> dict[str, float]:
    """reason → count of `v4serve_decode_prefills_total` in a /metrics page."""
    out = {}
    for line in text.splitlines():
        if line.startswith("v4serve_decode_prefills_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('reason="', 1)[1].split('"', 1)[0]] = float(value)
    return out


# layers written as the last chunk computes them (the default), one write per two layers, or whole
# pages after the step
@pytest.mark.parametrize("layer_stream", [1, pytest.param(2, marks=pytest.mark.exhaustive),
                                          pytest.param(0, marks=pytest.mark.exhaustive)])
def test_a_prefill_queue_longer_than_the_lease_loses_no_request_to_the_decode_side(tiny_official_ckpt,
                                                                                    registry_url, layer_stream):
    cfg, model = load_checkpoint(tiny_official_ckpt)
    # a prompt's own step and the two it may wait once its target is asked for take ~0.5 s of the
    # 3 s lease here (room for a loaded machine); the queue holds prefill work for 2.2 leases
    n = min(max(math.ceil(2.2 * LEASE_S / step_seconds(cfg, model)), 20), 60)
    rng = random.Random(50)
    prompts = [[rng.randrange(256) for _ in range(PROMPT)] for _ in range(n)]
    options = WorkerOptions(str(tiny_official_ckpt), registry_url, cluster="busy", max_tokens=MAX_TOKENS,
                            max_seqs=16, prefill_token_budget=BUDGET, heartbeat_s=0.2, lease_s=LEASE_S,
                            prefix_cache=False, prefill_layer_stream=layer_stream)

    async def run():
        tokenizer = load_tokenizer(str(tiny_official_ckpt), cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
        async with pd_in_process(options, tokenizer, RouterMetrics()) as pd:
            prefill, decode = pd.prefill, pd.decode
            async with httpx.AsyncClient(base_url=pd.router.http_url, timeout=300) as client:
                async def complete(prompt):
                    r = await client.post("/v1/completions", json={
                        "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                        "return_token_ids": True})
                    assert r.status_code == 200, r.text
                    return r.json()["choices"][0]["token_ids"], time.perf_counter()

                start = time.perf_counter()
                served = await asyncio.gather(*(complete(p) for p in prompts))
                page = (await client.get("/metrics")).text
            await asyncio.sleep(0.5)  # acks and releases settle
            return (served, start, page, prefill.page_accounting(drop_cache=True), decode.page_accounting())

    served, start, page, p_acct, d_acct = asyncio.run(run())
    # the last requests waited in the prefill worker's queue longer than two leases
    assert max(t for _, t in served) - start > 2 * LEASE_S
    for prompt, (tokens, _) in zip(prompts, served):
        assert tokens == reference(cfg, model, prompt, 4)
    assert decode_prefills(page) == {}, page  # no request was prefilled on the decode worker
    assert d_acct["fallbacks"] == 0 and d_acct["transfers"]["transfers"] == len(prompts), d_acct
    assert p_acct["layer_streamed"] == (len(prompts) if layer_stream else 0), p_acct
    assert p_acct["free"] == p_acct["idle"], p_acct
    assert d_acct["free"] == d_acct["idle"], d_acct
