"""Malformed input, limits, auth, backpressure, disconnects, deadlines and backend errors over
HTTP: always a clear OpenAI-style 4xx/5xx body, never a 500 trace and never a hang."""

import json
import socket
import ssl
import sys
import time

import httpx
import pytest
from harness import RouterThread, wait_for

from router.config import RouterConfig
from router.errors import APIError
from router.json_body import MAX_JSON_DEPTH, nests_deeper_than, parse_json
from worker_runtime.wire import ErrorCode

GOOD = {"model": "stub", "prompt": "hi", "max_tokens": 4}

CASES = [
    # (name, path, raw body or dict, status, param, code)
    ("bad json", "/v1/completions", b'{"prompt": ', 400, None, "invalid_request"),
    ("bad utf8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, "invalid_request"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None, "invalid_request"),
    ("brackets in a string", "/v1/completions", {**GOOD, "prompt": "[" * 300, "max_tokens": -1}, 400,
     "max_tokens", "invalid_request"),
    ("nan", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None, "invalid_request"),
    ("deep nesting", "/v1/completions", b"[" * 100000 + b"]" * 100000, 400, None, "invalid_request"),
    ("missing prompt", "/v1/completions", {"model": "stub"}, 400, "prompt", "invalid_request"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt", "invalid_request"),
    ("prompt wrong type", "/v1/completions", {"prompt": 5}, 400, "prompt", "invalid_request"),
    ("token id out of range", "/v1/completions", {"prompt": [1, 512]}, 400, "prompt", "invalid_request"),
    ("negative token id", "/v1/completions", {"prompt": [-1]}, 400, "prompt", "invalid_request"),
    ("bool token id", "/v1/completions", {"prompt": [1, True]}, 400, "prompt", "invalid_request"),
    ("batch over the limit", "/v1/completions", {"prompt": ["a"] * 33}, 400, "prompt", "invalid_request"),
    ("mixed batch", "/v1/completions", {"prompt": ["a", [1, 2]]}, 400, "prompt", "invalid_request"),
    ("empty prompt in a batch", "/v1/completions", {"prompt": ["a", ""]}, 400, "prompt[1]", "invalid_request"),
    ("bad id in a batch", "/v1/completions", {"prompt": [[1], [1, 99999]]}, 400, "prompt[1]", "invalid_request"),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("model wrong type", "/v1/completions", {**GOOD, "model": 3}, 400, "model", "invalid_request"),
    ("negative max_tokens", "/v1/completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens", "invalid_request"),
    ("zero max_tokens", "/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens", "invalid_request"),
    ("max_tokens string", "/v1/completions", {**GOOD, "max_tokens": "4"}, 400, "max_tokens", "invalid_request"),
    ("max_tokens float", "/v1/completions", {**GOOD, "max_tokens": 4.5}, 400, "max_tokens", "invalid_request"),
    ("max_tokens over limit", "/v1/completions", {**GOOD, "max_tokens": 10**6}, 400, "max_tokens", "invalid_request"),
    ("over context", "/v1/completions", {**GOOD, "max_tokens": 2047}, 400, "max_tokens", "context_length_exceeded"),
    ("prompt over limit", "/v1/completions", {"prompt": "x" * 3000}, 400, "prompt", "context_length_exceeded"),
    ("temperature high", "/v1/completions", {**GOOD, "temperature": 3}, 400, "temperature", "invalid_request"),
    ("temperature string", "/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature", "invalid_request"),
    ("top_p zero", "/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p", "invalid_request"),
    ("top_k float", "/v1/completions", {**GOOD, "top_k": 1.5}, 400, "top_k", "invalid_request"),
    ("seed string", "/v1/completions", {**GOOD, "seed": "1"}, 400, "seed", "invalid_request"),
    ("n=17", "/v1/completions", {**GOOD, "n": 17}, 400, "n", "invalid_request"),
    ("n=0", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n",
     "invalid_request"),
    ("n as a string", "/v1/completions", {**GOOD, "n": "2"}, 400, "n", "invalid_request"),
    ("best_of", "/v1/completions", {**GOOD, "best_of": 3}, 400, "best_of", "invalid_request"),
    ("best_of other than n", "/v1/completions", {**GOOD, "n": 2, "best_of": 3}, 400, "best_of", "invalid_request"),
    ("logprobs over 20", "/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs", "invalid_request"),
    ("penalty out of range", "/v1/completions", {**GOOD, "presence_penalty": 2.5}, 400, "presence_penalty",
     "invalid_request"),
    ("stop wrong type", "/v1/completions", {**GOOD, "stop": 5}, 400, "stop", "invalid_request"),
    ("stop empty string", "/v1/completions", {**GOOD, "stop": [""]}, 400, "stop", "invalid_request"),
    ("stop ids out of range", "/v1/completions", {**GOOD, "stop_token_ids": [9999]}, 400, "stop_token_ids", "invalid_request"),
    ("stop string too long", "/v1/completions", {**GOOD, "stop": ["x" * 1025]}, 400, "stop", "invalid_request"),
    ("too many stop ids", "/v1/completions", {**GOOD, "stop_token_ids": [1] * 65}, 400, "stop_token_ids", "invalid_request"),
    ("stream not bool", "/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream", "invalid_request"),
    ("stream_options w/o stream", "/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400,
     "stream_options", "invalid_request"),
    ("ignore_eos not bool", "/v1/completions", {**GOOD, "ignore_eos": 1}, 400, "ignore_eos", "invalid_request"),
    ("lone surrogate", "/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt", "invalid_request"),
    ("chat missing messages", "/v1/chat/completions", {"model": "stub"}, 400, "messages", "invalid_request"),
    ("chat empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_request"),
    ("chat bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", "invalid_request"),
    ("chat content type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content", "invalid_request"),
    ("chat image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].type", "invalid_request"),
    ("chat tool result content", "/v1/chat/completions", {"messages": [{"role": "tool", "content": 1}]}, 400,
     "messages[0].content", "invalid_request"),
    ("chat bad tool call arguments", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}, 400,
     "messages[1].tool_calls[0].function.arguments", "invalid_request"),
    ("unknown field", "/v1/completions", {**GOOD, "frobnicate": 1}, 400, "frobnicate", "invalid_request"),
    ("unknown nested field", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x", "colour": "red"}]}, 400, "messages[0].colour", "invalid_request"),
    ("min_tokens over max_tokens", "/v1/completions", {**GOOD, "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens",
     "invalid_request"),
    ("repetition_penalty zero", "/v1/completions", {**GOOD, "repetition_penalty": 0}, 400, "repetition_penalty",
     "invalid_request"),
    ("priority", "/v1/completions", {**GOOD, "priority": 3}, 400, "priority", "invalid_request"),
    ("logit_bias not an id", "/v1/completions", {**GOOD, "logit_bias": {"a": 1.0}}, 400, "logit_bias", "invalid_request"),
    ("logit_bias id out of range", "/v1/completions", {**GOOD, "logit_bias": {"9999": 1.0}}, 400, "logit_bias",
     "invalid_request"),
    ("logit_bias value", "/v1/completions", {**GOOD, "logit_bias": {"5": 101}}, 400, "logit_bias", "invalid_request"),
    ("echo on chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400,
     "echo", "invalid_request"),
    ("max_tokens 0 without echo", "/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens", "invalid_request"),
    ("min_p over 1", "/v1/completions", {**GOOD, "min_p": 1.5}, 400, "min_p", "invalid_request"),
    ("min_p negative", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "min_p": -0.1}, 400,
     "min_p", "invalid_request"),
    ("json_schema bad schema", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objectx"}}}}, 400,
     "response_format", "invalid_request"),
    ("response_format type", "/v1/completions", {**GOOD, "response_format": {"type": "xml"}}, 400,
     "response_format.type", "invalid_request"),
    ("json_schema missing", "/v1/completions", {**GOOD, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema", "invalid_request"),
    ("chat_template_kwargs unknown", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"colour": 1}}, 400,
     "chat_template_kwargs.colour", "invalid_request"),
    ("thinking disagreement", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"thinking": True},
      "thinking_mode": "chat"}, 400, "thinking_mode", "invalid_request"),
    ("effort without thinking", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"thinking": False},
      "reasoning_effort": "max"}, 400, "reasoning_effort", "invalid_request"),
    ("tool_choice names an unknown function", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice.function.name",
     "invalid_request"),
    ("tool_choice without tools", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, 400, "tool_choice", "invalid_request"),
    ("strict tool without an object schema", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "array"}}}]},
     400, "tools[0].function.parameters", "invalid_request"),
    ("bad tool name", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools[0].function.name",
     "invalid_request"),
    ("chat thinking mode", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "thinking_mode": "deep"}, 400, "thinking_mode", "invalid_request"),
    ("chat reasoning effort", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "low"}, 400, "reasoning_effort",
     "invalid_request"),
    ("unknown route", "/v1/embeddings", GOOD, 404, None, "not_found"),
]


