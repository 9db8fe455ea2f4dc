"""gRPC front door (grpc.aio): service `v4serve.v1.Inference` plus the standard health service
and server reflection.

A GenerateRequest (a ChatRequest) is validated by the same code as the HTTP API: it is turned into
the equivalent /v1/completions (/v1/chat/completions, `grpc_chat.py`) body and parsed by
`openai_protocol`, so both doors accept and refuse exactly the same inputs. The client's own gRPC deadline tightens the request deadline; a client cancel
cancels the handler task, which makes the dispatcher abort the backend request.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from dataclasses import replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.auth import KeyChecker
from router.dispatch import Dispatcher
from router.errors import APIError, invalid
from router.grpc_chat import chat_body, shared_fields, stream_chat, token_logprobs, usage_message
from router.openai_format import stop_string_matched
from router.openai_protocol import Limits, ParsedRequest, finalize, parse_chat, parse_completion, prompt_ids
from router.proto import v4serve_pb2 as pb, v4serve_pb2_grpc as pb_grpc
from worker_runtime.wire import ErrorCode

log = logging.getLogger("v4serve.router.grpc")
access_logger = logging.getLogger("v4serve.router.grpc.access")

SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "v4serve.v1.Inference"
_OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # probes need no key
_MAX_REQUEST_ID = 128
_THREAD_PARSE_BYTES = 64 << 10  # larger messages are validated in a thread (as HTTP bodies are)


def request_body(req: pb.GenerateRequest) -> dict:
    """The /v1/completions body equivalent to a GenerateRequest (unset optionals omitted)."""
    has_text, has_ids = bool(req.prompt), len(req.prompt_token_ids) > 0
    if has_text == has_ids:
        raise invalid("exactly one of 'prompt' and 'prompt_token_ids' must be set", "prompt")
    body: dict = {"prompt": req.prompt if has_text else list(req.prompt_token_ids), **shared_fields(req)}
    if req.HasField("logprobs"):
        body["logprobs"] = req.logprobs
    if req.echo:
        body["echo"] = True
    return body


def _logprobs(chunk, prompt: bool = False) -> list:
    return token_logprobs(chunk.prompt_logprobs if prompt else chunk.logprobs)


def _check_request_id(rid: str) -> str:
    if len(rid) > _MAX_REQUEST_ID or not rid.isprintable():
        raise invalid(f"'request_id' must be at most {_MAX_REQUEST_ID} printable characters", "request_id")
    return rid


async def _abort_with(context, err: APIError):
    trailing = ()
    if err.retry_after is not None:
        trailing = (("retry-after", str(max(1, math.ceil(err.retry_after)))),)
    await context.abort(getattr(grpc.StatusCode, err.code.grpc_status), err.message, trailing_metadata=trailing)


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, backend, dispatcher: Dispatcher, limits: Limits, keys: KeyChecker):
        self.backend, self.dispatcher, self.limits, self.keys = backend, dispatcher, limits, keys

    def _owner(self, context) -> str | None:
        """The identity of the API key the call came with (None: keys off)."""
        if not self.keys.enabled:
            return None
        return self.keys.identify(dict(context.invocation_metadata() or ()).get("authorization"))

    async def _request(self, request, context, parse=parse_completion, body=request_body) -> ParsedRequest:
        """Validated exactly as the equivalent HTTP body (`body(request)` parsed by `parse`); a large
        message in a thread."""
        if request.ByteSize() > _THREAD_PARSE_BYTES:
            draft = await asyncio.to_thread(lambda: parse(body(request), self.limits))
        else:
            draft = parse(body(request), self.limits)
        rid = _check_request_id(request.request_id) if request.request_id else None
        parsed = finalize(draft, await prompt_ids(draft, self.backend.tokenizer), self.limits, time.time(),
                          request_id=rid)
        remaining = context.time_remaining()
        deadline = parsed.children[0].req.deadline
        if remaining is not None:  # the client's own deadline tightens the request's
            client_deadline = time.time() + remaining
            if deadline is None or client_deadline < deadline:
                parsed = replace(parsed, children=tuple(replace(c, req=replace(c.req, deadline=client_deadline))
                                                        for c in parsed.children))
        return parsed

    async def _admit(self, request, context, method: str, *parse):
        """(parsed, owner, slot) of an admitted call, or None once it was refused with its status."""
        try:
            parsed = await self._request(request, context, *parse)
            return parsed, self._owner(context), self.dispatcher.admit(len(parsed.children))
        except Exception as exc:  # noqa: BLE001 - a bug too must end in a status and be counted
            err = _as_api_error(exc, method)
            self.dispatcher.rejected(err)
            await _abort_with(context, err)
            return None

    async def Generate(self, request, context):
        arrival = time.perf_counter()
        admitted = await self._admit(request, context, "Generate")
        if admitted is None:
            return
        parsed, owner, slot = admitted

        rid, keep_stop = parsed.request_id, parsed.options.include_stop_str
        lock = asyncio.Lock()  # choices stream from tasks of their own: one write at a time
        # per choice: its last chunk (held back for the usage), and its ids and text (the stop string)
        last, ids, released = {}, {c.index: [] for c in parsed.children}, {c.index: [] for c in parsed.children}

        async def emit_choice(k, chunk):
            if keep_stop:
                ids[k].extend(chunk.token_ids)
                released[k].append(chunk.text)
            if chunk.finish_reason is not None:
                last[k] = chunk
                return
            async with lock:
                await context.write(pb.GenerateResponse(request_id=rid, token_ids=chunk.token_ids, text=chunk.text,
                                                        index=k, logprobs=_logprobs(chunk),
                                                        prompt_logprobs=_logprobs(chunk, prompt=True)))

        try:
            if len(parsed.children) == 1:
                outcomes = [await self.dispatcher.execute(slot, parsed.generate, lambda c: emit_choice(0, c),
                                                          arrival, owner)]
            else:
                outcomes = await self.dispatcher.execute_group(slot, rid, parsed.children, emit_choice, arrival, owner)
        except APIError as err:
            self.dispatcher.rejected(err)  # an error execute did not count (a request id in use)
            await _abort_with(context, err)
            return
        for c, outcome in zip(parsed.children, outcomes):
            u, text = outcome.usage, last[c.index].text
            if keep_stop and outcome.finish_reason == "stop":
                text += stop_string_matched(self.backend.tokenizer, ids[c.index], "".join(released[c.index]),
                                            c.req.stop_strings)
            await context.write(pb.GenerateResponse(
                request_id=rid, token_ids=last[c.index].token_ids, text=text, finish_reason=outcome.finish_reason,
                index=c.index, logprobs=_logprobs(last[c.index]),
                prompt_logprobs=_logprobs(last[c.index], prompt=True), usage=usage_message(u)))

    async def Chat(self, request, context):
        arrival = time.perf_counter()
        admitted = await self._admit(request, context, "Chat", parse_chat, chat_body)
        if admitted is None:
            return
        parsed, owner, slot = admitted
        try:
            await stream_chat(self.dispatcher, self.backend.tokenizer, self.limits.model_name, parsed, slot, arrival,
                              owner, context.write)
        except APIError as err:
            self.dispatcher.rejected(err)  # an error execute did not count (a request id in use)
            await _abort_with(context, err)

    async def Abort(self, request, context):
        """With API keys on, only the caller's own requests (made with the same key) are found."""
        if not request.request_id:
            await _abort_with(context, invalid("'request_id' is required", "request_id"))
        return pb.AbortResponse(found=await self.dispatcher.abort(request.request_id, self._owner(context)))

    async def Health(self, request, context):
        h = dict(self.backend.health())
        return pb.HealthResponse(ok=bool(h.pop("ok", False)), details={k: str(v) for k, v in h.items()})

    async def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[pb.Model(id=name, max_model_len=self.limits.max_model_len)
                                             for name in self.limits.model_names])


