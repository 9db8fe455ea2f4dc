"""`logprobs` / `top_logprobs` in OpenAI's response shapes through the `openai` SDK, streamed and
not, from the logprobs each token chunk carries (the stub's stand-in values; the engines' are
checked against the model in tests/decode_worker/test_logprobs_engine.py); the sampling controls
(penalties, logit_bias, min_tokens) accepted and carried to the workers."""

import httpx
import openai
import pytest

from router.config import RouterConfig
from router.openai_protocol import Limits, finalize, parse_chat


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=router.http_url + "/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "hi"}]


def check_chat_entries(router, entries, ids, k):
    assert len(entries) == len(ids)
    for e, t in zip(entries, ids):
        piece = router.tokenizer.decode([t])
        assert (e.token, e.logprob, e.bytes) == (piece, -0.5, list(piece.encode()))
        assert len(e.top_logprobs) == k and (k == 0 or e.top_logprobs[0].token == piece)
        assert [x.logprob for x in e.top_logprobs] == [-0.5 - i for i in range(k)]


def test_chat_logprobs_whole_and_streamed(router, client):
    r = client.chat.completions.create(model="stub", messages=MESSAGES, max_tokens=6, logprobs=True, temperature=0,
                                       top_logprobs=3, extra_body={"return_token_ids": True})
    check_chat_entries(router, r.choices[0].logprobs.content, r.choices[0].token_ids, 3)
    entries, ids = [], []
    for chunk in client.chat.completions.create(model="stub", messages=MESSAGES, max_tokens=6, logprobs=True, temperature=0,
                                                stream=True, extra_body={"return_token_ids": True}):
        c = chunk.choices[0]
        entries += c.logprobs.content
        ids += c.token_ids
    assert ids == r.choices[0].token_ids
    check_chat_entries(router, entries, ids, 0)
    plain = client.chat.completions.create(model="stub", messages=MESSAGES, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_whole_and_streamed(router, client):
    r = client.completions.create(model="stub", prompt="abc", max_tokens=5, logprobs=2, temperature=0,
                                  extra_body={"return_token_ids": True})
    lp, ids = r.choices[0].logprobs, r.choices[0].token_ids
    pieces = [router.tokenizer.decode([t]) for t in ids]
    assert lp.tokens == pieces and lp.token_logprobs == [-0.5] * 5
    assert all(len(top) == 2 and top[p] == -0.5 for top, p in zip(lp.top_logprobs, pieces))
    assert lp.text_offset == [sum(len(p) for p in pieces[:i]) for i in range(5)]
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="stub", prompt="abc", max_tokens=5, logprobs=2, temperature=0, stream=True)]
    assert [t for s in streamed for t in s.tokens] == pieces
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
])
def test_out_of_range_logprobs_are_refused_naming_the_field(router, path, body, param):
    r = httpx.post(router.http_url + path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_sampling_controls_reach_the_generate_request(router):
    """Penalties, logit_bias and min_tokens travel in the request's SamplingParams (the engines
    apply them: tests/decode_worker/test_penalties_engine.py)."""
    limits = Limits.build(RouterConfig(), router.stub)
    body = {"messages": MESSAGES, "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
            "logit_bias": {"5": 3, "7": -100}, "min_tokens": 2, "max_tokens": 4}
    s = finalize(parse_chat(body, limits), [(1, 2, 3)], limits, 0.0).generate.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.2)
    assert (s.logit_bias, s.min_tokens) == (((5, 3.0), (7, -100.0)), 2)
    r = httpx.post(router.http_url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, **{
        k: v for k, v in body.items() if k != "messages"}})
    assert r.status_code == 200, r.text
