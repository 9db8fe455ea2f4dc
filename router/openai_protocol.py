"""OpenAI request bodies → `GenerateRequest`: every field checked for type and range.

Parsing runs in two steps so that tokenization (CPU work, run off the event loop for long
prompts) sits between them:

    draft = parse_completion(body, limits)  |  parse_chat(body, limits)   # types, ranges, prompt text
    ids   = draft.prompt_ids or tokenizer.encode(draft.prompt_text)
    req   = finalize(draft, ids, limits, now)                            # lengths, defaults, deadline

Fields that would change the output but are not implemented (penalties, logprobs, n > 1, tools,
…) are refused with a 400 rather than silently ignored; harmless bookkeeping fields (`user`,
`metadata`, …) are ignored.
"""

from __future__ import annotations

import asyncio
import math
import secrets
from dataclasses import dataclass

from model.sampling import SamplingParams
from router.chat_encoding import ChatFormatError, encode_messages, parse_messages
from router.errors import APIError, invalid
from worker_runtime.wire import ErrorCode, GenerateRequest

_MISSING = object()
_MAX_SEED = 1 << 64
_MAX_TOP_K = 1 << 31
THREAD_TOKENIZE_CHARS = 4096  # longer prompts are tokenized off the event loop


@dataclass(frozen=True)
class Limits:
    """What a request is checked against (from RouterConfig and the backend, built once)."""

    model_name: str
    vocab_size: int
    max_model_len: int
    max_prompt_tokens: int
    max_tokens_limit: int
    default_max_tokens: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_stop_token_ids: int
    default_temperature: float
    default_seed: int | None
    timeout_s: float | None

    @classmethod
    def build(cls, config, backend) -> "Limits":
        max_len = int(backend.max_model_len)
        return cls(model_name=config.model_name or backend.model_name,
                   vocab_size=int(backend.tokenizer.vocab_size), max_model_len=max_len,
                   max_prompt_tokens=min(config.max_prompt_tokens or max_len, max_len),
                   max_tokens_limit=config.max_tokens_limit, default_max_tokens=config.default_max_tokens,
                   max_stop_strings=config.max_stop_strings, max_stop_string_chars=config.max_stop_string_chars,
                   max_stop_token_ids=config.max_stop_token_ids, default_temperature=config.default_temperature,
                   default_seed=config.default_seed, timeout_s=config.request_timeout_s)


@dataclass(frozen=True)
class ResponseOptions:
    chat: bool
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    thinking: bool = False  # chat in thinking mode: split the output at </think>


@dataclass(frozen=True)
class Draft:
    """A checked request whose prompt is not tokenized yet (exactly one of text / ids)."""

    options: ResponseOptions
    prompt_text: str | None
    prompt_ids: tuple[int, ...] | None
    max_tokens: int | None
    sampling: SamplingParams
    stop_strings: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool


@dataclass(frozen=True)
class ParsedRequest:
    generate: GenerateRequest
    options: ResponseOptions


# --------------------------------------------------------------------------- field helpers

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A JSON number: an int of any size (compared exactly, never converted: a 400-digit one
    overflows a float), or a finite float."""
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _get(body: dict, name: str, check, what: str, default=None):
    """body[name] if present and not null, after `check(value)`; else `default`."""
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not check(v):
        raise invalid(f"'{name}' must be {what}", name)
    return v


def _refuse_unsupported(body: dict) -> None:
    """Fields that would change the output: accepted only at their neutral value."""
    neutral = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False, 0),
               "top_logprobs": (0,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
               "logit_bias": ({},), "suffix": ("",), "tools": ([],), "functions": ([],),
               "tool_choice": ("none",)}
    for name, ok in neutral.items():
        v = body.get(name)
        if v is not None and not any(v == o and type(v) is type(o) for o in ok):
            what = "n=1 only" if name in ("n", "best_of") else "not supported"
            raise invalid(f"'{name}' is {what} by this server", name)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise invalid("'response_format' other than text is not supported", "response_format")


def _stop_strings(body: dict, limits: Limits) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise invalid("'stop' must be a non-empty string or an array of non-empty strings", "stop")
    if len(stop) > limits.max_stop_strings:
        raise invalid(f"'stop' may hold at most {limits.max_stop_strings} strings", "stop")
    if any(len(s) > limits.max_stop_string_chars for s in stop):
        raise invalid(f"each 'stop' string may be at most {limits.max_stop_string_chars} characters", "stop")
    return tuple(stop)


def check_token_ids(ids, limits: Limits, param: str) -> tuple[int, ...]:
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise invalid(f"'{param}' must be an array of integers", param)
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise invalid(f"token id {bad} in '{param}' is out of range [0, {limits.vocab_size})", param)
    return tuple(ids)


def _common(body: dict, limits: Limits, chat: bool, thinking: bool) -> dict:
    """Fields shared by completions and chat, checked; returns Draft keyword arguments."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = _get(body, "model", lambda v: isinstance(v, str), "a string")
    if model is not None and model != limits.model_name:
        raise APIError(ErrorCode.MODEL_NOT_FOUND, f"model '{model}' does not exist; this server serves "
                       f"'{limits.model_name}'", "model", openai_code="model_not_found")
    _refuse_unsupported(body)
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    stream_options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if stream_options is not None and not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = _get(stream_options or {}, "include_usage", lambda v: isinstance(v, bool), "a boolean", False)
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    max_tokens = None
    for name in names:
        max_tokens = _get(body, name, _is_int, "an integer", max_tokens)
        if max_tokens is not None and max_tokens < 1:
            raise invalid(f"'{name}' must be at least 1", name)
        if max_tokens is not None and max_tokens > limits.max_tokens_limit:
            raise invalid(f"'{name}' must be at most {limits.max_tokens_limit}", name)
    temperature = _get(body, "temperature", lambda v: _is_number(v) and 0 <= v <= 2, "a number in [0, 2]",
                       limits.default_temperature)
    top_p = _get(body, "top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)
    top_k = _get(body, "top_k", lambda v: _is_int(v) and -1 <= v < _MAX_TOP_K,
                 f"an integer in [-1, {_MAX_TOP_K}) (-1 or 0: off)", 0)
    seed = _get(body, "seed", lambda v: _is_int(v) and abs(v) < _MAX_SEED, "a 64-bit integer")
    if seed is None:
        seed = limits.default_seed if limits.default_seed is not None else secrets.randbits(63)
    stop_ids = _get(body, "stop_token_ids", lambda v: True, "", [])
    if isinstance(stop_ids, list) and len(stop_ids) > limits.max_stop_token_ids:
        raise invalid(f"'stop_token_ids' may hold at most {limits.max_stop_token_ids} ids", "stop_token_ids")
    return dict(
        options=ResponseOptions(
            chat=chat, stream=stream, include_usage=include_usage, thinking=thinking,
            return_token_ids=_get(body, "return_token_ids", lambda v: isinstance(v, bool), "a boolean", False)),
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=max(top_k, 0), seed=seed),
        stop_strings=_stop_strings(body, limits),
        stop_token_ids=check_token_ids(stop_ids, limits, "stop_token_ids"),
        ignore_eos=_get(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False))


