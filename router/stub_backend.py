"""A real, deterministic backend for tests and benchmarks (the router's `Backend` protocol).

Token i of a request is a pure function of (prompt_ids, seed, position): a keyed hash picks it
from a pool of printable tokens (seed ignored when greedy, as with a real model), with an
optional EOS probability, or a fixed script of tokens (`StubConfig.script`, for output of a
given shape such as tool calls). Everything else is honoured like a real worker would: max_tokens,
EOS (unless ignore_eos), stop_token_ids, stop strings (via incremental detokenization with the
given tokenizer), abort, per-token delays, a simulated prefix cache (`Usage.cached_tokens`),
configurable failure with an ErrorCode, and overload. `expected(req)` gives the reference output
without running the async generator, for tests to compare against.

Protocol (duck-typed, implemented here and by cluster/cluster_backend.py):
    model_name: str; tokenizer; max_model_len: int
    generate(req) -> AsyncIterator[TokenChunk]   # consumer cancellation aborts the request
    async abort(request_id) -> None             # idempotent; unknown ids are a no-op
    overloaded() -> float | None                # None: accepting; else Retry-After seconds
    health() -> dict
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
from dataclasses import dataclass

from model.detokenizer import Detokenizer
from model.logprobs import TokenLogprobs
from worker_runtime.wire import ErrorCode, ErrorInfo, GenerateRequest, TokenChunk, Usage, page_hashes


@dataclass(frozen=True)
class StubConfig:
    model_name: str = "stub"
    max_model_len: int = 4096
    first_token_delay_s: float = 0.0
    token_delay_s: float = 0.0
    tokens_per_chunk: int = 1
    eos_prob: float = 0.0  # chance per position that the model "samples" EOS
    page_size: int = 256  # simulated prefix cache granularity
    fail_with: ErrorCode | None = None  # every request fails with this code ...
    fail_after: int = 0  # ... after this many tokens
    overloaded_retry_after: float | None = None  # not None: overloaded() returns it
    abort_delay_s: float = 0.0  # abort() takes this long (a remote call to a worker does)
    script: tuple[int, ...] = ()  # non-empty: the tokens every request generates, then EOS


def _u64(*parts: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(b"".join(parts), digest_size=8).digest(), "little")


def prompt_key(prompt_ids) -> bytes:
    return hashlib.blake2b(struct.pack(f"<{len(prompt_ids)}i", *prompt_ids), digest_size=16).digest()


def stub_token(key: bytes, seed: int, position: int, pool: tuple[int, ...], eos_id: int | None,
               eos_prob: float) -> int:
    """The token at `position` (0 = first generated) for a prompt with `prompt_key` `key`."""
    h = _u64(key, struct.pack("<qq", seed & ((1 << 63) - 1), position))
    if eos_id is not None and eos_prob > 0 and (h >> 11) / (1 << 53) < eos_prob:
        return eos_id
    return pool[h % len(pool)]


class _Run:
    """The deterministic token/text sequence of one request, one token per `step()`."""

    def __init__(self, req: GenerateRequest, tokenizer, cfg: StubConfig, pool: tuple[int, ...]):
        self.req, self.cfg, self.pool = req, cfg, pool
        self.key = prompt_key(req.prompt_ids)
        self.seed = req.sampling.seed if req.sampling.temperature > 0 else 0
        self.eos = tokenizer.eos_id
        self.detok = Detokenizer(tokenizer, req.stop_strings)
        self.n = 0

    def step(self) -> tuple[int, str, str | None]:
        if self.cfg.script:
            tok = self.cfg.script[self.n] if self.n < len(self.cfg.script) else self.eos
        else:
            tok = stub_token(self.key, self.seed, self.n, self.pool, self.eos, self.cfg.eos_prob)
        self.n += 1
        if (tok == self.eos and not self.req.ignore_eos) or tok in self.req.stop_token_ids:
            return tok, self.detok.flush(), "stop"
        text = self.detok.push(tok)
        if self.detok.stopped:
            return tok, text, "stop"
        if self.n >= self.req.max_tokens:
            return tok, text + self.detok.flush(), "length"
        return tok, text, None


class StubBackend:
    def __init__(self, tokenizer, config: StubConfig = StubConfig(), token_pool: tuple[int, ...] | None = None):
        self.tokenizer = tokenizer
        self.config = config  # replace it (dataclasses.replace) to change behaviour between requests
        self.model_name = config.model_name
        self.max_model_len = config.max_model_len
        self.token_pool = token_pool or tuple(tokenizer.encode("abcdefghijklmnopqrstuvwxyz "))
        self.started: list[str] = []
        self.finished: list[str] = []
        self.aborted: list[str] = []  # every abort() call, in order
        self.cancelled: list[str] = []  # generators torn down before their last chunk
        self.active: set[str] = set()
        self._abort_flags: set[str] = set()
        self._cached_pages: set[int] = set()

    # --- reference output
    def expected(self, req: GenerateRequest) -> tuple[list[int], str, str]:
        """(token_ids, text, finish_reason) that `generate(req)` streams, without delays or failures."""
        run, ids, text = _Run(req, self.tokenizer, self.config, self.token_pool), [], []
        while True:
            tok, delta, finish = run.step()
            ids.append(tok)
            text.append(delta)
            if finish:
                return ids, "".join(text), finish

    def _cached_tokens(self, prompt_ids) -> int:
        """Simulated prefix cache: chained full pages seen in earlier prompts."""
        hashes = page_hashes(prompt_ids, self.config.page_size)
        hit = next((i for i, h in enumerate(hashes) if h not in self._cached_pages), len(hashes))
        self._cached_pages.update(hashes)
        return min(hit * self.config.page_size, max(len(prompt_ids) - 1, 0))

    # --- Backend protocol
    async def generate(self, req: GenerateRequest):
        cfg, rid = self.config, req.request_id
        self.started.append(rid)
        self.active.add(rid)
        done = False
        try:
            cached = self._cached_tokens(req.prompt_ids)
            run = _Run(req, self.tokenizer, cfg, self.token_pool)
            await asyncio.sleep(cfg.first_token_delay_s)
            ids, text, finish = [], [], None
            while finish is None:
                if rid in self._abort_flags:
                    done = True
                    yield TokenChunk(rid, (), error=ErrorInfo(ErrorCode.CANCELLED, "aborted"))
                    return
                if cfg.fail_with is not None and run.n >= cfg.fail_after:
                    done = True
                    yield TokenChunk(rid, (), error=ErrorInfo(cfg.fail_with, f"stub failure: {cfg.fail_with.name}"))
                    return
                tok, delta, finish = run.step()
                ids.append(tok)
                text.append(delta)
                if finish is not None or len(ids) >= cfg.tokens_per_chunk:
                    usage = Usage(len(req.prompt_ids), run.n, cached) if finish else None
                    if finish:
                        done = True
                    yield TokenChunk(rid, tuple(ids), "".join(text), finish, usage,
                                     logprobs=self._logprobs(req, ids))
                    ids, text = [], []
                if finish is None:
                    await asyncio.sleep(cfg.token_delay_s)
            self.finished.append(rid)
        finally:
            if not done:
                self.cancelled.append(rid)
            self.active.discard(rid)
            self._abort_flags.discard(rid)

    def _logprobs(self, req: GenerateRequest, ids: list[int]):
        """Fixed stand-in values when the request asks: the token first at -0.5, pool tokens after."""
        if req.logprobs is None:
            return None
        return tuple(TokenLogprobs(t, -0.5, tuple((c, -0.5 - i) for i, c in enumerate(
            ([t] + [p for p in self.token_pool if p != t])[:req.logprobs]))) for t in ids)

    async def abort(self, request_id: str) -> None:
        await asyncio.sleep(self.config.abort_delay_s)
        self.aborted.append(request_id)
        if request_id in self.active:
            self._abort_flags.add(request_id)

    def overloaded(self) -> float | None:
        return self.config.overloaded_retry_after

    def health(self) -> dict:
        return {"ok": True, "prefill": 1, "decode": 1, "active": len(self.active)}
