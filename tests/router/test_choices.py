"""n > 1 and batched prompts: one request fanned out into child requests with derived seeds,
merged back as OpenAI's response (HTTP, through the OpenAI SDK and raw SSE, and gRPC)."""

import json
import threading
import time

import grpc
import httpx
import openai
import pytest
from harness import RouterThread, wait_for

from router.choices import derive_seed
from router.config import RouterConfig
from router.proto import v4serve_pb2 as pb, v4serve_pb2_grpc as pb_grpc
from router.stub_backend import StubBackend
from worker_runtime.wire import ErrorCode, ErrorInfo, TokenChunk


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=router.http_url + "/v1", api_key="none", max_retries=0)


def _expected(router, prompt, seed, i, max_tokens, temperature=1.0):
    return router.expected(prompt, max_tokens, temperature=temperature, seed=derive_seed(seed, i))


def test_derive_seed_is_a_fixed_pure_function():
    assert derive_seed(7, 0) == 7 and derive_seed(-5, 0) == -5  # choice 0 keeps the request's seed
    # fixed values: the documented function (blake2b-64 of (seed, i), 63 bits), not an accident of this process
    assert derive_seed(7, 1) == 1005355968586393444 and derive_seed(7, 2) == 390026414100185703
    assert derive_seed(-5, 1) == derive_seed((1 << 64) - 5, 1)  # the seed's 64-bit pattern
    seeds = {derive_seed(123, i) for i in range(16)}
    assert len(seeds) == 16 and all(0 <= s < 1 << 63 for s in seeds - {123})


def test_completions_n_choices_each_equal_a_single_request_with_its_derived_seed(router, client):
    prompt = router.tokenizer.encode("several choices")
    r = client.completions.create(model="stub", prompt="several choices", n=3, max_tokens=6, seed=11,
                                  temperature=1.0, extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, c in enumerate(r.choices):
        ids, text, finish = _expected(router, prompt, 11, i, 6)
        assert (c.text, c.finish_reason, c.model_extra["token_ids"]) == (text, finish, ids)
        single = client.completions.create(model="stub", prompt="several choices", max_tokens=6,
                                           seed=derive_seed(11, i), temperature=1.0)
        assert single.choices[0].text == c.text
    assert len({c.text for c in r.choices}) == 3
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 18)  # the prompt once
    again = client.completions.create(model="stub", prompt="several choices", n=3, max_tokens=6, seed=11,
                                      temperature=1.0)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_without_a_seed_the_choices_differ(client):
    r = client.completions.create(model="stub", prompt="no seed", n=4, max_tokens=8, temperature=1.0)
    assert len({c.text for c in r.choices}) == 4


