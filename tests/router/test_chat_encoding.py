"""DeepSeek-V4 chat encoding (table of message lists → exact prompt text) and the reasoning split."""

import json

import pytest
from dsv4_reference import reference_encode

from model.tokenizer import ByteTokenizer
from router.chat_encoding import (
    REASONING_EFFORT_MAX,
    ChatFormatError,
    ReasoningSplitter,
    encode_messages,
    parse_messages,
)

B, E, U, A, TS, TE = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                      "<think>", "</think>")

CASES = [
    ("chat single turn", [{"role": "user", "content": "1+1=?"}], "chat", None, f"{B}{U}1+1=?{A}{TE}"),
    ("thinking single turn", [{"role": "user", "content": "1+1=?"}], "thinking", None, f"{B}{U}1+1=?{A}{TS}"),
    ("thinking high = default", [{"role": "user", "content": "q"}], "thinking", "high", f"{B}{U}q{A}{TS}"),
    ("thinking max", [{"role": "user", "content": "q"}], "thinking", "max",
     f"{B}{REASONING_EFFORT_MAX}{U}q{A}{TS}"),
    ("max ignored in chat", [{"role": "user", "content": "q"}], "chat", "max", f"{B}{U}q{A}{TE}"),
    ("system first", [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}], "chat", None,
     f"{B}S{U}q{A}{TE}"),
    ("system + max", [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}], "thinking", "max",
     f"{B}{REASONING_EFFORT_MAX}S{U}q{A}{TS}"),
    ("multi-turn chat", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "c"}], "chat", None, f"{B}{U}a{A}{TE}b{E}{U}c{A}{TE}"),
    ("multi-turn thinking drops old reasoning",
     [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
      {"role": "user", "content": "c"}], "thinking", None, f"{B}{U}a{A}{TE}b{E}{U}c{A}{TS}"),
    ("assistant after last user keeps reasoning",
     [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"}],
     "thinking", None, f"{B}{U}a{A}{TS}r{TE}b{E}"),
    ("developer dropped before last user in thinking",
     [{"role": "developer", "content": "d"}, {"role": "user", "content": "q"}], "thinking", None, f"{B}{U}q{A}{TS}"),
    ("developer kept in chat", [{"role": "developer", "content": "d"}, {"role": "user", "content": "q"}], "chat",
     None, f"{B}{U}d{U}q{A}{TE}"),
    ("text parts", [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}],
     "chat", None, f"{B}{U}x\ny{A}{TE}"),
    ("consecutive users are one turn", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "chat", None, f"{B}{U}a\n\nb{A}{TE}"),
]


@pytest.mark.parametrize("name,messages,mode,effort,want", CASES, ids=[c[0] for c in CASES])
def test_encoding(name, messages, mode, effort, want):
    assert encode_messages(parse_messages(messages), mode, effort) == want


def test_special_tokens_are_single_ids():
    tok = ByteTokenizer(512)
    ids = tok.encode(encode_messages(parse_messages([{"role": "user", "content": "hi"}]), "thinking"))
    assert ids == [tok.bos_id, tok.special[U], ord("h"), ord("i"), tok.special[A], tok.special[TS]]


@pytest.mark.parametrize("messages,param", [
    ([], "messages"), ("x", "messages"), ([1], "messages[0]"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "assistant", "content": None}, {"role": "x", "content": "y"}], "messages[1].role"),
    ([{"role": "user", "content": "a", "tool_calls": [{}]}], "messages[0].tool_calls"),
    ([{"role": "developer", "content": ""}], "messages[0].content"),
    ([{"role": "assistant", "content": "a", "reasoning_content": 3}], "messages[0].reasoning_content"),
])
def test_invalid_messages(messages, param):
    with pytest.raises(ChatFormatError) as e:
        parse_messages(messages)
    assert e.value.param == param


def test_bad_modes():
    msgs = parse_messages([{"role": "user", "content": "q"}])
    with pytest.raises(ChatFormatError):
        encode_messages(msgs, "deep")
    with pytest.raises(ChatFormatError):
        encode_messages(msgs, "thinking", "low")


