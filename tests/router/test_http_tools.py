"""Tool calling, thinking through chat_template_kwargs, include_stop_str_in_output, /tokenize,
/detokenize and /openapi.json over HTTP, with the real OpenAI SDK against a stub that writes a
scripted completion (the text a model would write, token by token)."""

import json

import httpx
import openai
import pytest
from dsv4_reference import reference_encode

from router.chat_encoding import render_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALLS = [("get_weather", {"city": "Paris", "days": 3}, ""), ("get_weather", {"city": "Oslo \"N\""}, "")]
SCRIPT = "Checking." + render_tool_calls(CALLS)
MSGS = [{"role": "user", "content": "Weather in Paris and Oslo?"}]


@pytest.fixture
def client(router):
    return openai.OpenAI(base_url=router.http_url + "/v1", api_key="x", max_retries=0)


def _script(router, text):
    router.set_stub(script=tuple(router.tokenizer.encode(text)))


def _want_calls():
    return [("get_weather", json.dumps(a, ensure_ascii=False)) for _, a, _ in CALLS]


def test_tool_calls_non_streamed(router, client):
    _script(router, SCRIPT)
    r = client.chat.completions.create(model="stub", messages=MSGS, tools=TOOLS, max_tokens=400)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == _want_calls()
    assert len({c.id for c in choice.message.tool_calls}) == 2 and all(c.type == "function"
                                                                       for c in choice.message.tool_calls)
    # the prompt offered the tools as the official encoding renders them
    assert r.usage.prompt_tokens == len(router.tokenizer.encode(reference_encode(MSGS, TOOLS)))


def test_tool_calls_streamed_are_assembled_by_the_sdk(router, client):
    _script(router, SCRIPT)
    with client.chat.completions.stream(model="stub", messages=MSGS, tools=TOOLS, max_tokens=400) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == _want_calls()
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(deltas) > 4  # the arguments arrived in pieces as they were generated


def test_tool_choice_none_hides_the_tools_and_parses_nothing(router, client):
    _script(router, SCRIPT)
    r = client.chat.completions.create(model="stub", messages=MSGS, tools=TOOLS, tool_choice="none", max_tokens=400)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == SCRIPT
    assert r.usage.prompt_tokens == len(router.tokenizer.encode(reference_encode(MSGS)))


def test_tool_results_conversation_and_thinking(router, client):
    """A second turn: the assistant's calls and the tool results go back in; thinking on through
    chat_template_kwargs; the completion's reasoning, content and calls are separated."""
    _script(router, "I know now.</think>Done." + render_tool_calls(CALLS[:1]))
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"}]
    r = client.chat.completions.create(model="stub", messages=msgs, tools=TOOLS, max_tokens=400,
                                       extra_body={"chat_template_kwargs": {"thinking": True}})
    m = r.choices[0].message
    assert m.reasoning_content == "I know now." and m.content == "Done."
    assert [(c.function.name, c.function.arguments) for c in m.tool_calls] == _want_calls()[:1]
    want = reference_encode(msgs, TOOLS, thinking=True)
    assert want.endswith("<tool_result>sunny</tool_result><｜Assistant｜><think>")
    assert r.usage.prompt_tokens == len(router.tokenizer.encode(want))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output(router, client, stream, include):
    _script(router, "abc STOP def")
    kw = {"model": "stub", "prompt": "x", "max_tokens": 50, "stop": ["STOP", "ST"], "stream": stream,
              "extra_body": {"include_stop_str_in_output": include}}
    r = client.completions.create(**kw)
    text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
    assert text == ("abc ST" if include else "abc ")  # "ST" completes first


def test_tokenize_detokenize_openapi(router):
    url = router.http_url
    r = httpx.post(url + "/tokenize", json={"prompt": "héllo", "return_token_strs": True}).json()
    assert r["tokens"] == router.tokenizer.encode("héllo") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 2048 and "".join(r["token_strs"]).startswith("h")
    bos = httpx.post(url + "/tokenize", json={"prompt": "a", "add_special_tokens": True}).json()["tokens"]
    assert bos == [router.tokenizer.bos_id, ord("a")]
    chat = httpx.post(url + "/tokenize", json={"messages": MSGS, "tools": TOOLS,
                                               "chat_template_kwargs": {"thinking": True}}).json()
    assert chat["tokens"] == router.tokenizer.encode(reference_encode(MSGS, TOOLS, thinking=True))
    back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "héllo"}
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    wrong = httpx.post(url + "/tokenize", json={"prompt": "a", "model": "other"})
    assert wrong.status_code == 404
    doc = httpx.get(url + "/openapi.json").json()
    schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert schema["additionalProperties"] is False and "tools" in schema["properties"]
    assert "/v1/completions" in doc["paths"] and "/tokenize" in doc["paths"]
