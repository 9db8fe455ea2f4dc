"""The gRPC API through stubs generated from router/proto/v4serve.proto."""

import logging
import re
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from harness import RouterThread, wait_for

from router.config import RouterConfig
from router.grpc_server import SERVICE
from router.proto import v4serve_pb2 as pb, v4serve_pb2_grpc as pb_grpc
from worker_runtime.wire import ErrorCode


@pytest.fixture(scope="module")
def channel(router):
    ch = grpc.insecure_channel(router.grpc_target)
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.InferenceStub(channel)


def test_generate_stream_text_prompt(router, stub):
    out = list(stub.Generate(pb.GenerateRequest(prompt="hello grpc", max_tokens=10, temperature=0.0), timeout=10))
    ids, text, finish = router.expected(router.tokenizer.encode("hello grpc"), 10)
    assert [t for m in out for t in m.token_ids] == ids
    assert "".join(m.text for m in out) == text
    assert all(m.finish_reason == "" for m in out[:-1]) and out[-1].finish_reason == finish
    assert out[-1].usage.prompt_tokens == 10 and out[-1].usage.completion_tokens == 10
    assert len({m.request_id for m in out}) == 1


def test_generate_token_ids_sampling_stops(router, stub):
    prompt = [5, 6, 7, 300]
    req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=30, temperature=0.7, top_p=1.0, seed=99,
                             request_id="my-req-1")
    out = list(stub.Generate(req, timeout=10))
    ids, text, _ = router.expected(prompt, 30, temperature=0.7, seed=99)
    assert [t for m in out for t in m.token_ids] == ids and out[0].request_id == "my-req-1"
    stop = text[3:5]
    out = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=30, temperature=0.7, seed=99,
                                                stop=[stop]), timeout=10))
    assert out[-1].finish_reason == "stop" and stop not in "".join(m.text for m in out)


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output(router, stub, include):
    router.set_stub(script=tuple(router.tokenizer.encode("one. two. three")))
    out = list(stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=40, stop=[". t"],
                                                include_stop_str_in_output=include), timeout=10))
    assert out[-1].finish_reason == "stop"
    assert "".join(m.text for m in out) == ("one. t" if include else "one")


@pytest.mark.parametrize("req,status", [
    (pb.GenerateRequest(max_tokens=3), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(prompt="x", prompt_token_ids=[1], max_tokens=3), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(prompt_token_ids=[1, 100000], max_tokens=3), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(prompt="x", max_tokens=-5), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(prompt="x", max_tokens=4000), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(prompt="x", temperature=-1), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(prompt="x", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(prompt="x", model="other"), grpc.StatusCode.NOT_FOUND),
    (pb.GenerateRequest(prompt="x", request_id="bad\nid"), grpc.StatusCode.INVALID_ARGUMENT),
], ids=["no prompt", "both prompts", "id out of range", "negative max_tokens", "over context",
        "negative temperature", "empty stop", "unknown model", "bad request id"])
def test_generate_invalid(stub, req, status):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=10))
    assert e.value.code() == status and e.value.details()


def test_resource_exhausted(router, stub):
    router.set_stub(overloaded_retry_after=1.2)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=2), timeout=10))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(e.value.trailing_metadata())["retry-after"] == "2"


@pytest.mark.parametrize("code", [ErrorCode.KV_TRANSFER_FAILED, ErrorCode.INTERNAL])
def test_backend_error_status(router, stub, code):
    router.set_stub(fail_with=code, fail_after=1)
    label = {"outcome": "error", "reason": code.name.lower()}
    before = router.metric("v4serve_requests_total", label)
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for m in stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=5), timeout=10):
            got.append(m)  # noqa: PERF402 - the stream raises mid-way; keep what came before
    assert e.value.code() == getattr(grpc.StatusCode, code.grpc_status)
    assert len(got) == 1  # one token streamed before the failure
    assert router.metric("v4serve_requests_total", label) == before + 1