@pytest.mark.parametrize("name,path,body,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_malformed_input(router, name, path, body, status, param, code):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(router.http_url + path, content=raw, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param and err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_deep_nesting_is_refused_without_recursing():
    """The depth check runs before json.loads, so no body reaches the interpreter's recursion
    limit; brackets inside strings, escaped quotes included, do not count."""
    at_limit = "[" * MAX_JSON_DEPTH + "1" + "]" * MAX_JSON_DEPTH
    assert parse_json(at_limit.encode()) is not None
    with pytest.raises(APIError, match=f"more than {MAX_JSON_DEPTH} levels"):
        parse_json(("[" + at_limit + "]").encode())
    quoted = json.dumps({"prompt": '\\"[{' * 1000, "x": [[{"y": "]]]"}]]})
    assert parse_json(quoted.encode())["x"] == [[{"y": "]]]"}]]
    assert not nests_deeper_than(quoted, 4) and nests_deeper_than(quoted, 3)  # {, [, [, {
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(60)  # json.loads would fail at this limit on the deep body
    try:
        with pytest.raises(APIError, match="levels"):
            parse_json(b"[" * 100000 + b"]" * 100000)
    finally:
        sys.setrecursionlimit(before)


def test_wrong_method(router):
    r = httpx.get(router.http_url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_validation_errors_are_counted(router):
    before = router.metric("v4serve_requests_total", {"outcome": "error", "reason": "invalid_request"})
    httpx.post(router.http_url + "/v1/completions", json={"prompt": ""})
    assert router.metric("v4serve_requests_total", {"outcome": "error", "reason": "invalid_request"}) == before + 1


def test_body_size_limit():
    r = RouterThread(RouterConfig(http_port=0, grpc_port=None, max_body_bytes=1000))
    try:
        big = json.dumps({"prompt": "x" * 5000}).encode()
        json_type = {"content-type": "application/json"}
        resp = httpx.post(r.http_url + "/v1/completions", content=big, headers=json_type)
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "too_large"

        def chunks():  # no Content-Length: the limit applies while reading
            for i in range(0, len(big), 256):
                yield big[i:i + 256]
        resp = httpx.post(r.http_url + "/v1/completions", content=chunks(), headers=json_type)
        assert resp.status_code == 413
        assert httpx.post(r.http_url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
    finally:
        r.close()


def test_auth_required_when_configured():
    r = RouterThread(RouterConfig(http_port=0, grpc_port=None, api_keys=("k1", "k2")))
    try:
        url = r.http_url + "/v1/completions"
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(url, json=body).status_code == 401
        bad = httpx.post(url, json=body, headers={"authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        assert bad.headers["www-authenticate"] == "Bearer"
        assert httpx.post(url, json=body, headers={"authorization": "Basic k1"}).status_code == 401
        assert httpx.post(url, json=body, headers={"authorization": "Bearer k2"}).status_code == 200
        assert httpx.get(r.http_url + "/v1/models", headers={"authorization": "bearer k1"}).status_code == 200
        assert httpx.get(r.http_url + "/v1/models").status_code == 401
        assert httpx.get(r.http_url + "/health").status_code == 200  # probes stay open
    finally:
        r.close()


def test_auth_off_without_keys(router):
    r = httpx.post(router.http_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                   headers={"authorization": "Bearer whatever"})
    assert r.status_code == 200


def test_overloaded_backend_429_with_retry_after(router):
    router.set_stub(overloaded_retry_after=2.5)
    r = httpx.post(router.http_url + "/v1/completions", json=GOOD)
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert router.metric("v4serve_requests_total", {"outcome": "error", "reason": "overloaded"}) >= 1


def test_concurrency_limit_429():
    r = RouterThread(RouterConfig(http_port=0, grpc_port=None, max_concurrent_requests=1))
    try:
        r.set_stub(token_delay_s=0.05)
        with httpx.Client(timeout=10) as c, c.stream("POST", r.http_url + "/v1/completions",
                                                     json={"prompt": "a", "max_tokens": 40, "stream": True}) as s:
            assert s.status_code == 200
            assert wait_for(lambda: r.stub.active)
            second = httpx.post(r.http_url + "/v1/completions", json=GOOD)
            assert second.status_code == 429 and "retry-after" in second.headers
        assert wait_for(lambda: r.handle.dispatcher.active == 0)
        assert httpx.post(r.http_url + "/v1/completions", json=GOOD).status_code == 200
    finally:
        r.close()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_backend(router, stream):
    router.set_stub(token_delay_s=0.05)
    body = json.dumps({"prompt": "long", "max_tokens": 500, "stream": stream}).encode()
    host, port = router.http_url.split("//")[1].split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    assert wait_for(lambda: router.stub.active)
    rid = next(iter(router.stub.active))
    time.sleep(0.1)
    sock.close()
    assert wait_for(lambda: rid in router.stub.aborted and not router.stub.active)
    assert rid not in router.stub.finished
    assert wait_for(lambda: router.metric("v4serve_requests_in_flight") == 0)


def test_deadline_exceeded():
    r = RouterThread(RouterConfig(http_port=0, grpc_port=None, request_timeout_s=0.3))
    try:
        r.set_stub(token_delay_s=0.05)
        t0 = time.monotonic()
        resp = httpx.post(r.http_url + "/v1/completions", json={"prompt": "slow", "max_tokens": 200})
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "deadline_exceeded"
        assert time.monotonic() - t0 < 3
        assert wait_for(lambda: len(r.stub.aborted) == 1 and not r.stub.active)
        with httpx.stream("POST", r.http_url + "/v1/completions",
                          json={"prompt": "slow", "max_tokens": 200, "stream": True}) as s:
            text = s.read().decode()
        assert s.status_code == 200 and '"code":"deadline_exceeded"' in text and text.endswith("data: [DONE]\n\n")
        assert r.metric("v4serve_requests_total", {"outcome": "error", "reason": "deadline_exceeded"}) == 2
    finally:
        r.close()


@pytest.mark.parametrize("code", [ErrorCode.KV_TRANSFER_FAILED, ErrorCode.NO_WORKER, ErrorCode.INTERNAL])
def test_backend_error_chunk_mapped(router, code):
    router.set_stub(fail_with=code, fail_after=2)
    label = {"outcome": "error", "reason": code.name.lower()}
    before = router.metric("v4serve_requests_total", label)
    r = httpx.post(router.http_url + "/v1/completions", json=GOOD)
    assert r.status_code == code.http_status and r.json()["error"]["code"] == code.name.lower()
    with httpx.stream("POST", router.http_url + "/v1/completions", json={**GOOD, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert s.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == code.name.lower()
    assert sum("choices" in e for e in events[:-2]) == 2  # the tokens before the failure were relayed
    assert router.metric("v4serve_requests_total", label) == before + 2


def test_tls_https_and_grpc(tmp_path):
    import grpc

    from router.proto import v4serve_pb2 as pb, v4serve_pb2_grpc as pb_grpc
    cert, key = _self_signed(tmp_path)
    r = RouterThread(RouterConfig(http_port=0, grpc_port=0, tls_cert=str(cert), tls_key=str(key)))
    try:
        assert r.http_url.startswith("https://")
        resp = httpx.post(r.http_url + "/v1/completions", json=GOOD, verify=ssl.create_default_context(cafile=str(cert)))
        assert resp.status_code == 200
        with pytest.raises(httpx.ConnectError):
            httpx.post(r.http_url + "/v1/completions", json=GOOD)  # unknown CA
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(r.grpc_target, creds) as ch:
            out = list(pb_grpc.InferenceStub(ch).Generate(pb.GenerateRequest(prompt="hi", max_tokens=3), timeout=10))
        assert out[-1].finish_reason == "length"
    finally:
        r.close()


def _self_signed(tmp_path):
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    k = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(k, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
    return cert_path, key_path


def test_incomplete_body_times_out():
    r = RouterThread(RouterConfig(http_port=0, grpc_port=None, body_read_timeout_s=0.3))
    try:
        host, port = r.http_url.split("//")[1].split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 100\r\n\r\n{\"prompt\"")
            reply = b""
            while b"did not arrive" not in reply:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
            reply = reply.decode()
        assert reply.startswith("HTTP/1.1 400") and "did not arrive" in reply
    finally:
        r.close()
