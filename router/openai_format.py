"""OpenAI response shapes: whole responses and SSE stream chunks, built from `TokenChunk`s.

Pure functions over plain dicts; the HTTP server only serializes them. The `token_ids` extension
(`"return_token_ids": true`) adds the new token ids to every choice and every streamed chunk.
`echo` (completions) puts the prompt's text before the completion's (in the first streamed chunk)
and, with `logprobs`, the prompt tokens' logprobs before the generated ones'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from router.chat_encoding import ReasoningSplitter
from router.choices import merge_usage
from router.logprobs_format import chat_entries, completion_logprobs, joined, prompt_logprobs
from router.openai_protocol import ResponseOptions
from router.tool_calls import ToolCallParser
from worker_runtime.wire import Usage


def usage_dict(usage: Usage) -> dict:
    """OpenAI's usage object; with `spec` (as `v4serve generate`'s last line) when the request's
    decode steps speculated: the drafts verified and the ones accepted."""
    out = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
           "total_tokens": usage.prompt_tokens + usage.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}
    if usage.spec_proposed:
        out["spec"] = {"proposed": usage.spec_proposed, "accepted": usage.spec_accepted}
    return out


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def stop_string_matched(tokenizer, token_ids, released: str, stops: tuple[str, ...]) -> str:
    """The stop string that ended a completion whose released text is `released`, or "".

    The worker releases exactly the text before the stop string (the first position where one
    completes, cut out with everything after it), so the stop string is where the completion's
    full text goes on past `released`: the shortest stop string found there (it completed first).
    """
    if not stops:
        return ""
    full = tokenizer.decode(list(token_ids))
    if not full.startswith(released):
        return ""
    rest = full[len(released):]
    return min((s for s in stops if rest.startswith(s)), key=len, default="")


@dataclass
class ResponseBuilder:
    """Accumulates one request's output and renders it in the OpenAI shape it asked for.

    A text delta goes: (+ the stop string at the end, `include_stop_str_in_output`) → reasoning
    split at `</think>` (thinking mode) → DSML tool calls parsed out of the content (tools on)."""

    request_id: str
    model: str
    created: int
    options: ResponseOptions
    tokenizer: object = None  # for include_stop_str_in_output
    index: int = 0  # the choice's index (n > 1, batches)
    prompt_tokens: int = 0  # for the usage on every chunk (stream_options.continuous_usage_stats)
    prompt_ids: tuple[int, ...] = ()  # the choice's prompt (echo)
    splitter: ReasoningSplitter | None = None
    tools: ToolCallParser | None = None
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)  # the worker's text (include_stop_str_in_output only)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprobs of every token so far (logprobs asked)
    prompt_lps: tuple | None = None  # TokenLogprobs of prompt tokens 1.. (echo with logprobs)
    _lp_chars: int = 0  # characters of the token pieces so far (completions' text_offset)
    _sent_role: bool = False
    _echoed: bool = False  # the prompt went out (streaming echo)

    def __post_init__(self):
        if self.options.thinking:
            self.splitter = ReasoningSplitter()
        if self.options.tool_calls:
            self.tools = ToolCallParser()

    @property
    def _object(self) -> str:
        if self.options.chat:
            return "chat.completion.chunk" if self.options.stream else "chat.completion"
        return "text_completion"

    def _process(self, token_ids, text: str, finish_reason: str | None) -> tuple[str, str, list]:
        """(reasoning, content, tool call deltas) of a text delta."""
        self.token_ids.extend(token_ids)
        if self.options.include_stop_str:
            self.released.append(text)
        if finish_reason == "stop" and self.options.include_stop_str:
            text += stop_string_matched(self.tokenizer, self.token_ids, "".join(self.released),
                                        self.options.stop_strings)
        final = finish_reason is not None
        r, c = "", text
        if self.splitter is not None:
            r, c = self.splitter.feed(text)
            if final:
                r2, c2 = self.splitter.flush()
                r, c = r + r2, c + c2
        calls = []
        if self.tools is not None:
            c, calls = self.tools.feed(c)
            if final:
                c2, calls2 = self.tools.flush()
                c, calls = c + c2, calls + calls2
        return r, c, calls

    def _logprobs(self, lps) -> dict | None:
        """The `logprobs` object of these tokens' TokenLogprobs (None unless the request asked)."""
        if self.options.logprobs is None:
            return None
        lps = list(lps or ())
        if self.options.chat:
            return {"content": chat_entries(self.tokenizer, lps)}
        out = completion_logprobs(self.tokenizer, lps, self._lp_chars)
        self._lp_chars += sum(len(t) for t in out["tokens"])
        return out

    def _echo(self, text: str, lps) -> tuple[str, dict | None]:
        """The text and logprobs object of output `text` (its tokens' TokenLogprobs `lps`) with the
        prompt before it (echo); the offsets count from the prompt's start."""
        logprobs = None
        if self.options.logprobs is not None:
            head = prompt_logprobs(self.tokenizer, self.prompt_ids, self.prompt_lps, 0)
            self._lp_chars = sum(len(t) for t in head["tokens"])
            logprobs = joined(head, self._logprobs(lps))
        return self.tokenizer.decode(list(self.prompt_ids)) + text, logprobs

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self.tools is not None and self.tools.calls else reason

    # --- non-streaming
    def add(self, token_ids, text: str, finish_reason: str | None = None, logprobs=None, prompt_logprobs=None) -> None:
        if prompt_logprobs is not None:
            self.prompt_lps = prompt_logprobs
        r, c, _ = self._process(token_ids, text, finish_reason)
        self.logprobs.extend(logprobs or ())
        self.reasoning.append(r)
        self.text.append(c)

    def response(self, finish_reason: str, usage: Usage) -> dict:
        return {"id": self.request_id, "object": self._object, "created": self.created, "model": self.model,
                "choices": [self.choice(finish_reason)], "usage": usage_dict(usage)}

    def choice(self, finish_reason: str) -> dict:
        """The whole response's choice of this builder."""
        content = "".join(self.text)
        if self.options.chat:
            message = {"role": "assistant", "content": content}
            if self.options.thinking:
                message["reasoning_content"] = "".join(self.reasoning)
            if self.tools is not None and self.tools.calls:
                message["content"] = content or None
                message["tool_calls"] = [{"id": c["id"], "type": "function",
                                          "function": {"name": c["name"], "arguments": c["arguments"]}}
                                         for c in self.tools.calls]
            choice = {"index": self.index, "message": message, "logprobs": self._logprobs(self.logprobs),
                      "finish_reason": self.finish_reason(finish_reason)}
        elif self.options.echo:
            text, logprobs = self._echo(content, self.logprobs)
            choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": self.index, "text": content, "logprobs": self._logprobs(self.logprobs),
                      "finish_reason": finish_reason}
        if self.options.return_token_ids:
            choice["token_ids"] = list(self.token_ids)
        return choice

    # --- streaming
    def chunk(self, token_ids, text: str, finish_reason: str | None, logprobs=None, prompt_logprobs=None) -> dict:
        if prompt_logprobs is not None:
            self.prompt_lps = prompt_logprobs
        r, c, calls = self._process(token_ids, text, finish_reason)
        if finish_reason is not None:
            finish_reason = self.finish_reason(finish_reason)
        if self.options.chat:
            delta: dict = {}
            if not self._sent_role:
                delta["role"], self._sent_role = "assistant", True
            if c or not (r or calls):
                delta["content"] = c
            if r:
                delta["reasoning_content"] = r
            if calls:
                delta["tool_calls"] = [d.openai() for d in calls]
            choice = {"index": self.index, "delta": delta, "logprobs": self._logprobs(logprobs),
                      "finish_reason": finish_reason}
        elif self.options.echo and not self._echoed:  # the prompt goes out before the first new text
            self._echoed = True
            text, lps = self._echo(c, logprobs)
            choice = {"index": self.index, "text": text, "logprobs": lps, "finish_reason": finish_reason}
        else:
            choice = {"index": self.index, "text": c, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
        if self.options.return_token_ids:
            choice["token_ids"] = list(token_ids)
        out = {"id": self.request_id, "object": self._object, "created": self.created, "model": self.model,
               "choices": [choice]}
        if self.options.continuous_usage:  # as vLLM: this choice's tokens so far
            n = len(self.token_ids)
            out["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                            "total_tokens": self.prompt_tokens + n}
        elif self.options.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        """The extra last chunk of `stream_options.include_usage`: no choices, the usage."""
        return {"id": self.request_id, "object": self._object, "created": self.created, "model": self.model,
                "choices": [], "usage": usage_dict(usage)}


def group_response(builders: list[ResponseBuilder], outcomes, n: int) -> dict:
    """The whole response of a request of several choices (builders and outcomes in choice order;
    `n` choices per prompt): every choice, and the usage with each prompt counted once."""
    out = builders[0].response(outcomes[0].finish_reason, merge_usage([o.usage for o in outcomes], n))
    out["choices"] = [b.choice(o.finish_reason) for b, o in zip(builders, outcomes)]
    return out


def stream_error(err) -> dict:
    """An error inside an already-started SSE stream (status 200 was sent): OpenAI's error shape."""
    return err.body()