def _as_api_error(exc: Exception, method: str) -> APIError:
    if isinstance(exc, APIError):
        return exc
    log.error("unhandled error in %s", method, exc_info=exc)
    return APIError(ErrorCode.INTERNAL, "internal server error")


class EdgeInterceptor(grpc.aio.ServerInterceptor):
    """Every call passes here first: refuses calls without a valid `authorization: Bearer <key>`
    metadata entry (health exempt), and turns undecodable request messages (bad UTF-8 in a string
    field, a corrupt wire format) into INVALID_ARGUMENT instead of grpc's UNKNOWN. With
    `access_log`, every finished call logs one INFO line (`_access_logged`)."""

    def __init__(self, keys: KeyChecker, access_log: bool = False):
        self.keys, self.access_log = keys, access_log
        if access_log:  # at INFO whatever the router's level, as uvicorn's access logger
            access_logger.setLevel(logging.INFO)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        edge = _guard_malformed(handler)
        if self.keys.enabled and not details.method.startswith(_OPEN_SERVICES):
            md = dict(details.invocation_metadata or ())
            if not self.keys.allows(md.get("authorization")):
                edge = _deny_handler(handler)
        return _access_logged(edge, details.method) if self.access_log else edge


class _ResponseIds:
    """A call's context that notes the request id of the messages written (a Generate the client
    sent without one gets the router's), delegating everything else."""

    def __init__(self, context, request_id: str):
        self._context, self.request_id = context, request_id

    async def write(self, message):
        if not self.request_id:
            self.request_id = getattr(message, "request_id", "")
        await self._context.write(message)

    def __getattr__(self, name):
        return getattr(self._context, name)


