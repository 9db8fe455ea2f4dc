"""OpenAI-compatible HTTP front door as a lean ASGI app (served by uvicorn, see app.py).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize,
POST /detokenize (API key when configured); GET /health, GET /metrics and GET /openapi.json
(open, for probes, scrapers and client generators).

Raw ASGI rather than a framework so that the three things a front door must get exactly right
are explicit here: the body is read under a byte limit (413 before buffering a huge body), every
failure before the first byte is a reason-coded OpenAI error (never a 500 trace, never a hang),
and a client that goes away cancels its generation — the request task and a disconnect watcher
race, and the loser is cancelled, which makes the dispatcher abort the backend request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

from router.auth import KeyChecker
from router.choices import merge_usage
from router.dispatch import Dispatcher
from router.errors import APIError, invalid
from router.json_body import parse_json
from router.openai_format import SSE_DONE, ResponseBuilder, group_response, sse
from router.openai_protocol import Limits, finalize, parse_chat, parse_completion, prompt_ids, tokenize
from router.openapi import openapi_document
from router.tokenize_api import detokenize, tokenize_response, tokenize_text
from worker_runtime.wire import ErrorCode

log = logging.getLogger("v4serve.router.http")

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no")]
_KEYED = ("/v1/", "/tokenize", "/detokenize")  # routes that need an API key when keys are configured
_COUNTED = "v4serve.counted"  # scope key: the request's outcome is the dispatcher's to count

# Bodies larger than this are parsed and validated in a thread: the event loop keeps serving
# other clients (health probes, token streams) meanwhile.
_THREAD_PARSE_BYTES = 64 << 10


class _ClientGone(Exception):
    pass


def _draft(parse, body: bytes, limits: Limits):
    return parse(parse_json(body), limits)


async def _off_loop_if_large(body: bytes, work):
    """`work()`, in a thread when the body is large enough for parsing it to hold up other clients."""
    return await asyncio.to_thread(work) if len(body) > _THREAD_PARSE_BYTES else work()


class HTTPApp:
    def __init__(self, backend, dispatcher: Dispatcher, limits: Limits, keys: KeyChecker, metrics,
                 max_body_bytes: int, body_read_timeout_s: float = 30.0):
        self.backend, self.dispatcher, self.limits = backend, dispatcher, limits
        self.keys, self.metrics, self.max_body_bytes = keys, metrics, max_body_bytes
        self.body_read_timeout_s = body_read_timeout_s
        self.created = int(time.time())
        self.routes = {
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/openapi.json"): self._openapi,
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/detokenize"): self._detokenize,
        }
        self._openapi_body = openapi_document()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        path, method = scope["path"].rstrip("/") or "/", scope["method"]
        handler = self.routes.get((method, path))
        try:
            if handler is None:
                known = any(p == path for _, p in self.routes)
                what = f"method {method} not allowed on" if known else "no route"
                raise APIError(ErrorCode.INVALID_REQUEST, f"{what} {path}",
                               openai_code="method_not_allowed" if known else "not_found", status=405 if known else 404)
            if path.startswith(_KEYED) and not self.keys.allows(_header(scope, b"authorization")):
                raise APIError(ErrorCode.UNAUTHENTICATED, "a valid API key is required (Authorization: Bearer <key>)")
            await handler(scope, receive, send)
        except APIError as err:
            self.dispatcher.rejected(err)
            await _send_error(send, err)
        except _ClientGone:
            pass
        except Exception:
            log.exception("unhandled error on %s %s", method, path)
            err = APIError(ErrorCode.INTERNAL, "internal server error")
            err.counted = scope.get(_COUNTED, False)  # execute() counts the requests it ran
            self.dispatcher.rejected(err)
            await _send_error(send, err)

    # --- simple routes
    async def _models(self, scope, receive, send):
        await _send_json(send, 200, {"object": "list", "data": [{
            "id": name, "object": "model", "created": self.created, "owned_by": "v4serve", "root": self.limits.model_name,
            "max_model_len": self.limits.max_model_len} for name in self.limits.model_names]})

    async def _health(self, scope, receive, send):
        health = dict(self.backend.health())
        await _send_json(send, 200 if health.get("ok") else 503, health)

    async def _metrics(self, scope, receive, send):
        body, ctype = self.metrics.render()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype.encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _openapi(self, scope, receive, send):
        await _send_json(send, 200, self._openapi_body)

    async def _tokenize(self, scope, receive, send):
        body = await self._json_body(scope, receive)
        text, add_bos, strs = await _off_loop_if_large(body, lambda: tokenize_text(parse_json(body), self.limits))
        ids = await tokenize(self.backend.tokenizer, text)
        await _send_json(send, 200, tokenize_response(self.backend.tokenizer, list(ids), add_bos, strs, self.limits))

    async def _detokenize(self, scope, receive, send):
        body = await self._json_body(scope, receive)
        out = await _off_loop_if_large(body, lambda: detokenize(parse_json(body), self.backend.tokenizer, self.limits))
        await _send_json(send, 200, out)

    # --- generation routes
    async def _completions(self, scope, receive, send):
        await self._generate(scope, receive, send, parse_completion)

    async def _chat(self, scope, receive, send):
        await self._generate(scope, receive, send, parse_chat)

    async def _json_body(self, scope, receive) -> bytes:
        if not _is_json(_header(scope, b"content-type")):
            # A body a web page can post without a CORS preflight (text/plain, a form) is refused,
            # so a browser cannot be made to drive a router that has no API keys.
            raise APIError(ErrorCode.INVALID_REQUEST, "the request body must be JSON sent with "
                           "'Content-Type: application/json'", openai_code="unsupported_media_type", status=415)
        try:
            async with asyncio.timeout(self.body_read_timeout_s):
                return await self._read_body(scope, receive)
        except TimeoutError:
            raise invalid(f"the request body did not arrive within {self.body_read_timeout_s:g} s") from None

    async def _generate(self, scope, receive, send, parse):
        arrival = time.perf_counter()
        body = await self._json_body(scope, receive)
        draft = await _off_loop_if_large(body, lambda: _draft(parse, body, self.limits))
        ids = await prompt_ids(draft, self.backend.tokenizer)
        parsed = finalize(draft, ids, self.limits, time.time())
        owner = self.keys.identify(_header(scope, b"authorization"))
        children, opts = parsed.children, parsed.options
        slot = self.dispatcher.admit(len(children))
        try:
            builders = [ResponseBuilder(parsed.request_id, self.limits.model_name, int(time.time()), opts,
                                        self.backend.tokenizer, index=c.index, prompt_tokens=len(c.req.prompt_ids),
                                        prompt_ids=c.req.prompt_ids if opts.echo else ())
                        for c in children]
            if len(children) == 1:
                run = self.dispatcher.execute(slot, parsed.generate, _emitter(builders[0], send, opts.stream),
                                              arrival, owner)
            else:
                run = self.dispatcher.execute_group(slot, parsed.request_id, children,
                                                    _group_emitter(builders, send, opts.stream), arrival, owner)
            scope[_COUNTED] = True  # from here on the dispatcher counts the request's outcome
            if opts.stream:
                await self._stream(receive, send, run, builders[0], parsed.n)
            else:
                outcome = await _unless_disconnected(receive, run)
                if len(children) == 1:
                    await _send_json(send, 200, builders[0].response(outcome.finish_reason, outcome.usage))
                else:
                    await _send_json(send, 200, group_response(builders, outcome, parsed.n))
        finally:
            slot.release()

    async def _stream(self, receive, send, run, builder, n: int):
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        tail = b""
        try:
            outcome = await _unless_disconnected(receive, run)
            if builder.options.include_usage:
                usage = merge_usage([o.usage for o in outcome], n) if isinstance(outcome, list) else outcome.usage
                tail = sse(builder.usage_chunk(usage))
        except APIError as err:  # headers are out: the error travels as an SSE event
            tail = sse(err.body())
        await send({"type": "http.response.body", "body": tail + SSE_DONE, "more_body": False})

    # --- helpers
    async def _read_body(self, scope, receive) -> bytes:
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise APIError(ErrorCode.TOO_LARGE, f"request body over {self.max_body_bytes} bytes")
        parts, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _ClientGone()
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise APIError(ErrorCode.TOO_LARGE, f"request body over {self.max_body_bytes} bytes")
            parts.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(parts)


def _emitter(builder: ResponseBuilder, send, stream: bool):
    """The `emit` of a request: SSE chunks as they come, or accumulated for one response."""
    async def add(chunk):
        builder.add(chunk.token_ids, chunk.text, chunk.finish_reason, chunk.logprobs, chunk.prompt_logprobs)

    async def write(chunk):
        data = sse(builder.chunk(chunk.token_ids, chunk.text, chunk.finish_reason, chunk.logprobs, chunk.prompt_logprobs))
        await send({"type": "http.response.body", "body": data, "more_body": True})

    return write if stream else add


def _group_emitter(builders: list[ResponseBuilder], send, stream: bool):
    """The `emit` of a request of several choices: choice k's chunks through builders[k]. Its
    choices stream from tasks of their own, so each SSE event is written whole under a lock."""
    lock = asyncio.Lock()

    async def add(k, chunk):
        builders[k].add(chunk.token_ids, chunk.text, chunk.finish_reason, chunk.logprobs, chunk.prompt_logprobs)

    async def write(k, chunk):
        data = sse(builders[k].chunk(chunk.token_ids, chunk.text, chunk.finish_reason, chunk.logprobs,
                                     chunk.prompt_logprobs))
        async with lock:
            await send({"type": "http.response.body", "body": data, "more_body": True})

    return write if stream else add


async def _unless_disconnected(receive, work):
    """Await `work` in this task (admission and placement stay in one step of the event loop);
    if the client disconnects first, cancel it (→ backend abort) and raise _ClientGone."""
    task, gone = asyncio.current_task(), False

    async def watch():
        nonlocal gone
        await _wait_disconnect(receive)
        gone = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        raise _ClientGone() from None
    except APIError:
        if gone:  # ended while the client was leaving: nobody to tell
            raise _ClientGone() from None
        raise
    finally:
        watcher.cancel()


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _is_json(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"


def _header(scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


async def _send_json(send, status: int, obj, headers=()) -> None:
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    await send({"type": "http.response.start", "status": status, "headers": _JSON + list(headers)})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send, err: APIError) -> None:
    headers = []
    if err.retry_after is not None:
        headers.append((b"retry-after", str(max(1, math.ceil(err.retry_after))).encode()))
    if err.code is ErrorCode.UNAUTHENTICATED:
        headers.append((b"www-authenticate", b"Bearer"))
    try:
        await _send_json(send, err.http_status, err.body(), headers)
    except RuntimeError:  # the response had already started; nothing more can be said over HTTP
        pass
