"""DSML tool calls parsed out of completions, fed in every split: whatever the pieces, the content
and the assembled calls are the same, and the arguments are the official decoding's JSON."""

import json

import pytest

from router.chat_encoding import render_tool_calls
from router.tool_calls import ToolCallParser, parse_all

D = "｜DSML｜"


def _assemble(pieces):
    """Feed `pieces` in order, assembling deltas as the OpenAI SDK does (by index)."""
    p, content, calls = ToolCallParser(), [], {}
    for piece in pieces + [None]:
        c, deltas = p.feed(piece) if piece is not None else p.flush()
        content.append(c)
        for d in deltas:
            o = d.openai()
            call = calls.setdefault(o["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in o:
                assert call["id"] is None, "a call's id and name come once, in its first delta"
                call["id"], call["name"] = o["id"], o["function"]["name"]
            call["arguments"] += o["function"]["arguments"]
    out = [calls[i] for i in sorted(calls)]
    assert [c["id"] for c in out] == [c["id"] for c in p.calls]
    return "".join(content), [(c["name"], c["arguments"]) for c in out]


CALLS = [("get_weather", {"city": "Paris", "days": 3}, "a"),
         ("search", {"q": 'say "hi"\n</tag> ü', "filters": {"lang": ["en", None]}, "exact": False}, "b"),
         ("now", {}, "c")]


def _official_arguments(args: dict) -> str:
    """decode_dsml_to_arguments of the official encoding: strings JSON-quoted, others as written."""
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: "
                           f"{json.dumps(v, ensure_ascii=False)}" for k, v in args.items()) + "}"


TEXT = "Let me check." + render_tool_calls(CALLS)
WANT = ("Let me check.", [(n, _official_arguments(a)) for n, a, _ in CALLS])


def test_whole_completion():
    content, calls = parse_all(TEXT)
    assert content == WANT[0]
    assert [(c["name"], c["arguments"]) for c in calls] == WANT[1]
    assert [json.loads(c["arguments"]) for c in calls] == [a for _, a, _ in CALLS]


def test_split_at_every_position():
    for at in range(len(TEXT) + 1):
        assert _assemble([TEXT[:at], TEXT[at:]]) == WANT, at


def test_character_by_character_and_in_random_pieces():
    import random
    assert _assemble(list(TEXT)) == WANT
    rng = random.Random(3)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randrange(1, 30)))
        pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)])]
        assert _assemble(pieces) == WANT


def test_string_arguments_stream_before_the_call_ends():
    p = ToolCallParser()
    head = f'\n\n<{D}tool_calls>\n<{D}invoke name="w">\n<{D}parameter name="t" string="true">abc'
    _, deltas = p.feed(head)
    assert deltas[0].name == "w" and "".join(d.arguments for d in deltas) == '{"t": "abc'


def test_no_calls_is_plain_content_and_nothing_is_held_at_the_end():
    for text in ["plain answer", "a < b and <｜DSML｜not a block", "ends with <｜DS", "trailing  \n\n"]:
        assert _assemble(list(text)) == (text, [])


def test_malformed_markup_closes_the_call_and_becomes_content():
    text = f'Hi\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="x" string="true">v</{D}parameter>\n<oops>'
    content, calls = _assemble(list(text))
    assert calls == [("f", '{"x": "v"}')] and content == "Hi<oops>"
    json.loads(calls[0][1])


@pytest.mark.parametrize("cut", [f'<{D}invoke name="f">\n<{D}parameter name="x" string="true">half',
                                 f'<{D}invoke name="f">\n<{D}parameter name="n" string="false">12',
                                 f'<{D}invoke name="f">\n'])
def test_a_completion_cut_mid_call_still_has_json_arguments(cut):
    _, calls = _assemble(list(f"\n\n<{D}tool_calls>\n" + cut))
    assert len(calls) == 1 and isinstance(json.loads(calls[0][1]), dict)


def test_a_non_json_value_marked_not_string_becomes_a_string():
    text = f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="x" string="false">not json</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>'
    assert _assemble(list(text)) == ("", [("f", '{"x": "not json"}')])