def test_batches_of_texts_and_of_token_ids_are_indexed_prompt_major(router, client):
    for prompts in (["first prompt", "second"], [[65, 66, 67], [70, 71, 72, 73]]):
        r = client.completions.create(model="stub", prompt=prompts, n=2, max_tokens=5, seed=3, temperature=1.0)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        ids = [router.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        for p, prompt in enumerate(ids):
            for i in range(2):
                assert r.choices[p * 2 + i].text == _expected(router, prompt, 3, i, 5)[1]
        assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 20
    one = client.completions.create(model="stub", prompt=[[70, 71, 72, 73]], max_tokens=5, seed=3, temperature=1.0)
    assert one.choices[0].text == _expected(router, [70, 71, 72, 73], 3, 0, 5)[1]


def test_chat_stream_chunks_carry_their_index_and_the_usage_sums(router, client):
    messages = [{"role": "user", "content": "stream two"}]
    ref = client.chat.completions.create(model="stub", messages=messages, n=2, max_tokens=7, seed=5, temperature=1.0)
    router.set_stub(token_delay_s=0.002)
    stream = client.chat.completions.create(model="stub", messages=messages, n=2, max_tokens=7, seed=5,
                                            temperature=1.0, stream=True, stream_options={"include_usage": True})
    text, finish, roles, usage = {0: "", 1: ""}, {}, {}, None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        (c,) = chunk.choices
        text[c.index] += c.delta.content or ""
        roles.setdefault(c.index, c.delta.role)
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert text == {c.index: c.message.content for c in ref.choices} and text[0] != text[1]
    assert finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == 14 and usage.prompt_tokens == ref.usage.prompt_tokens


def test_the_other_choices_start_once_the_first_has_streamed(router, client):
    router.set_stub(first_token_delay_s=0.2)
    before = len(router.stub.started)
    t0 = time.monotonic()
    r = client.completions.create(model="stub", prompt="affinity", n=3, max_tokens=2, seed=1)
    took = time.monotonic() - t0
    started = router.stub.started[before:]
    assert started[0].endswith("-0") and sorted(s[-2:] for s in started) == ["-0", "-1", "-2"]
    assert 0.4 <= took < 2.0  # the lead's first token, then the others' (together, not one after another)
    assert len(r.choices) == 3


def test_n_bounds_and_admission(router):
    r = httpx.post(router.http_url + "/v1/completions", json={"prompt": "x", "n": 17}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "16" in r.json()["error"]["message"]
    small = RouterThread(RouterConfig(http_port=0, grpc_port=None, max_concurrent_requests=4))
    try:
        r = httpx.post(small.http_url + "/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        small.set_stub(first_token_delay_s=0.5)
        slow = threading.Thread(target=httpx.post, args=(small.http_url + "/v1/completions",),
                                kwargs={"json": {"prompt": "a", "n": 3, "max_tokens": 1}, "timeout": 10})
        slow.start()
        assert wait_for(lambda: small.stub.active)
        r = httpx.post(small.http_url + "/v1/completions", json={"prompt": "b", "n": 2, "max_tokens": 1}, timeout=10)
        assert r.status_code == 429  # 3 + 2 generations > 4
        slow.join()
    finally:
        small.close()


def test_a_client_disconnect_cancels_every_choice(router):
    router.set_stub(token_delay_s=0.05)
    before = len(router.stub.aborted)
    with httpx.stream("POST", router.http_url + "/v1/completions", timeout=10,
                      json={"prompt": "leave", "n": 3, "max_tokens": 200, "stream": True}) as r:
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if seen == {0, 1, 2}:
                break
    assert wait_for(lambda: len(router.stub.aborted) - before >= 3 and not router.stub.active)
    assert sorted(a[-2:] for a in router.stub.aborted[before:]) == ["-0", "-1", "-2"]


class _OneChoiceFails(StubBackend):
    async def generate(self, req):
        async for chunk in super().generate(req):
            if req.request_id.endswith("-1") and chunk.token_ids:
                yield TokenChunk(req.request_id, (), error=ErrorInfo(ErrorCode.NO_WORKER, "decode workers lost"))
                return
            yield chunk


def test_one_failing_choice_fails_the_request_and_ends_the_others():
    rt = RouterThread(RouterConfig(http_port=0, grpc_port=None), backend_cls=_OneChoiceFails)
    rt.set_stub(token_delay_s=0.02)
    try:
        r = httpx.post(rt.http_url + "/v1/completions", json={"prompt": "x", "n": 3, "max_tokens": 100}, timeout=10)
        assert r.status_code == 503 and "decode workers lost" in r.json()["error"]["message"]
        assert wait_for(lambda: not rt.stub.active)
        assert {"-0", "-2"} <= {a[-2:] for a in rt.stub.aborted}
    finally:
        rt.close()


def test_grpc_n_choices_with_their_index_and_abort_of_the_request(router):
    with grpc.insecure_channel(router.grpc_target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        prompt = [9, 10, 11]
        out = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=4, n=3, seed=21,
                                                    temperature=1.0), timeout=10))
        for i in range(3):
            mine = [m for m in out if m.index == i]
            ids, text, finish = _expected(router, prompt, 21, i, 4)
            assert [t for m in mine for t in m.token_ids] == ids and "".join(m.text for m in mine) == text
            assert mine[-1].finish_reason == finish and mine[-1].usage.completion_tokens == 4
        router.set_stub(token_delay_s=0.05)
        call = stub.Generate(pb.GenerateRequest(prompt="abort me", max_tokens=500, n=2, request_id="grp-1"),
                             timeout=10)
        next(call)
        assert wait_for(lambda: {"grp-1-0", "grp-1-1"} <= router.stub.active)
        assert stub.Abort(pb.AbortRequest(request_id="grp-1")).found
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.CANCELLED
        assert wait_for(lambda: {"grp-1-0", "grp-1-1"} <= set(router.stub.aborted))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt="x", n=17), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_deadline_ends_every_choice():
    rt = RouterThread(RouterConfig(http_port=0, grpc_port=None, request_timeout_s=0.3))
    rt.set_stub(token_delay_s=0.05)
    try:
        r = httpx.post(rt.http_url + "/v1/completions", json={"prompt": "late", "n": 2, "max_tokens": 100}, timeout=10)
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
        assert wait_for(lambda: not rt.stub.active)
        assert sorted(a[-2:] for a in rt.stub.aborted) == ["-0", "-1"]
        assert rt.metric("v4serve_requests_total", {"outcome": "error", "reason": "deadline_exceeded"}) == 1
    finally:
        rt.close()
