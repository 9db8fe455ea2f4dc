"""The OpenAI-compatible HTTP API through the official `openai` SDK, against the stub's reference."""

import asyncio

import httpx
import openai
import pytest

from router.chat_encoding import encode_messages, parse_messages


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=router.http_url + "/v1", api_key="unused", max_retries=0)


def chat_ids(router, messages, mode="chat", effort=None):
    return router.tokenizer.encode(encode_messages(parse_messages(messages), mode, effort))


def test_completion_text_prompt(router, client):
    prompt = "The quick brown fox"
    r = client.completions.create(model="stub", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    ids, text, finish = router.expected(router.tokenizer.encode(prompt), 12)
    assert r.choices[0].text == text and r.choices[0].finish_reason == finish == "length"
    assert r.choices[0].token_ids == ids
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (19, 12, 31)
    assert r.model == "stub" and r.id.startswith("cmpl-")


def test_completion_token_id_prompt_with_seeded_sampling(router, client):
    prompt = [300, 72, 105, 1, 2, 3]
    r = client.completions.create(model="stub", prompt=prompt, max_tokens=9, temperature=0.8, seed=1234,
                                  extra_body={"return_token_ids": True})
    ids, text, _ = router.expected(prompt, 9, temperature=0.8, seed=1234)
    assert r.choices[0].token_ids == ids and r.choices[0].text == text
    other = router.expected(prompt, 9, temperature=0.8, seed=1235)[0]
    assert other != ids  # the seed matters when sampling


def test_completion_streaming_with_token_ids_and_usage(router, client):
    stream = client.completions.create(model="stub", prompt="stream me", max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True})
    chunks = list(stream)
    ids, text, finish = router.expected(router.tokenizer.encode("stream me"), 10)
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in body) == text
    assert all(len(c.choices[0].token_ids) >= 1 for c in body)
    assert [t for c in body for t in c.choices[0].token_ids] == ids
    assert body[-1].choices[0].finish_reason == finish
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == 9


def test_chat_non_streaming(router, client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1=?"}]
    r = client.chat.completions.create(model="stub", messages=msgs, max_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True})
    ids, text, finish = router.expected(chat_ids(router, msgs), 8)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text and r.choices[0].token_ids == ids
    assert r.usage.prompt_tokens == len(chat_ids(router, msgs))
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"


def test_chat_streaming_thinking_max(router, client):
    msgs = [{"role": "user", "content": "prove it"}]
    stream = client.chat.completions.create(
        model="stub", messages=msgs, max_tokens=7, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"thinking_mode": "thinking", "reasoning_effort": "max", "return_token_ids": True})
    chunks = list(stream)
    prompt = chat_ids(router, msgs, "thinking", "max")
    ids, text, _ = router.expected(prompt, 7)
    body = [c for c in chunks if c.choices]
    assert body[0].choices[0].delta.role == "assistant"
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in body)
    assert reasoning == text  # the stub never closes </think>: everything is reasoning
    assert [t for c in body for t in c.choices[0].token_ids] == ids
    assert chunks[-1].usage.prompt_tokens == len(prompt)


def test_chat_thinking_split_at_think_end():
    """With </think> in the stub's vocabulary the answer is split into reasoning and content."""
    from harness import RouterThread
    from router.config import RouterConfig
    tok_end = 261  # </think> in the byte tokenizer
    r = RouterThread(RouterConfig(http_port=0, grpc_port=None), token_pool=(97, 98, tok_end))
    try:
        c = openai.OpenAI(base_url=r.http_url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "q"}]
        out = c.chat.completions.create(model="stub", messages=msgs, max_tokens=12, temperature=0,
                                        extra_body={"thinking_mode": "thinking"})
        _, text, _ = r.expected(chat_ids(r, msgs, "thinking"), 12)
        assert "</think>" in text
        reasoning, content = text.split("</think>", 1)
        assert out.choices[0].message.reasoning_content == reasoning
        assert out.choices[0].message.content == content
    finally:
        r.close()


