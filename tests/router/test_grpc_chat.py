"""Chat over gRPC (rpc Chat) against the router's stub backend writing scripted completions: the
same prompt, text, reasoning, tool calls and refusals as the same chat over HTTP
(tests/router/test_grpc_chat_in_process.py: the tiny model)."""

import json

import grpc
import httpx
import pytest

from router.chat_encoding import render_tool_calls
from router.proto import v4serve_pb2 as pb, v4serve_pb2_grpc as pb_grpc

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
HTTP_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": PARAMS}}]
TOOLS = [pb.Tool(name="get_weather", description="Weather in a city", parameters=json.dumps(PARAMS))]
CALLS = [("get_weather", {"city": "Paris", "days": 3}, ""), ("get_weather", {"city": "Oslo \"N\""}, "")]
USER = pb.ChatMessage(role="user", content="Weather in Paris and Oslo?")
HTTP_USER = {"role": "user", "content": "Weather in Paris and Oslo?"}


@pytest.fixture(scope="module")
def stub(router):
    ch = grpc.insecure_channel(router.grpc_target)
    yield pb_grpc.InferenceStub(ch)
    ch.close()


def http_chat(router, body: dict) -> httpx.Response:
    return httpx.post(router.http_url + "/v1/chat/completions", json={"model": "stub", **body}, timeout=10)


def chat(stub, **fields) -> list[pb.ChatResponse]:
    return list(stub.Chat(pb.ChatRequest(**fields), timeout=10))


def assembled(out: list[pb.ChatResponse]) -> dict:
    """Each choice's content, reasoning, tool calls (id, name, arguments) and last message."""
    choices = {}
    for m in out:
        c = choices.setdefault(m.index, {"content": "", "reasoning": "", "calls": {}, "msgs": []})
        c["content"] += m.content
        c["reasoning"] += m.reasoning_content
        c["msgs"].append(m)
        for d in m.tool_calls:
            call = c["calls"].setdefault(d.index, {"id": d.id, "name": d.name, "arguments": ""})
            assert not d.id or d.id == call["id"]
            call["arguments"] += d.arguments
    return choices


def test_chat_gives_the_http_chat_text_prompt_and_usage(router, stub):
    msgs = [pb.ChatMessage(role="system", content="Be brief."), pb.ChatMessage(role="user", content="Hi there")]
    out = chat(stub, messages=msgs, max_tokens=12, temperature=0.0, seed=4)
    r = http_chat(router, {"messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hi there"}], "max_tokens": 12,
                           "temperature": 0.0, "seed": 4}).json()
    got = assembled(out)[0]
    assert got["content"] == r["choices"][0]["message"]["content"] and got["content"]
    last = out[-1]
    assert last.finish_reason == r["choices"][0]["finish_reason"] and all(not m.finish_reason for m in out[:-1])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (r["usage"]["prompt_tokens"],
                                                                        r["usage"]["completion_tokens"])
    assert sum(len(m.token_ids) for m in out) == last.usage.completion_tokens
    assert len({m.request_id for m in out}) == 1 and out[0].request_id.startswith("chatcmpl-")


def test_thinking_splits_reasoning_content(router, stub):
    router.set_stub(script=tuple(router.tokenizer.encode("Let me see.</think>It is sunny.")))
    out = assembled(chat(stub, messages=[USER], max_tokens=100, thinking=True))[0]
    assert (out["reasoning"], out["content"]) == ("Let me see.", "It is sunny.")
    r = http_chat(router, {"messages": [HTTP_USER], "max_tokens": 100, "reasoning_effort": "max"}).json()
    effort = chat(stub, messages=[USER], max_tokens=100, reasoning_effort="max")
    assert effort[-1].usage.prompt_tokens == r["usage"]["prompt_tokens"]
    assert assembled(effort)[0]["reasoning"] == r["choices"][0]["message"]["reasoning_content"] == "Let me see."
    plain = assembled(chat(stub, messages=[USER], max_tokens=100))[0]  # thinking off: no split
    assert plain["content"] == "Let me see.</think>It is sunny." and not plain["reasoning"]


def test_tool_calls_stream_as_deltas_and_finish_with_tool_calls(router, stub):
    script = "Checking." + render_tool_calls(CALLS)
    router.set_stub(script=tuple(router.tokenizer.encode(script)))
    out = chat(stub, messages=[USER], tools=TOOLS, max_tokens=400)
    got = assembled(out)[0]
    assert got["content"] == "Checking." and out[-1].finish_reason == "tool_calls"
    calls = [got["calls"][i] for i in sorted(got["calls"])]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [(n, a) for n, a, _ in CALLS]
    assert all(c["id"] for c in calls) and len({c["id"] for c in calls}) == 2
    assert sum(len(m.tool_calls) for m in out) > 4  # the arguments arrived in pieces
    r = http_chat(router, {"messages": [HTTP_USER], "tools": HTTP_TOOLS, "max_tokens": 400}).json()
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in r["choices"][0]["message"]["tool_calls"]] \
        == [(c["name"], c["arguments"]) for c in calls]
    assert out[-1].usage.prompt_tokens == r["usage"]["prompt_tokens"]  # the tools rendered alike
    none = assembled(chat(stub, messages=[USER], tools=TOOLS, tool_choice=pb.ToolChoice(mode="none"),
                          max_tokens=400))[0]
    assert not none["calls"] and none["content"] == script