@pytest.mark.parametrize("deltas,reasoning,content", [
    (["abc", "</think>", "xyz"], "abc", "xyz"),
    (["ab</th", "ink>x"], "ab", "x"),
    (["a<", "/", "t", "hink>", "b", "</think>"], "a", "b</think>"),
    (["<thin", "k>x"], "<think>x", ""),  # not the end marker: released as reasoning
    (["no end at all", " <"], "no end at all <", ""),
])
def test_reasoning_splitter(deltas, reasoning, content):
    s, r, c = ReasoningSplitter(), [], []
    for d in deltas:
        x, y = s.feed(d)
        r.append(x)
        c.append(y)
    x, y = s.flush()
    assert "".join(r) + x == reasoning and "".join(c) + y == content


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def _random_conversation(rng, j0=0):
    raw = []
    pending = []  # ids of calls not answered yet
    for j in range(rng.randrange(1, 10)):
        role = rng.choice(["system", "developer", "user", "assistant", "assistant", "tool"])
        if role == "tool":
            cid = pending.pop(rng.randrange(len(pending))) if pending else f"c{j}"
            raw.append({"role": "tool", "tool_call_id": cid, "content": f"result {j} ✓"})
            continue
        m = {"role": role, "content": f"{role[0]}{j} \"q\"\n"}
        if role == "assistant":
            if rng.random() < 0.5:
                m["reasoning_content"] = f"r{j}"
            if rng.random() < 0.5:
                calls = []
                for k in range(rng.randrange(1, 4)):
                    args = rng.choice([{"city": "Paris"}, {"a": 1, "b": [2.5, None], "c": {"d": True}}, {},
                                       {"text": "line\n\"quoted\" ü"}])
                    calls.append({"id": f"c{j}_{k}", "type": "function",
                                  "function": {"name": rng.choice(["get_weather", "add"]), "arguments": json.dumps(args)}})
                    pending.append(f"c{j}_{k}")
                m["tool_calls"] = calls
                if rng.random() < 0.5:
                    m["content"] = None
        raw.append(m)
    return raw


def test_encoding_matches_the_official_rule_on_random_conversations():
    """Tools, tool calls, tool results (out of call order too), reasoning, developer and system
    messages, in both modes, both efforts and both drop settings: exactly the official string."""
    import random
    rng = random.Random(5)
    for _ in range(300):
        raw = _random_conversation(rng)
        tools = TOOLS if rng.random() < 0.5 else None
        msgs = parse_messages(raw, [t["function"] for t in tools] if tools else None)
        for mode in ("chat", "thinking"):
            for effort in (None, "max"):
                for drop in (True, False):
                    want = reference_encode(raw, tools, mode == "thinking", effort, drop)
                    assert encode_messages(msgs, mode, effort, drop) == want, raw


def test_tool_conversation_exact_text():
    """One agent turn written out by hand: tools offered, a call, two results answered out of
    order (put back in call order), the final question."""
    raw = [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
               {"id": "2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
           {"role": "tool", "tool_call_id": "2", "content": "3"},
           {"role": "tool", "tool_call_id": "1", "content": "cold"}]
    tools = [t["function"] for t in TOOLS]
    text = encode_messages(parse_messages(raw, tools), "chat")
    d = "｜DSML｜"
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    assert text.startswith(f"{B}\n\n## Tools\n\nYou have access to a set of tools")
    assert f"### Available Tool Schemas\n\n{schemas}\n\nYou MUST strictly follow" in text
    assert text.endswith(
        f"invoke tool calls.\nS{U}Weather?{A}{TE}\n\n<{d}tool_calls>\n"
        f'<{d}invoke name="get_weather">\n<{d}parameter name="city" string="true">Oslo</{d}parameter>\n</{d}invoke>\n'
        f'<{d}invoke name="add">\n<{d}parameter name="a" string="false">1</{d}parameter>\n</{d}invoke>\n'
        f"</{d}tool_calls>{E}{U}<tool_result>cold</tool_result>\n\n<tool_result>3</tool_result>{A}{TE}")
    assert text == reference_encode(raw, TOOLS)


def test_encoding_time_is_linear_in_the_message_count():
    """System messages and no user turn: the case where looking up the last user turn per message
    costs a full scan each time."""
    import time

    def cost(n):
        msgs = parse_messages([{"role": "system", "content": "s"}] * n)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            encode_messages(msgs, "thinking")
            best = min(best, time.perf_counter() - t0)
        return best

    small, large = cost(2000), cost(8000)
    assert large < 8 * small + 0.01, (small, large)  # 4x the messages: far from 16x the time
    assert cost(16000) < 0.5
