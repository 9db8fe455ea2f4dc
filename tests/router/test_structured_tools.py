"""The grammars of `tool_choice` required / named, of strict tools and of `response_format` in thinking
mode (router/response_format.py), on the tiny model's byte tokenizer without a model: every output they allow is a DSML tool-call
block that `router/tool_calls.py` parses (fed token by token, as streamed) into calls of the
right functions whose arguments validate against their schemas; what they forbid is refused.
Random walks stand in for a model: each step takes a random token among those the mask allows."""

import json
import random

import jsonschema
import pytest

from model.detokenizer import Detokenizer
from model.grammar import Grammars
from model.tokenizer import ByteTokenizer
from router.chat_encoding import render_tool_calls
from router.errors import APIError
from router.request_models import ChatCompletionRequest, NamedToolChoice, Tool
from router.response_format import response_grammar, tool_grammar
from router.tool_calls import ToolCallParser

VOCAB, EOS, THINK_END = 320, 257, 261
TOK = ByteTokenizer(VOCAB)
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                            "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city", "days"]}
LOOKUP = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 3}, "n": {"type": "boolean"}},
          "required": ["q"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "lookup": LOOKUP, "ping": {"type": "object", "properties": {}}}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": s}})
         for n, s in SCHEMAS.items()]


@pytest.fixture(scope="module")
def grammars():
    return Grammars(TOK, VOCAB, EOS)


def walk(grammars: Grammars, grammar: str, seed: int, limit: int = 2000) -> list[int]:
    """A random output the grammar allows, to its end."""
    rng, state, out = random.Random(seed), grammars.state(grammar), []
    while not state.done:
        bits = grammars.bitmask([state])[0]
        allowed = [t for t in range(VOCAB) if (int(bits[t // 32]) >> (t % 32)) & 1]
        out.append(rng.choice(allowed))
        state.advance(out[-1])
        assert len(out) < limit
    return out


def parsed(tokens: list[int]) -> tuple[str, list[dict]]:
    """(content, calls) as the router streams them: the text fed token by token."""
    p, detok, content = ToolCallParser(), Detokenizer(TOK, ()), ""
    for t in tokens:
        content += p.feed(detok.push(t))[0]
    content += p.feed(detok.flush())[0] + p.flush()[0]
    for call in p.calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    return content, p.calls


def test_named_function_is_called_once_with_valid_arguments(grammars):
    g = tool_grammar(TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "lookup"}}), None)
    for seed in range(4):
        content, calls = parsed(walk(grammars, g, seed))
        assert content == "" and [c["name"] for c in calls] == ["lookup"]


def test_required_calls_offered_functions(grammars):
    g = tool_grammar(TOOLS, "required", None)
    names = set()
    for seed in range(6):
        content, calls = parsed(walk(grammars, g, seed))
        assert content == "" and calls
        names |= {c["name"] for c in calls}
    assert len(names) > 1
    single = tool_grammar(TOOLS, "required", False)  # parallel_tool_calls false: exactly one
    assert all(len(parsed(walk(grammars, single, seed))[1]) == 1 for seed in range(3))


def test_auto_with_a_strict_tool_holds_its_calls_and_keeps_content_free(grammars):
    strict = [Tool.model_validate({"type": "function", "function": {"name": "lookup", "parameters": LOOKUP,
                                                                     "strict": True}})]
    g = tool_grammar(strict, "auto", None)
    text = "Sure." + render_tool_calls([("lookup", {"q": "ab"}, "")])
    assert grammars.state(g, TOK.encode(text)).done
    content, calls = parsed(TOK.encode(text))
    assert content == "Sure." and [(c["name"], c["arguments"]) for c in calls] == [("lookup", '{"q": "ab"}')]
    grammars.state(g, TOK.encode("Plain text, no call."))  # free text is allowed
    for bad in ("Sure." + render_tool_calls([("lookup", {"q": "toolong"}, "")]),  # held to its schema
                "Sure. <｜DSML｜invoke name=\"lookup\">"):  # no markup outside the block
        with pytest.raises(ValueError, match="not allowed"):
            grammars.state(g, TOK.encode(bad))
    assert tool_grammar(TOOLS, "auto", None) is None  # nothing strict: free output


@pytest.mark.parametrize("text", [
    render_tool_calls([("get_weather", {"city": "Paris", "days": 3}, "")]),  # not the named function
    render_tool_calls([("lookup", {"q": "toolong"}, "")]),  # maxLength 3
    render_tool_calls([("lookup", {"n": True}, "")]),  # 'q' is required
    render_tool_calls([("lookup", {"q": "ab", "x": 1}, "")]),  # no other properties
    "Sure." + render_tool_calls([("lookup", {"q": "ab"}, "")]),  # content before a forced call
])
def test_named_grammar_refuses_what_breaks_the_call(grammars, text):
    g = tool_grammar(TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "lookup"}}), None)
    ids = TOK.encode(text.removeprefix("\n\n"))
    with pytest.raises(ValueError, match="not allowed"):
        grammars.state(g, ids)
    good = TOK.encode(render_tool_calls([("lookup", {"q": "ab", "n": False}, "")]).removeprefix("\n\n"))
    assert grammars.state(g, good).done


def test_thinking_reasons_first_then_calls(grammars):
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "ping"}})
    g = tool_grammar(TOOLS, named, None, thinking=True, think_end_id=THINK_END)
    call = TOK.encode(render_tool_calls([("ping", {}, "")]).removeprefix("\n\n"))
    assert grammars.state(g, TOK.encode("let me see") + [THINK_END] + call).done
    with pytest.raises(APIError, match="thinking"):
        tool_grammar(TOOLS, named, None, thinking=True, think_end_id=None)


def test_a_schema_that_cannot_be_enforced_is_refused():
    bad = [Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}}})]
    with pytest.raises(APIError) as e:
        tool_grammar(bad, "required", None)
    assert e.value.param == "tools"


def test_response_format_in_thinking_mode_starts_after_the_reasoning(grammars):
    fmt = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "properties": {
            "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}}).response_format
    g = response_grammar(fmt, thinking=True, think_end_id=THINK_END)
    assert grammars.state(g, TOK.encode("hmm, {not json") + [THINK_END] + TOK.encode('{"a":7}')).done
    with pytest.raises(ValueError, match="not allowed"):
        grammars.state(g, TOK.encode("hmm") + [THINK_END] + TOK.encode("text"))
    assert grammars.state(response_grammar(fmt), TOK.encode('{"a":7}')).done
