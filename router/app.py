"""Starting and stopping the router: `handle = await serve(config, backend)`; `await handle.stop()`.

HTTP (uvicorn running the ASGI app of http_server.py) and gRPC (grpc.aio) share one event loop,
one dispatcher (admission, concurrency limit, in-flight table for Abort) and one metrics
registry. Ports may be 0; the handle reports the ports actually bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass

import uvicorn

from router.auth import KeyChecker
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.grpc_server import GRPCServer
from router.http_protocol import HeadLimits, protocol_class
from router.http_server import HTTPApp
from router.metrics import RouterMetrics
from router.openai_protocol import Limits

log = logging.getLogger("v4serve.router")

# After the grace period the requests still running are ended with an error; this is the time
# their handlers get to write it before the servers cancel them.
_SHUTDOWN_TAIL_S = 2.0


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without signal handling: the process that embeds the router owns its signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass
class RouterHandle:
    config: RouterConfig
    http_port: int | None
    grpc_port: int | None
    metrics: RouterMetrics
    dispatcher: Dispatcher
    _http: _EmbeddedServer | None
    _http_task: asyncio.Task | None
    _grpc: GRPCServer | None
    _stopping: asyncio.Future | None = None

    @property
    def http_url(self) -> str | None:
        if self.http_port is None:
            return None
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        return f"{'https' if self.config.tls else 'http'}://{host}:{self.http_port}"

    @property
    def grpc_target(self) -> str | None:
        return None if self.grpc_port is None else f"{self.config.host}:{self.grpc_port}"

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish within the grace period, then end the
        rest with an error their clients see (an SSE error event and [DONE], a gRPC status).
        Idempotent."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        grace = self.config.shutdown_grace_s
        self.dispatcher.close()
        waits = []
        if self._http is not None:
            self._http.should_exit = True  # uvicorn closes its listener and idle connections at once
            waits.append(self._http_task)
        if self._grpc is not None:
            waits.append(asyncio.ensure_future(self._grpc.stop(grace + _SHUTDOWN_TAIL_S)))
        await self.dispatcher.drain(grace)
        await self.dispatcher.abort_all()
        await asyncio.gather(*waits, return_exceptions=True)


def _listen(host: str, port: int) -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
    # without it a response written as headers + body waits out the peer's delayed ACK (~40 ms).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve(config: RouterConfig, backend, metrics: RouterMetrics | None = None) -> RouterHandle:
    """Start the configured servers in front of `backend` on the running event loop.

    `metrics` lets the launcher hand the same RouterMetrics to the backend (queue depths, KV
    transfer counters) before the router starts; a fresh one is made when omitted.
    """
    metrics = metrics or RouterMetrics()
    limits = Limits.build(config, backend)
    keys = KeyChecker(config.api_keys)
    dispatcher = Dispatcher(backend, metrics, config.max_concurrent_requests, config.overload_retry_after_s)

    http = http_task = None
    http_port = None
    if config.http_port is not None:
        sock = _listen(config.host, config.http_port)
        http_port = sock.getsockname()[1]
        app = HTTPApp(backend, dispatcher, limits, keys, metrics, config.max_body_bytes, config.body_read_timeout_s)
        head = HeadLimits(config.max_header_bytes, config.max_headers, config.header_read_timeout_s)
        uv = uvicorn.Config(app, lifespan="off", log_config=None, log_level=config.log_level,
                            access_log=config.access_log,
                            ws="none", http=protocol_class(head, dispatcher.rejected),
                            ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key,
                            timeout_graceful_shutdown=config.shutdown_grace_s + _SHUTDOWN_TAIL_S,
                            timeout_keep_alive=30, server_header=False, proxy_headers=False)
        if config.access_log:  # uvicorn set its loggers to log_level (and an earlier Config may have cut this one off)
            access = logging.getLogger("uvicorn.access")
            access.setLevel(logging.INFO)
            access.propagate = True
        http = _EmbeddedServer(uv)
        http_task = asyncio.create_task(http.serve(sockets=[sock]))
        while not http.started:
            if http_task.done():
                http_task.result()  # raises the startup error
                raise RuntimeError("the HTTP server exited during startup")
            await asyncio.sleep(0.005)

    grpc_server = None
    grpc_port = None
    if config.grpc_port is not None:
        grpc_server = GRPCServer(backend, dispatcher, limits, keys, config.max_body_bytes,
                                 access_log=config.access_log)
        grpc_port = grpc_server.bind(config.host, config.grpc_port, config.tls_cert, config.tls_key)
        if grpc_port == 0:
            raise RuntimeError(f"could not bind gRPC on {config.host}:{config.grpc_port}")
        await grpc_server.start()

    log.info("router serving model %s: http=%s grpc=%s", limits.model_name, http_port, grpc_port)
    return RouterHandle(config, http_port, grpc_port, metrics, dispatcher, http, http_task, grpc_server)
