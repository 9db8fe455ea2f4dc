"""`echo` in the /v1/completions response shapes (router/openai_format.py): the prompt's text
before the output's, whole and in the first streamed chunk; with logprobs, the prompt tokens'
first (the first one null), then the generated ones, offsets counted from the prompt's start.
The values through the workers: tests/router/test_echo_in_process.py."""

import pytest

from model.logprobs import TokenLogprobs
from model.tokenizer import ByteTokenizer
from router.openai_format import ResponseBuilder
from router.openai_protocol import ResponseOptions

TOK = ByteTokenizer(320)
PROMPT = tuple(b"abc")
PROMPT_LPS = (TokenLogprobs(98, -1.0, ((98, -1.0), (97, -2.0))), TokenLogprobs(99, -3.0, ((120, -0.1), (99, -3.0))))


def builder(**options) -> ResponseBuilder:
    return ResponseBuilder("cmpl-1", "m", 0, ResponseOptions(chat=False, echo=True, **options), TOK,
                           prompt_tokens=len(PROMPT), prompt_ids=PROMPT)


def gen(token: int, top: int) -> TokenLogprobs:
    return TokenLogprobs(token, -0.5, ((token, -0.5), (token + 1, -1.5))[:top])


def test_whole_response_echoes_the_prompt_and_its_logprobs():
    b = builder(logprobs=2)
    b.add((100,), "d", None, (gen(100, 2),), PROMPT_LPS)
    b.add((101,), "e", "length", (gen(101, 2),))
    choice = b.choice("length")
    assert choice["text"] == "abcde"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "c", "d", "e"]
    assert lp["token_logprobs"] == [None, -1.0, -3.0, -0.5, -0.5]
    assert lp["top_logprobs"] == [None, {"b": -1.0, "a": -2.0}, {"x": -0.1, "c": -3.0}, {"d": -0.5, "e": -1.5},
                                  {"e": -0.5, "f": -1.5}]
    assert lp["text_offset"] == [0, 1, 2, 3, 4]


def test_streamed_echo_comes_with_the_first_chunk():
    b = builder(logprobs=1, stream=True)
    first = b.chunk((100,), "d", None, (gen(100, 1),), PROMPT_LPS)["choices"][0]
    second = b.chunk((101,), "e", "length", (gen(101, 1),))["choices"][0]
    assert (first["text"], second["text"]) == ("abcd", "e")
    assert first["logprobs"]["token_logprobs"] == [None, -1.0, -3.0, -0.5]
    assert first["logprobs"]["text_offset"] == [0, 1, 2, 3] and second["logprobs"]["text_offset"] == [4]


def test_echo_without_logprobs_and_with_nothing_generated():
    b = builder()
    b.add((100,), "d", "length")
    assert b.choice("length")["text"] == "abcd" and b.choice("length")["logprobs"] is None
    zero = builder(logprobs=1)  # max_tokens 0: one chunk, no token, the prompt's logprobs
    zero.add((), "", "length", (), PROMPT_LPS)
    choice = zero.choice("length")
    assert choice["text"] == "abc" and choice["logprobs"]["token_logprobs"] == [None, -1.0, -3.0]


def test_missing_prompt_logprobs_are_an_error_not_a_short_answer():
    b = builder(logprobs=1)
    b.add((100,), "d", "length", (gen(100, 1),))
    with pytest.raises(ValueError, match="prompt logprobs"):
        b.choice("length")