def test_tool_results_conversation_encodes_as_over_http(router, stub):
    router.set_stub(script=tuple(router.tokenizer.encode("Sunny.")))
    msgs = [USER, pb.ChatMessage(role="assistant", reasoning_content="Ask the tool.", tool_calls=[
        pb.ToolCall(id="t1", name="get_weather", arguments='{"city": "Paris"}')]),
        pb.ChatMessage(role="tool", tool_call_id="t1", content="sunny")]
    http_msgs = [HTTP_USER, {"role": "assistant", "reasoning_content": "Ask the tool.", "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"}]
    for kw, body in (({}, {}), ({"thinking": True, "drop_thinking": False},
                                {"chat_template_kwargs": {"thinking": True, "drop_thinking": False}})):
        out = chat(stub, messages=msgs, tools=TOOLS, max_tokens=50, **kw)
        r = http_chat(router, {"messages": http_msgs, "tools": HTTP_TOOLS, "max_tokens": 50, **body}).json()
        assert out[-1].usage.prompt_tokens == r["usage"]["prompt_tokens"]
    assert out[-1].usage.prompt_tokens > chat(stub, messages=msgs, tools=TOOLS, max_tokens=50)[-1].usage.prompt_tokens


def test_n_choices_and_logprobs(router, stub):
    out = chat(stub, messages=[USER], max_tokens=6, temperature=1.0, seed=7, n=2, logprobs=2)
    choices = assembled(out)
    assert sorted(choices) == [0, 1]
    for c in choices.values():
        last = c["msgs"][-1]
        assert last.finish_reason and last.usage.completion_tokens == 6
        assert all(not m.finish_reason for m in c["msgs"][:-1])
        ids = [t for m in c["msgs"] for t in m.token_ids]
        lps = [lp for m in c["msgs"] for lp in m.logprobs]
        assert [lp.token_id for lp in lps] == ids and all(len(lp.top) == 2 for lp in lps)


REFUSED = [  # (gRPC request fields, the equivalent HTTP body)
    ({"tool_choice": pb.ToolChoice(mode="required")}, {"tool_choice": "required"}),
    ({"tools": [pb.Tool(name="f", parameters='{"type": "array"}')], "tool_choice":
      pb.ToolChoice(function="f")}, {"tools": [{"type": "function", "function": {
          "name": "f", "parameters": {"type": "array"}}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ({"tools": TOOLS, "tool_choice": pb.ToolChoice(function="other")},
     {"tools": HTTP_TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}),
    ({"messages": [pb.ChatMessage(role="robot", content="x")]}, {"messages": [{"role": "robot", "content": "x"}]}),
    ({"messages": [pb.ChatMessage(role="user", content="x", tool_call_id="t")]},
     {"messages": [{"role": "user", "content": "x", "tool_call_id": "t"}]}),
    ({"messages": [pb.ChatMessage(role="user")]}, {"messages": [{"role": "user"}]}),
    ({"reasoning_effort": "low"}, {"reasoning_effort": "low"}),
    ({"thinking": False, "reasoning_effort": "max"},
     {"chat_template_kwargs": {"thinking": False}, "reasoning_effort": "max"}),
    ({"temperature": 3.0}, {"temperature": 3.0}),
]


@pytest.mark.parametrize("fields,body", REFUSED, ids=[
    "tool_choice without tools", "bad schema", "unknown function", "unknown role", "field the role lacks",
    "no content", "unknown effort", "effort without thinking", "temperature"])
def test_refusals_match_http(router, stub, fields, body):
    fields = {"messages": [USER], "max_tokens": 5, **fields}
    with pytest.raises(grpc.RpcError) as e:
        chat(stub, **fields)
    r = http_chat(router, {"messages": [HTTP_USER], "max_tokens": 5, **body})
    assert r.status_code == 400 and e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == r.json()["error"]["message"]


def test_grpc_only_refusals(stub):
    for fields, words in (({"messages": []}, "messages"),
                          ({"messages": [USER], "tools": [pb.Tool(name="f", parameters="{not json")]},
                           "'tools[0].function.parameters' is not JSON")):
        with pytest.raises(grpc.RpcError) as e:
            chat(stub, max_tokens=5, **fields)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output(router, stub, include):
    router.set_stub(script=tuple(router.tokenizer.encode("one. two. three")))
    out = chat(stub, messages=[USER], max_tokens=40, stop=[". t"], include_stop_str_in_output=include)
    assert out[-1].finish_reason == "stop" and assembled(out)[0]["content"] == ("one. t" if include else "one")
