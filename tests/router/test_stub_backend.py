"""The stub backend is deterministic and honours the request like a real worker."""

import asyncio

import pytest

from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from model.detokenizer import Detokenizer
from router.stub_backend import StubBackend, StubConfig
from worker_runtime.wire import ErrorCode, GenerateRequest

TOK = ByteTokenizer(512)


def req(prompt=(1, 2, 3), n=20, temp=0.0, seed=0, **kw):
    return GenerateRequest("r", tuple(prompt), n, SamplingParams(temperature=temp, seed=seed), **kw)


def run(backend, r):
    async def go():
        return [c async for c in backend.generate(r)]
    return asyncio.run(go())


def test_stream_equals_expected_and_is_deterministic():
    b = StubBackend(TOK, StubConfig(tokens_per_chunk=3))
    chunks = run(b, req())
    ids, text, finish = b.expected(req())
    assert [t for c in chunks for t in c.token_ids] == ids and "".join(c.text for c in chunks) == text
    assert chunks[-1].finish_reason == finish == "length" and chunks[-1].usage.completion_tokens == 20
    assert b.expected(req()) == (ids, text, finish)
    assert b.expected(req(temp=1.0, seed=1))[0] != b.expected(req(temp=1.0, seed=2))[0]
    assert b.expected(req(temp=0.0, seed=1)) == b.expected(req(temp=0.0, seed=2))  # greedy ignores the seed


def test_stops():
    b = StubBackend(TOK)
    ids, text, _ = b.expected(req(n=30))
    got = b.expected(req(n=30, stop_token_ids=(ids[4],)))
    assert got[0] == ids[:ids.index(ids[4]) + 1] and got[2] == "stop"
    s = text[6:9]
    got = b.expected(req(n=30, stop_strings=(s,)))
    assert got[2] == "stop" and got[1] == text[:text.index(s)]


def test_failure_and_abort():
    b = StubBackend(TOK, StubConfig(fail_with=ErrorCode.NO_WORKER, fail_after=2))
    chunks = run(b, req())
    assert len(chunks) == 3 and chunks[-1].error.code is ErrorCode.NO_WORKER

    b = StubBackend(TOK, StubConfig(token_delay_s=0.01))

    async def go():
        out = []
        async for c in b.generate(req(n=1000)):
            out.append(c)
            if len(out) == 2:
                await b.abort("r")
        return out
    out = asyncio.run(go())
    assert out[-1].error.code is ErrorCode.CANCELLED and b.aborted == ["r"] and not b.active


@pytest.mark.parametrize("stops,pieces,want", [
    ((), ["héllo"], "héllo"),
    (("ll",), ["héllo"], "hé"),
    (("lo",), ["hel", "l", "o!"], "hel"),
    (("x",), ["a€b"], "a€b"),
])
def test_incremental_detokenizer(stops, pieces, want):
    d, out = Detokenizer(TOK, stops), []
    for piece in pieces:
        for t in TOK.encode(piece):  # multi-byte characters arrive one byte token at a time
            out.append(d.push(t))
            if d.stopped:
                break
        if d.stopped:
            break
    out.append(d.flush())
    assert "".join(out) == want
