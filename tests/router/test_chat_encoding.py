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


def _reference_encoding(msgs, mode, effort, drop=True):
    """The encoding rule written out directly, message by message (the last user turn looked up
    each time, as the official encoder does): the reference for random message lists."""
    from router.chat_encoding import BOS, EOS, Message
    thinking = mode == "thinking"

    def last_user(ms):
        return max((i for i, m in enumerate(ms) if m.role in ("user", "developer")), default=-1)

    if thinking and drop:
        last = last_user(msgs)
        msgs = [m if m.role in ("user", "system") or i >= last else Message("assistant", m.content)
                for i, m in enumerate(msgs) if m.role != "developer" or i >= last]
    out = BOS
    for i, m in enumerate(msgs):
        lu = last_user(msgs)
        out += REASONING_EFFORT_MAX if (i == 0 and thinking and effort == "max") else ""
        if m.role == "system":
            out += m.content
        elif m.role in ("user", "developer"):
            out += U + m.content
        else:
            out += (m.reasoning_content + TE if thinking and (not drop or i > lu) else "") + m.content + E
        if m.role in ("user", "developer") and (i + 1 == len(msgs) or msgs[i + 1].role == "assistant"):
            out += A + (TS if thinking and (not drop or i >= lu) else TE)
    return out


def test_encoding_matches_the_reference_on_random_conversations():
    import random
    rng = random.Random(5)
    for _ in range(400):
        raw = []
        for j in range(rng.randrange(1, 9)):
            role = rng.choice(["system", "developer", "user", "assistant"])
            m = {"role": role, "content": f"{role[0]}{j}"}
            if role == "assistant" and rng.random() < 0.5:
                m["reasoning_content"] = f"r{j}"
            raw.append(m)
        msgs = parse_messages(raw)
        for mode in ("chat", "thinking"):
            for effort in (None, "max"):
                for drop in (True, False):
                    assert encode_messages(msgs, mode, effort, drop) == _reference_encoding(msgs, mode, effort, drop)


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