def test_abort_rpc_cancels_stream_and_backend(router, stub):
    router.set_stub(token_delay_s=0.05)
    it = stub.Generate(pb.GenerateRequest(prompt="abort me", max_tokens=500, request_id="to-abort"), timeout=20)
    first = next(it)
    assert first.request_id == "to-abort"
    assert stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=5).found
    with pytest.raises(grpc.RpcError) as e:
        list(it)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert wait_for(lambda: "to-abort" in router.stub.aborted and not router.stub.active)
    assert not stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=5).found
    assert router.metric("v4serve_requests_total", {"outcome": "cancelled", "reason": "aborted"}) >= 1


def test_client_cancel_aborts_backend(router, stub):
    router.set_stub(token_delay_s=0.05)
    call = stub.Generate(pb.GenerateRequest(prompt="cancel me", max_tokens=500, request_id="to-cancel"), timeout=20)
    next(call)
    call.cancel()
    assert wait_for(lambda: "to-cancel" in router.stub.aborted and not router.stub.active)
    assert "to-cancel" not in router.stub.finished


def test_deadline_exceeded():
    r = RouterThread(RouterConfig(http_port=None, grpc_port=0, request_timeout_s=0.3))
    try:
        r.set_stub(token_delay_s=0.05)
        with grpc.insecure_channel(r.grpc_target) as ch, pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.InferenceStub(ch).Generate(pb.GenerateRequest(prompt="x", max_tokens=100), timeout=10))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_for(lambda: len(r.stub.aborted) == 1)
    finally:
        r.close()


def test_client_deadline_aborts_backend(router, stub):
    router.set_stub(token_delay_s=0.05)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=100, request_id="client-deadline"), timeout=0.3))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: "client-deadline" in router.stub.aborted and not router.stub.active)


def test_health_and_models(channel, stub):
    h = health_pb2_grpc.HealthStub(channel)
    for service in ("", "v4serve.v1.Inference"):
        assert h.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    r = stub.Health(pb.HealthRequest(), timeout=5)
    assert r.ok and r.details["decode"] == "1"
    models = stub.ListModels(pb.ListModelsRequest(), timeout=5).models
    assert [(m.id, m.max_model_len) for m in models] == [("stub", 2048)]


def test_reflection_lists_services(channel):
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
    names = {s.name for s in resp.list_services_response.service}
    assert {"v4serve.v1.Inference", "grpc.health.v1.Health"} <= names
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="v4serve.v1.Inference")]), timeout=5))
    assert resp.file_descriptor_response.file_descriptor_proto


