"""A router with a StubBackend running on its own event loop in a background thread, so tests
can use the synchronous clients real users use (openai SDK, generated gRPC stubs, httpx)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from router.app import serve
from router.config import RouterConfig
from router.stub_backend import StubBackend, StubConfig
from worker_runtime.wire import GenerateRequest

VOCAB = 512


class RouterThread:
    def __init__(self, config: RouterConfig | None = None, stub_config: StubConfig | None = None,
                 token_pool: tuple[int, ...] | None = None, backend_cls: type = StubBackend):
        self.tokenizer = ByteTokenizer(VOCAB)
        self.stub = backend_cls(self.tokenizer, stub_config or StubConfig(max_model_len=2048), token_pool)
        self.config = config or RouterConfig(http_port=0, grpc_port=0)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.handle = self.call(serve(self.config, self.stub))

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def set_stub(self, **changes) -> None:
        self.stub.config = replace(self.stub.config, **changes)

    @property
    def http_url(self) -> str:
        return self.handle.http_url

    @property
    def grpc_target(self) -> str:
        return self.handle.grpc_target

    def metric(self, name: str, labels: dict | None = None) -> float:
        return self.handle.metrics.sample(name, labels)

    def expected(self, prompt_ids, max_tokens: int, temperature: float = 0.0, seed: int = 0,
                 stop=(), stop_token_ids=(), ignore_eos: bool = False):
        """(token_ids, text, finish_reason) the stub produces for these parameters."""
        req = GenerateRequest("x", tuple(prompt_ids), max_tokens, SamplingParams(temperature=temperature, seed=seed),
                              tuple(stop_token_ids), tuple(stop), ignore_eos)
        return self.stub.expected(req)

    def close(self) -> None:
        try:
            self.call(self.handle.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


def wait_for(pred, timeout: float = 5.0, interval: float = 0.01) -> bool:
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return pred()
