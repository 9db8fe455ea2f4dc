"""The HTTP/1.1 connection under the ASGI app: uvicorn's httptools protocol, with the request head
bounded and protocol errors answered like every other error of the API.

The API key is a header, so headers are necessarily read before it can be checked; what an
unauthenticated client can make the router hold is therefore bounded here, per connection:

- size: request line and headers together at most `max_bytes` (431; a URL longer than that
  alone, 414). Counted on the raw bytes while the head is incomplete, so a header that never
  ends is refused after `max_bytes` plus one read, not buffered;
- count: at most `max_headers` header lines (431);
- time: a head must be complete `read_timeout_s` after its first byte, or after the connection
  opened (408, then the connection is closed; a connection that sent nothing is just closed).
  Idle keep-alive connections between requests are uvicorn's `timeout_keep_alive`; the time a
  request waits behind another on the same connection (pipelining) does not count.

A request the parser rejects (a bad chunk size, Transfer-Encoding with Content-Length, a bad
Content-Length, a garbage request line, ...) gets an OpenAI-shaped JSON 400, not uvicorn's plain
text. Every such answer is reported to `on_error` (the request metrics count it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from router.errors import APIError
from worker_runtime.wire import ErrorCode


@dataclass(frozen=True)
class HeadLimits:
    max_bytes: int = 16384
    max_headers: int = 100
    read_timeout_s: float = 10.0


def protocol_class(limits: HeadLimits, on_error: Callable[[APIError], None]) -> type:
    """The protocol class for `uvicorn.Config(http=...)`, bound to these limits."""
    return type("LimitedHttpProtocol", (_LimitedHttpProtocol,), {"limits": limits, "on_error": staticmethod(on_error)})


def _too_large(what: str, limits: HeadLimits) -> APIError:
    if what == "url":
        return APIError(ErrorCode.TOO_LARGE, f"the request URL is over {limits.max_bytes} bytes",
                        openai_code="url_too_long", status=414)
    return APIError(ErrorCode.TOO_LARGE, f"the request headers are over {limits.max_bytes} bytes or "
                    f"{limits.max_headers} lines", openai_code="headers_too_large", status=431)


class _LimitedHttpProtocol(HttpToolsProtocol):
    limits: HeadLimits
    on_error: Callable[[APIError], None]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_head = True  # reading a request head (request line and headers)
        self._raw_head = 0  # bytes received while in the head
        self._head_bytes = 0  # URL and header bytes parsed in the head
        self._head_lines = 0
        self._refusal: APIError | None = None  # set by a parser callback that stops the parse
        self._head_timer = None

    # --- connection
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self._in_head:
            if self._head_timer is None:
                self._arm_head_timer()
            self._raw_head += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no WebSocket here: the request was dispatched as a plain one
        except httptools.HttpParserError as exc:
            self._refuse(self._refusal or APIError(ErrorCode.INVALID_REQUEST, f"malformed HTTP request: {exc}",
                                                   openai_code="malformed_request"))
            return
        if self._in_head and self._raw_head > self.limits.max_bytes:
            self._refuse(_too_large("headers", self.limits))

    # --- parser callbacks
    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        if self._head_bytes > self.limits.max_bytes:
            self._refusal = _too_large("url", self.limits)
            raise ValueError("URL too long")
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_lines += 1
        self._head_bytes += len(name) + len(value) + 4
        if self._head_lines > self.limits.max_headers or self._head_bytes > self.limits.max_bytes:
            self._refusal = _too_large("headers", self.limits)
            raise ValueError("request head too large")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._raw_head = self._head_bytes = self._head_lines = 0
        self._disarm_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head = True  # the next bytes on this connection start a new head
        super().on_message_complete()

    # --- the head's deadline
    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.limits.read_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._in_head:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a pipelined head waits for the response before it: not its fault
        elif self._raw_head == 0:
            self.transport.close()  # nothing sent: nothing to answer
        else:
            self._refuse(APIError(ErrorCode.INVALID_REQUEST, f"the request head did not arrive within "
                                  f"{self.limits.read_timeout_s:g} s", openai_code="header_timeout", status=408))

    # --- answering
    def _refuse(self, err: APIError) -> None:
        """Answer `err` as JSON (unless a response is under way) and close the connection."""
        if self.transport.is_closing():
            return
        self.on_error(err)
        if self.cycle is None or not self.cycle.response_started or self.cycle.response_complete:
            body = json.dumps(err.body(), separators=(",", ":")).encode()
            head = [STATUS_LINE[err.http_status]]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                     b"connection: close\r\n\r\n"]
            self.transport.write(b"".join(head) + body)
        self.transport.close()

    def send_400_response(self, msg: str) -> None:  # uvicorn's own path to a plain-text 400
        self._refuse(APIError(ErrorCode.INVALID_REQUEST, f"malformed HTTP request: {msg}",
                              openai_code="malformed_request"))