# --------------------------------------------------------------------------- endpoints

def parse_completion(body, limits: Limits) -> Draft:
    """/v1/completions: `prompt` is a string, an array of token ids, or a one-element batch of either."""
    common = _common(body, limits, chat=False, thinking=False)
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("'prompt' is required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("'prompt' must not be empty", "prompt")
        return Draft(prompt_text=prompt, prompt_ids=None, **common)
    if isinstance(prompt, list):
        if not prompt:
            raise invalid("'prompt' must not be empty", "prompt")
        if any(isinstance(p, (str, list)) for p in prompt):
            raise invalid("batched prompts are not supported; send one prompt per request", "prompt")
        if len(prompt) > limits.max_prompt_tokens:  # before checking each id of a huge one
            raise invalid(f"the prompt has {len(prompt)} tokens; the limit is {limits.max_prompt_tokens}",
                          "prompt", openai_code="context_length_exceeded")
        return Draft(prompt_text=None, prompt_ids=check_token_ids(prompt, limits, "prompt"), **common)
    raise invalid("'prompt' must be a string or an array of token ids", "prompt")


def parse_chat(body, limits: Limits) -> Draft:
    """/v1/chat/completions with DeepSeek-V4 extras `thinking_mode` and `reasoning_effort`."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    mode = _get(body, "thinking_mode", lambda v: v in ("chat", "thinking"), "'chat' or 'thinking'", "chat")
    effort = _get(body, "reasoning_effort", lambda v: v in ("high", "max"), "'high' or 'max'")
    common = _common(body, limits, chat=True, thinking=mode == "thinking")
    if "messages" not in body:
        raise invalid("'messages' is required", "messages")
    try:
        text = encode_messages(parse_messages(body["messages"]), mode, effort)
    except ChatFormatError as e:
        raise invalid(str(e), e.param) from None
    return Draft(prompt_text=text, prompt_ids=None, **common)


async def tokenize(tokenizer, text: str) -> tuple[int, ...]:
    """`tokenizer.encode(text)`, in a thread for a long text so the event loop keeps serving."""
    try:
        if len(text) > THREAD_TOKENIZE_CHARS:
            return tuple(await asyncio.to_thread(tokenizer.encode, text))
        return tuple(tokenizer.encode(text))
    except UnicodeEncodeError:
        raise invalid("the prompt contains invalid Unicode (an unpaired surrogate)", "prompt") from None


def finalize(draft: Draft, prompt_ids: tuple[int, ...], limits: Limits, now: float,
             request_id: str | None = None) -> ParsedRequest:
    """Length checks and defaults; `now` is unix seconds (the deadline is absolute)."""
    n = len(prompt_ids)
    if n == 0:
        raise invalid("the prompt encodes to no tokens", "prompt")
    if n > limits.max_prompt_tokens:
        raise invalid(f"the prompt has {n} tokens; the limit is {limits.max_prompt_tokens}",
                      "messages" if draft.options.chat else "prompt", openai_code="context_length_exceeded")
    room = limits.max_model_len - n
    max_tokens = draft.max_tokens if draft.max_tokens is not None else min(limits.default_max_tokens, room)
    if max_tokens > room or room <= 0:
        raise invalid(f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                      f"length {limits.max_model_len}", "max_tokens", openai_code="context_length_exceeded")
    if request_id is None:
        request_id = ("chatcmpl-" if draft.options.chat else "cmpl-") + secrets.token_hex(12)
    deadline = now + limits.timeout_s if limits.timeout_s is not None else None
    req = GenerateRequest(request_id=request_id, prompt_ids=tuple(prompt_ids), max_tokens=max_tokens,
                          sampling=draft.sampling, stop_token_ids=draft.stop_token_ids,
                          stop_strings=draft.stop_strings, ignore_eos=draft.ignore_eos, deadline=deadline)
    return ParsedRequest(req, draft.options)