def test_stop_strings_and_stop_token_ids(router, client):
    prompt = "stopping"
    ids, text, _ = router.expected(router.tokenizer.encode(prompt), 40)
    stop = text[5:7]
    want_ids, want_text, finish = router.expected(router.tokenizer.encode(prompt), 40, stop=[stop])
    r = client.completions.create(model="stub", prompt=prompt, max_tokens=40, temperature=0, stop=stop)
    assert finish == "stop" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == want_text and stop not in r.choices[0].text
    r = client.completions.create(model="stub", prompt=prompt, max_tokens=40, temperature=0,
                                  extra_body={"stop_token_ids": [ids[3]], "return_token_ids": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].token_ids[-1] == ids[3]


def test_eos_and_ignore_eos(router, client):
    router.set_stub(eos_prob=0.3)
    r = client.completions.create(model="stub", prompt="eos", max_tokens=50, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].token_ids[-1] == router.tokenizer.eos_id
    r = client.completions.create(model="stub", prompt="eos", max_tokens=50, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 50


def test_32_concurrent_requests_stream_and_not(router):
    router.set_stub(token_delay_s=0.002)
    aclient = openai.AsyncOpenAI(base_url=router.http_url + "/v1", api_key="x", max_retries=0)

    async def one(i):
        prompt = f"request number {i}"
        if i % 2:
            s = await aclient.completions.create(model="stub", prompt=prompt, max_tokens=16, temperature=0.7,
                                                 seed=i, stream=True, extra_body={"return_token_ids": True})
            got = [t async for c in s for t in c.choices[0].token_ids]
        else:
            r = await aclient.completions.create(model="stub", prompt=prompt, max_tokens=16, temperature=0.7,
                                                 seed=i, extra_body={"return_token_ids": True})
            got = r.choices[0].token_ids
        return got == router.expected(router.tokenizer.encode(prompt), 16, temperature=0.7, seed=i)[0]

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    assert all(asyncio.run(main()))
    assert router.metric("v4serve_requests_in_flight") == 0


def test_models_health_metrics(router, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["stub"]
    h = httpx.get(router.http_url + "/health")
    assert h.status_code == 200 and h.json()["ok"] is True
    before = router.metric("v4serve_requests_total", {"outcome": "success", "reason": "length"})
    client.completions.create(model="stub", prompt="m", max_tokens=3, temperature=0)
    m = httpx.get(router.http_url + "/metrics")
    assert m.status_code == 200 and "text/plain" in m.headers["content-type"]
    for name in ("v4serve_time_to_first_token_seconds_bucket", "v4serve_inter_token_latency_seconds_bucket",
                 "v4serve_e2e_request_latency_seconds_bucket", "v4serve_requests_total"):
        assert name in m.text
    assert router.metric("v4serve_requests_total", {"outcome": "success", "reason": "length"}) == before + 1


def test_backend_metrics_api(router):
    m = router.handle.metrics
    m.set_queue_depth("prefill", 7)
    m.kv_transfer_done(4096, 0.01, 0.002)
    m.kv_transfer_failed("checksum")
    text = httpx.get(router.http_url + "/metrics").text
    assert 'v4serve_queue_depth{pool="prefill"} 7.0' in text
    assert "v4serve_kv_transfer_bytes_total 4096.0" in text
    assert "v4serve_kv_transfer_seconds_sum 0.01" in text and "v4serve_kv_transfer_wire_seconds_sum 0.002" in text
    assert 'v4serve_kv_transfer_failures_total{reason="checksum"} 1.0' in text


def test_prefix_cache_hit_tokens_counted(router, client):
    prompt = "p" * 600  # two full 256-token pages
    before = router.metric("v4serve_prefix_cache_hit_tokens_total")
    client.completions.create(model="stub", prompt=prompt, max_tokens=2, temperature=0)
    r = client.completions.create(model="stub", prompt=prompt, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 512
    assert router.metric("v4serve_prefix_cache_hit_tokens_total") >= before + 512


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(router, client):
    """vLLM's `stream_options.continuous_usage_stats` (guidellm sends it), with include_usage."""
    prompt = router.tokenizer.encode("count as you go")
    stream = client.completions.create(model="stub", prompt="count as you go", max_tokens=5, temperature=0,
                                       stream=True, stream_options={"include_usage": True,
                                                                    "continuous_usage_stats": True})
    chunks = list(stream)
    body = [c for c in chunks if c.choices]
    assert [c.usage.completion_tokens for c in body] == [1, 2, 3, 4, 5]
    assert all(c.usage.prompt_tokens == len(prompt) and c.usage.total_tokens == len(prompt) + i + 1
               for i, c in enumerate(body))
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices
    plain = list(client.completions.create(model="stub", prompt="x", max_tokens=2, stream=True,
                                           stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)  # without include_usage: no usage at all, as vLLM
