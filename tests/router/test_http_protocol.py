"""The HTTP connection under the API, over raw sockets: the request head is bounded in size, header
count and time (431 / 414 / 408, slow clients dropped), and every protocol error is answered in
the OpenAI error shape, as JSON, and counted."""

import json
import socket
import threading
import time

import pytest
from harness import RouterThread

from router.config import RouterConfig
from router.stub_backend import StubConfig


@pytest.fixture(scope="module")
def limited():
    r = RouterThread(RouterConfig(http_port=0, grpc_port=None, max_header_bytes=16384, max_headers=100,
                                  header_read_timeout_s=0.5), StubConfig(max_model_len=2048))
    yield r
    r.close()


def _addr(url: str) -> tuple[str, int]:
    host, port = url.split("//")[1].split(":")
    return host, int(port)


def _read_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    raw = b""
    try:
        while chunk := sock.recv(65536):
            raw += chunk
    except ConnectionResetError:
        pass
    return raw


def _response(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def exchange(url: str, data: bytes) -> tuple[int, dict, bytes]:
    """Send `data`, read until the server closes; the response."""
    with socket.create_connection(_addr(url), timeout=5) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before taking it all
        return _response(_read_all(sock))


def assert_openai_error(status, headers, body, want_status, code=None):
    assert status == want_status, body
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err


def get(headers: list[tuple[str, str]], path: str = "/health") -> bytes:
    return (f"GET {path} HTTP/1.1\r\nhost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode()


@pytest.mark.parametrize("headers", [
    [("x-big", "a" * 65536)],
    [(f"x-{i}", "v") for i in range(101)],
    [(f"x-{i}", "v" * 200) for i in range(90)],  # each small, together over 16 KB
], ids=["one 64 KB header", "101 headers", "18 KB in 90 headers"])
def test_oversized_heads_get_431(limited, headers):
    before = limited.metric("v4serve_requests_total", {"outcome": "error", "reason": "too_large"})
    assert_openai_error(*exchange(limited.http_url, get(headers)), 431, "headers_too_large")
    assert limited.metric("v4serve_requests_total", {"outcome": "error", "reason": "too_large"}) == before + 1


def test_heads_within_the_limits_are_served(limited):
    status, _, body = exchange(limited.http_url, get([(f"x-{i}", "v" * 100) for i in range(98)]
                                                     + [("connection", "close")]))
    assert status == 200 and b"\"ok\":true" in body


def test_a_huge_header_is_refused_before_it_has_all_arrived(limited):
    """No end of head ever comes: the 431 must not wait for it, nor buffer the rest."""
    with socket.create_connection(_addr(limited.http_url), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-huge: ")
        sent = 0
        try:
            while sent < 64 << 20:
                sock.sendall(b"a" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, headers, body = _response(_read_all(sock))
    assert sent < 8 << 20, sent  # refused long before 64 MB went out
    assert_openai_error(status, headers, body, 431, "headers_too_large")


def test_a_url_over_the_head_limit_gets_414(limited):
    assert_openai_error(*exchange(limited.http_url, get([], "/v1/models?q=" + "a" * (1 << 20))), 414, "url_too_long")


def _is_dropped(sock: socket.socket, within_s: float) -> tuple[bool, bytes]:
    raw = _read_all(sock, within_s)
    try:
        sock.settimeout(0.05)
        closed = sock.recv(1) == b""
    except socket.timeout:
        closed = False
    except ConnectionResetError:
        closed = True
    return closed, raw


def test_slow_and_silent_connections_are_dropped_after_the_header_timeout(limited):
    def slowloris(out, i):
        with socket.create_connection(_addr(limited.http_url), timeout=5) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
            t0 = time.monotonic()
            try:
                while time.monotonic() - t0 < 4:
                    sock.sendall(b"x")  # one header byte every 50 ms: the head never completes
                    time.sleep(0.05)
            except (BrokenPipeError, ConnectionResetError):
                pass
            out[i] = (time.monotonic() - t0, *_is_dropped(sock, 2))

    def silent(out, i):
        with socket.create_connection(_addr(limited.http_url), timeout=5) as sock:
            t0 = time.monotonic()
            closed, raw = _is_dropped(sock, 4)
            out[i] = (time.monotonic() - t0, closed, raw)

    out = {}
    threads = [threading.Thread(target=slowloris, args=(out, i)) for i in range(20)]
    threads += [threading.Thread(target=silent, args=(out, 20 + i)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert len(out) == 25
    for i, (elapsed, closed, raw) in out.items():
        assert closed and elapsed < 3.5, (i, elapsed, raw[:200])
        if i < 20:  # a started head gets a 408 before the connection goes
            assert_openai_error(*_response(raw), 408, "header_timeout")
        else:
            assert raw == b""


def test_the_header_timeout_does_not_cut_a_long_request(limited):
    """A response that takes longer than the header timeout is not cut, and a pipelined request
    waiting behind it is served after it."""
    limited.set_stub(token_delay_s=0.05)
    body = json.dumps({"prompt": "slow", "max_tokens": 30}).encode()
    post = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))
    with socket.create_connection(_addr(limited.http_url), timeout=10) as sock:
        sock.sendall(post)
        time.sleep(0.2)
        sock.sendall(get([("connection", "close")]))
        raw = _read_all(sock, 10)
    first, _, rest = raw.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200") and b'"finish_reason":"length"' in rest
    assert rest.count(b"HTTP/1.1 200") == 1 and b'"ok":true' in rest


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"transfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"transfer-encoding: chunked\r\ncontent-length: 2\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: abc\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}",
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/9.9\r\nhost: x\r\n\r\n",
    b"GET /health HTTP/1.1\r\nbad header: x\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
], ids=["bad chunk size", "chunked and content-length", "bad content-length", "two content-lengths",
        "garbage request line", "bad version", "bad header name", "http/2 preface"])
def test_protocol_errors_are_openai_json(limited, request_bytes):
    before = limited.metric("v4serve_requests_total", {"outcome": "error", "reason": "invalid_request"})
    assert_openai_error(*exchange(limited.http_url, request_bytes), 400, "malformed_request")
    assert limited.metric("v4serve_requests_total", {"outcome": "error", "reason": "invalid_request"}) == before + 1


def test_defaults_bound_the_head():
    c = RouterConfig()
    assert c.max_header_bytes == 16384 and c.max_headers == 100 and 0 < c.header_read_timeout_s <= 30
    with pytest.raises(ValueError):
        RouterConfig(max_headers=0)
    with pytest.raises(ValueError):
        RouterConfig(header_read_timeout_s=0)