def _access_logged(handler, method: str):
    """`handler` logging, once its call ends, `<peer> - "<method>" <status> <seconds>s request_id=<id>`
    at INFO on logger `v4serve.router.grpc.access` (HTTP's lines: `uvicorn.access`)."""
    kind = (handler.request_streaming, handler.response_streaming)
    inner = {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
             (True, False): handler.stream_unary, (True, True): handler.stream_stream}[kind]

    async def behavior(request, context):
        start = time.perf_counter()
        ctx = _ResponseIds(context, "" if kind[0] else getattr(request, "request_id", ""))
        code = None
        try:
            result = inner(request, ctx)
            if inspect.isasyncgen(result):
                async for msg in result:
                    await ctx.write(msg)
                return None
            response = await result
            ctx.request_id = ctx.request_id or getattr(response, "request_id", "")
            return response
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = context.code() or grpc.StatusCode.UNKNOWN  # abort() set it before raising
            raise
        finally:
            code = code or context.code() or grpc.StatusCode.OK
            peer = (context.peer() or "-").removeprefix("ipv4:").removeprefix("ipv6:")
            access_logger.info('%s - "%s" %s %.3fs request_id=%s', peer, method, code.name,
                            time.perf_counter() - start, ctx.request_id or "-")

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[kind](behavior, request_deserializer=handler.request_deserializer,
                      response_serializer=handler.response_serializer)


class _Malformed:
    def __init__(self, err: Exception):
        self.err = err


def _guard_malformed(handler):
    if handler.request_streaming or handler.request_deserializer is None:
        return handler  # only reflection streams requests; its own errors are its own
    deserialize = handler.request_deserializer

    def safe(raw: bytes):
        try:
            return deserialize(raw)
        except Exception as e:  # noqa: BLE001 - any decode failure is the client's malformed input
            return _Malformed(e)

    inner = handler.unary_stream if handler.response_streaming else handler.unary_unary

    async def behavior(request, context):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {request.err}")
        result = inner(request, context)
        if inspect.isasyncgen(result):
            async for msg in result:
                await context.write(msg)
            return None
        return await result

    make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler
    return make(behavior, request_deserializer=safe, response_serializer=handler.response_serializer)


def _deny_handler(handler):
    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "a valid API key is required (metadata authorization: Bearer <key>)")

    async def deny_stream(request_or_iterator, context):
        await deny(request_or_iterator, context)
        yield  # pragma: no cover - unreachable; makes this an async generator

    kind = (handler.request_streaming, handler.response_streaming)
    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[kind]
    return make(deny_stream if kind[1] else deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class GRPCServer:
    """The grpc.aio server with Inference, health (tracking the backend) and reflection."""

    def __init__(self, backend, dispatcher: Dispatcher, limits: Limits, keys: KeyChecker,
                 max_message_bytes: int, health_interval_s: float = 1.0, access_log: bool = False):
        self.backend = backend
        self.server = grpc.aio.server(
            interceptors=[EdgeInterceptor(keys, access_log)],
            options=[("grpc.max_receive_message_length", max_message_bytes), ("grpc.so_reuseport", 0)])
        pb_grpc.add_InferenceServicer_to_server(InferenceServicer(backend, dispatcher, limits, keys), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self.health_interval_s = health_interval_s
        self._health_task: asyncio.Task | None = None

    def bind(self, host: str, port: int, tls_cert: str | None, tls_key: str | None) -> int:
        addr = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        if tls_cert:
            with open(tls_key, "rb") as k, open(tls_cert, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            return self.server.add_secure_port(addr, creds)
        return self.server.add_insecure_port(addr)

    async def start(self) -> None:
        await self.server.start()
        await self._update_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def _update_health(self) -> None:
        try:
            ok = bool(self.backend.health().get("ok"))
        except Exception:  # noqa: BLE001 - a failing health() means not serving
            ok = False
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self._update_health()

    async def stop(self, grace_s: float) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
