"""OpenAI response shapes: whole responses and SSE stream chunks, built from `TokenChunk`s.

Pure functions over plain dicts; the HTTP server only serializes them. The `token_ids` extension
(`"return_token_ids": true`) adds the new token ids to every choice and every streamed chunk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from router.chat_encoding import ReasoningSplitter
from router.openai_protocol import ResponseOptions
from worker_runtime.wire import Usage


def usage_dict(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class ResponseBuilder:
    """Accumulates one request's output and renders it in the OpenAI shape it asked for."""

    request_id: str
    model: str
    created: int
    options: ResponseOptions
    splitter: ReasoningSplitter | None = None
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    _sent_role: bool = False

    def __post_init__(self):
        if self.options.thinking:
            self.splitter = ReasoningSplitter()

    @property
    def _object(self) -> str:
        if self.options.chat:
            return "chat.completion.chunk" if self.options.stream else "chat.completion"
        return "text_completion"

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of a text delta."""
        if self.splitter is None:
            return "", text
        r, c = self.splitter.feed(text)
        if final:
            r2, c2 = self.splitter.flush()
            r, c = r + r2, c + c2
        return r, c

    # --- non-streaming
    def add(self, token_ids, text: str, final: bool = False) -> None:
        r, c = self._split(text, final)
        self.reasoning.append(r)
        self.text.append(c)
        self.token_ids.extend(token_ids)

    def response(self, finish_reason: str, usage: Usage) -> dict:
        content = "".join(self.text)
        if self.options.chat:
            message = {"role": "assistant", "content": content}
            if self.options.thinking:
                message["reasoning_content"] = "".join(self.reasoning)
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}
        if self.options.return_token_ids:
            choice["token_ids"] = list(self.token_ids)
        return {"id": self.request_id, "object": self._object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage_dict(usage)}

    # --- streaming
    def chunk(self, token_ids, text: str, finish_reason: str | None) -> dict:
        r, c = self._split(text, finish_reason is not None)
        if self.options.chat:
            delta: dict = {}
            if not self._sent_role:
                delta["role"], self._sent_role = "assistant", True
            if c or not r:
                delta["content"] = c
            if r:
                delta["reasoning_content"] = r
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": c, "logprobs": None, "finish_reason": finish_reason}
        if self.options.return_token_ids:
            choice["token_ids"] = list(token_ids)
        out = {"id": self.request_id, "object": self._object, "created": self.created, "model": self.model,
               "choices": [choice]}
        if self.options.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        """The extra last chunk of `stream_options.include_usage`: no choices, the usage."""
        return {"id": self.request_id, "object": self._object, "created": self.created, "model": self.model,
                "choices": [], "usage": usage_dict(usage)}


def stream_error(err) -> dict:
    """An error inside an already-started SSE stream (status 200 was sent): OpenAI's error shape."""
    return err.body()
