"""How requests end: a gRPC deadline mid-stream leaves no router state behind, a shutdown ends the
streams still running with an error (an SSE error event and [DONE], a gRPC status), and with API
keys on a caller can abort only its own requests."""

import asyncio
import json
import socket
import threading
import time

import grpc
import httpx
import pytest
from harness import RouterThread, wait_for

from router.config import RouterConfig
from router.proto import v4serve_pb2 as pb, v4serve_pb2_grpc as pb_grpc
from router.stub_backend import StubConfig


def test_grpc_deadlines_mid_stream_leave_no_state_behind():
    """Client deadlines of 0.2-1 s on long streams, one request id reused each time: the in-flight
    gauge returns to 0, the slot is released and the id is free again, every time."""
    r = RouterThread(RouterConfig(http_port=None, grpc_port=0, max_concurrent_requests=4),
                     StubConfig(max_model_len=4096, token_delay_s=0.002, abort_delay_s=0.05))

    async def calls():
        async with grpc.aio.insecure_channel(r.grpc_target) as ch:
            stub = pb_grpc.InferenceStub(ch)
            for i in range(16):
                timeout = 0.2 + (i % 5) * 0.2
                call = stub.Generate(pb.GenerateRequest(prompt="long", max_tokens=2000, ignore_eos=True,
                                                        request_id="reused"), timeout=timeout)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in call:
                        pass
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                for _ in range(300):
                    if (r.metric("v4serve_requests_in_flight") == 0 and r.handle.dispatcher.active == 0
                            and not r.handle.dispatcher.in_flight("reused")):
                        break
                    await asyncio.sleep(0.01)
                assert r.metric("v4serve_requests_in_flight") == 0, i
                assert r.handle.dispatcher.active == 0, i
                assert not r.handle.dispatcher.in_flight("reused"), i
            done = [m async for m in stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=3, request_id="reused"),
                                                   timeout=10)]
            assert done[-1].finish_reason == "length"

    try:
        asyncio.run(calls())
        assert wait_for(lambda: not r.stub.active)
    finally:
        r.close()


def _sse_stream(url: str, out: dict) -> None:
    host, port = url.split("//")[1].split(":")
    body = json.dumps({"prompt": "shutdown", "max_tokens": 2000, "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        raw = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
    out["raw"] = raw


def _dechunk(raw: bytes) -> tuple[bytes, bool]:
    """The body of a chunked response, and whether it ended with the terminating chunk."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return body, True
        body, rest = body + rest[:size], rest[size + 2:]
    return body, False


def test_shutdown_ends_running_streams_with_an_error_on_both_doors():
    r = RouterThread(RouterConfig(http_port=0, grpc_port=0, shutdown_grace_s=0.5),
                     StubConfig(max_model_len=4096, token_delay_s=0.01))
    http_out: dict = {}
    grpc_out: dict = {}

    def grpc_stream():
        with grpc.insecure_channel(r.grpc_target) as ch:
            got = 0
            try:
                for m in pb_grpc.InferenceStub(ch).Generate(
                        pb.GenerateRequest(prompt="shutdown", max_tokens=2000, ignore_eos=True), timeout=20):
                    got += len(m.token_ids)
            except grpc.RpcError as e:
                grpc_out["code"], grpc_out["details"] = e.code(), e.details()
            grpc_out["tokens"] = got

    clients = [threading.Thread(target=_sse_stream, args=(r.http_url, http_out)), threading.Thread(target=grpc_stream)]
    try:
        for t in clients:
            t.start()
        assert wait_for(lambda: len(r.stub.active) == 2, 10)
        time.sleep(0.1)
        t0 = time.monotonic()
        r.call(r.handle.stop())
        stopped_in = time.monotonic() - t0
        for t in clients:
            t.join(10)
    finally:
        r.close()

    body, complete = _dechunk(http_out["raw"])
    assert complete, body[-200:]  # a whole chunked response, not a cut one
    events = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "shutting_down" and "shutting down" in err["message"]
    assert sum("choices" in e for e in events) > 3  # tokens streamed before the end
    assert grpc_out["code"] == grpc.StatusCode.UNAVAILABLE and "shutting down" in grpc_out["details"]
    assert grpc_out["tokens"] > 3
    assert 0.5 <= stopped_in < 3, stopped_in  # the grace period, then the streams end at once
    assert r.stub.active == set() and len(r.stub.aborted) == 2
    assert r.metric("v4serve_requests_total", {"outcome": "error", "reason": "shutdown"}) == 2


def test_requests_finishing_within_the_grace_period_complete():
    r = RouterThread(RouterConfig(http_port=0, grpc_port=None, shutdown_grace_s=3.0),
                     StubConfig(max_model_len=4096, token_delay_s=0.01))
    out: dict = {}
    with httpx.Client(timeout=20) as c:
        t = threading.Thread(target=lambda: out.update(r=c.post(r.http_url + "/v1/completions",
                                                                 json={"prompt": "p", "max_tokens": 60})))
        try:
            t.start()
            assert wait_for(lambda: r.stub.active, 10)
            t0 = time.monotonic()
            r.call(r.handle.stop())
            assert time.monotonic() - t0 < 2.5  # returned once the request was done, not after the grace
            t.join(10)
        finally:
            r.close()
    assert out["r"].status_code == 200 and out["r"].json()["choices"][0]["finish_reason"] == "length"


def test_abort_is_scoped_to_the_callers_key():
    r = RouterThread(RouterConfig(http_port=None, grpc_port=0, api_keys=("alice-key", "bob-key")),
                     StubConfig(max_model_len=4096, token_delay_s=0.02))
    alice, bob = (("authorization", "Bearer alice-key"),), (("authorization", "Bearer bob-key"),)
    try:
        with grpc.insecure_channel(r.grpc_target) as ch:
            stub = pb_grpc.InferenceStub(ch)
            it = stub.Generate(pb.GenerateRequest(prompt="mine", max_tokens=500, request_id="alices"),
                               metadata=alice, timeout=20)
            next(it)
            assert not stub.Abort(pb.AbortRequest(request_id="alices"), metadata=bob, timeout=5).found
            time.sleep(0.1)
            assert "alices" in r.stub.active and "alices" not in r.stub.aborted  # untouched
            assert stub.Abort(pb.AbortRequest(request_id="alices"), metadata=alice, timeout=5).found
            with pytest.raises(grpc.RpcError) as e:
                list(it)
            assert e.value.code() == grpc.StatusCode.CANCELLED
            assert wait_for(lambda: "alices" in r.stub.aborted and not r.stub.active)
            with pytest.raises(grpc.RpcError) as e:
                stub.Abort(pb.AbortRequest(request_id="alices"), timeout=5)  # no key at all
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        r.close()
