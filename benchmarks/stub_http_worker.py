"""A minimal OpenAI-compatible stub worker over raw asyncio (benchmarks only).

Cheap on purpose, so that the routers in front of it — not the worker — are what a benchmark
measures. HTTP/1.1 keep-alive, Content-Length or chunked bodies. Routes:
    POST /v1/completions, /generate    a deterministic completion of `max_tokens` letters
    GET  /health, /health_generate, /v1/models, /get_model_info, /get_server_info, /server_info
`--delay-ms` adds a fixed service time per completion. Embedded in another program
(placement_bench.py), an `on_request(body) -> (cached_tokens, delay_s)` hook simulates a prefix
cache and a prefill queue.

    python benchmarks/stub_http_worker.py --port 9001 [--delay-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json

_OK_JSON = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
_INFO = {"model_path": "stub", "tokenizer_path": None, "is_generation": True, "model": "stub",
         "max_model_len": 1 << 20}


def completion(body: dict, cached_tokens: int = 0) -> dict:
    """The stub's answer: max_tokens lowercase letters, a pure function of the prompt."""
    prompt = body.get("prompt", body.get("text", body.get("input_ids", "")))
    n = int(body.get("max_tokens") or body.get("sampling_params", {}).get("max_new_tokens", 16))
    digest = hashlib.blake2b(json.dumps(prompt).encode(), digest_size=32).digest()
    ids = [97 + digest[i % 32] % 26 for i in range(n)]
    plen = len(prompt) if isinstance(prompt, (str, list)) else 0
    return {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
            "text": bytes(ids).decode(),
            "choices": [{"index": 0, "text": bytes(ids).decode(), "token_ids": ids, "logprobs": None,
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": plen, "completion_tokens": n, "total_tokens": plen + n,
                      "prompt_tokens_details": {"cached_tokens": cached_tokens}}}


def _parse_chunked(buf: bytearray, start: int):
    """(body, end offset) of a complete chunked body starting at `start`, or None if incomplete."""
    body, i = bytearray(), start
    while True:
        eol = buf.find(b"\r\n", i)
        if eol < 0:
            return None
        size = int(bytes(buf[i:eol]).split(b";")[0], 16)
        if len(buf) < eol + 2 + size + 2:
            return None
        body += buf[eol + 2:eol + 2 + size]
        i = eol + 2 + size + 2
        if size == 0:
            return bytes(body), i


class WorkerProtocol(asyncio.Protocol):
    def __init__(self, delay_s: float, on_request=None):
        self.delay_s, self.on_request, self.buf, self.transport = delay_s, on_request, bytearray(), None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            request_line = lines[0].split(" ")
            if len(request_line) != 3 or not request_line[2].startswith("HTTP/1"):
                self.transport.close()  # e.g. an HTTP/2 prior-knowledge probe: HTTP/1.1 only here
                return
            method, path = request_line[:2]
            headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
            if "chunked" in headers.get("transfer-encoding", ""):
                parsed = _parse_chunked(self.buf, end + 4)
                if parsed is None:
                    return
                body, stop = parsed
            else:
                stop = end + 4 + int(headers.get("content-length", 0))
                if len(self.buf) < stop:
                    return
                body = bytes(self.buf[end + 4:stop])
            del self.buf[:stop]
            self._respond(method, path.split("?")[0], body)

    def _respond(self, method: str, path: str, body: bytes):
        if method == "POST" and path in ("/v1/completions", "/generate", "/v1/chat/completions"):
            req = json.loads(body or b"{}")
            cached, delay = self.on_request(req) if self.on_request else (0, self.delay_s)
            out = json.dumps(completion(req, cached)).encode()
            resp = _OK_JSON % (len(out), out)
            if delay > 0:
                asyncio.get_running_loop().call_later(delay, self._write, resp)
                return
        elif path == "/v1/models":
            out = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]}).encode()
            resp = _OK_JSON % (len(out), out)
        else:  # health and info probes of the various routers
            out = json.dumps(_INFO).encode()
            resp = _OK_JSON % (len(out), out)
        self._write(resp)

    def _write(self, data: bytes):
        if not self.transport.is_closing():
            self.transport.write(data)


async def start_worker(host: str, port: int, delay_s: float = 0.0, on_request=None):
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: WorkerProtocol(delay_s, on_request), host, port, backlog=4096)


async def run_worker(host: str, port: int, delay_s: float):
    server = await start_worker(host, port, delay_s)
    async with server:
        await server.serve_forever()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    args = ap.parse_args()
    asyncio.run(run_worker(args.host, args.port, args.delay_ms / 1000))


if __name__ == "__main__":
    main()
