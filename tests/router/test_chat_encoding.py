"""DeepSeek-V4 chat encoding (table of message lists → exact prompt text) and the reasoning split."""

import pytest

from model.tokenizer import ByteTokenizer
from router.chat_encoding import (REASONING_EFFORT_MAX, ChatFormatError, ReasoningSplitter, encode_messages,
                                  parse_messages)

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
    ("consecutive users", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "chat", None,
     f"{B}{U}a{U}b{A}{TE}"),
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
    ([{"role": "user", "content": "a", "tool_calls": [{}]}], "messages[0]"),
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