def test_auth():
    r = RouterThread(RouterConfig(http_port=None, grpc_port=0, api_keys=("secret",)))
    try:
        with grpc.insecure_channel(r.grpc_target) as ch:
            s = pb_grpc.InferenceStub(ch)
            req = pb.GenerateRequest(prompt="x", max_tokens=2)
            for md in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as e:
                    list(s.Generate(req, metadata=md, timeout=5))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                s.ListModels(pb.ListModelsRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = list(s.Generate(req, metadata=(("authorization", "Bearer secret"),), timeout=5))
            assert ok[-1].finish_reason == "length"
            h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert h.status == health_pb2.HealthCheckResponse.SERVING  # probes stay open
    finally:
        r.close()


def test_concurrent_generate(router, stub):
    router.set_stub(token_delay_s=0.002)
    results = {}

    def one(i):
        out = list(stub.Generate(pb.GenerateRequest(prompt=f"c{i}", max_tokens=12, temperature=0.5, seed=i),
                                 timeout=20))
        results[i] = [t for m in out for t in m.token_ids]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(32):
        assert results[i] == router.expected(router.tokenizer.encode(f"c{i}"), 12, temperature=0.5, seed=i)[0]


@pytest.mark.parametrize("raw", [b"\x0a\x02\xff\xfe\x18\x05", b"\xff\xff\xff"], ids=["bad utf-8", "corrupt wire"])
def test_undecodable_request_is_invalid_argument(channel, raw):
    call = channel.unary_stream("/v4serve.v1.Inference/Generate", request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as e:
        list(call(raw, timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_health_watch_still_streams(channel):
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()


def test_every_error_is_counted(router, stub):
    """A request id already in flight (refused by the dispatcher, not by validation) and a bug in
    the request path (a tokenizer raising) each end in a status and in v4serve_requests_total."""
    router.set_stub(token_delay_s=0.05)
    first = stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=200, request_id="taken"), timeout=20)
    next(first)
    invalid = {"outcome": "error", "reason": "invalid_request"}
    before = router.metric("v4serve_requests_total", invalid)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompt="y", max_tokens=2, request_id="taken"), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already in flight" in e.value.details()
    assert router.metric("v4serve_requests_total", invalid) == before + 1
    first.cancel()

    encode = router.stub.tokenizer.encode
    internal = {"outcome": "error", "reason": "internal"}
    before = router.metric("v4serve_requests_total", internal)
    router.stub.tokenizer.encode = lambda text: 1 / 0 if text == "bug" else encode(text)
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt="bug", max_tokens=2), timeout=10))
    finally:
        del router.stub.tokenizer.encode
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert router.metric("v4serve_requests_total", internal) == before + 1


def test_access_log_one_line_per_finished_call(router, stub, caplog):
    """With access_log every finished call logs peer, method, status, duration and request id (the
    router's own id when the client sent none); without it, nothing."""
    caplog.set_level(logging.INFO, logger="v4serve.router.grpc.access")
    list(stub.Generate(pb.GenerateRequest(prompt="quiet", max_tokens=2), timeout=10))
    assert not [r for r in caplog.records if r.name == "v4serve.router.grpc.access"]

    logged = RouterThread(RouterConfig(http_port=None, grpc_port=0, access_log=True))
    try:
        with grpc.insecure_channel(logged.grpc_target) as ch:
            s = pb_grpc.InferenceStub(ch)
            list(s.Generate(pb.GenerateRequest(prompt="hi", max_tokens=3, request_id="acc-1"), timeout=10))
            out = list(s.Generate(pb.GenerateRequest(prompt="hi", max_tokens=3), timeout=10))
            ours = out[0].request_id
            with pytest.raises(grpc.RpcError):
                list(s.Generate(pb.GenerateRequest(prompt="hi", max_tokens=-1, request_id="acc-bad"), timeout=10))
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            logged.set_stub(token_delay_s=0.05)
            slow = s.Generate(pb.GenerateRequest(prompt="hi", max_tokens=200, request_id="acc-cut"), timeout=20)
            next(slow)
            slow.cancel()
            assert wait_for(lambda: len([r for r in caplog.records if r.name == "v4serve.router.grpc.access"]) == 5)
    finally:
        logged.close()
    line = re.compile(r'^(\S+) - "(\S+)" ([A-Z_]+) (\d+\.\d{3})s request_id=(\S+)$')
    got = [line.match(r.getMessage()).groups() for r in caplog.records if r.name == "v4serve.router.grpc.access"]
    assert [(m, status, rid) for _, m, status, _, rid in got] == [
        (f"/{SERVICE}/Generate", "OK", "acc-1"), (f"/{SERVICE}/Generate", "OK", ours),
        (f"/{SERVICE}/Generate", "INVALID_ARGUMENT", "acc-bad"), ("/grpc.health.v1.Health/Check", "OK", "-"),
        (f"/{SERVICE}/Generate", "CANCELLED", "acc-cut")]
    assert ours.startswith("cmpl-")
    assert all(peer.rsplit(":", 1)[0] in ("127.0.0.1", "[::1]") and float(secs) < 10 for peer, _, _, secs, _ in got)
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "v4serve.router.grpc.access")
