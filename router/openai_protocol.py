"""OpenAI request bodies → `GenerateRequest`: every field checked for type and range.

Parsing runs in two steps so that tokenization (CPU work, run off the event loop for long
prompts) sits between them:

    draft  = parse_completion(body, limits)  |  parse_chat(body, limits)  # types, ranges, prompts
    ids    = await prompt_ids(draft, tokenizer)                          # one id tuple per prompt
    parsed = finalize(draft, ids, limits, now)                           # lengths, defaults, deadline

A request becomes one `GenerateRequest` per choice (`router/choices.py`): `n` per prompt, and a
`/v1/completions` batch holds several prompts.

The bodies are validated by the typed models of `request_models.py` (unknown fields refused);
fields that would change the output but are not implemented (priority, suffix, …) are
refused with a 400 naming them unless at their neutral value, never silently ignored;
bookkeeping fields (`user`, `metadata`, …) are accepted and have no effect on the output.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

from pydantic import ValidationError

from model.grammar import CheckedGrammars
from model.sampling import SamplingParams
from router.chat_encoding import THINK_END, ChatFormatError, encode_messages, from_request
from router.chat_options import chat_mode, tools_offered
from router.choices import Child, plan_children
from router.errors import APIError, invalid
from router.generation_defaults import GenerationDefaults
from router.request_models import ChatCompletionRequest, CompletionRequest, first_error
from router.response_format import chat_grammar, response_grammar
from worker_runtime.wire import ErrorCode, GenerateRequest

THREAD_TOKENIZE_CHARS = 4096  # longer prompts are tokenized off the event loop


@dataclass(frozen=True)
class Limits:
    """What a request is checked against (from RouterConfig and the backend, built once)."""

    model_names: tuple[str, ...]  # the first is reported in responses; any is accepted in `model`
    vocab_size: int
    max_model_len: int
    max_prompt_tokens: int
    max_tokens_limit: int
    default_max_tokens: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_stop_token_ids: int
    defaults: GenerationDefaults
    default_seed: int | None
    timeout_s: float | None
    max_n: int = 16
    max_batch_prompts: int = 32
    max_children: int = 4096  # the router's max_concurrent_requests: a request's choices all run at once
    think_end_id: int | None = None  # the token id of '</think>' (a grammar in thinking mode starts after it)
    # grammars checked so far, by text (router/response_format.py): each distinct one is checked once
    grammar_checks: CheckedGrammars = field(default_factory=CheckedGrammars, compare=False)

    @classmethod
    def build(cls, config, backend) -> Limits:
        max_len = int(backend.max_model_len)
        names = tuple(dict.fromkeys((config.model_name or backend.model_name,) + tuple(config.model_aliases)))
        return cls(model_names=names,
                   vocab_size=int(backend.tokenizer.vocab_size), max_model_len=max_len,
                   max_prompt_tokens=min(config.max_prompt_tokens or max_len, max_len),
                   max_tokens_limit=config.max_tokens_limit, default_max_tokens=config.default_max_tokens,
                   max_stop_strings=config.max_stop_strings, max_stop_string_chars=config.max_stop_string_chars,
                   max_stop_token_ids=config.max_stop_token_ids, defaults=config.generation_defaults,
                   default_seed=config.default_seed, timeout_s=config.request_timeout_s, max_n=config.max_n,
                   max_batch_prompts=config.max_batch_prompts, max_children=config.max_concurrent_requests,
                   think_end_id=_single_token(backend.tokenizer, THINK_END))

    @property
    def model_name(self) -> str:
        return self.model_names[0]


@dataclass(frozen=True)
class ResponseOptions:
    chat: bool
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: the usage so far on every chunk
    return_token_ids: bool = False
    thinking: bool = False  # chat in thinking mode: split the output at </think>
    tool_calls: bool = False  # chat with tools offered: parse DSML tool calls out of the content
    include_stop_str: bool = False  # append the stop string that ended the completion
    stop_strings: tuple[str, ...] = ()
    logprobs: int | None = None  # top alternatives per token's logprobs; None: no logprobs
    echo: bool = False  # completions: the prompt (and its tokens' logprobs) before the output


Prompt = str | tuple[int, ...]  # text to tokenize, or token ids as given


@dataclass(frozen=True)
class Draft:
    """A checked request whose prompts are not tokenized yet (each text or ids)."""

    options: ResponseOptions
    prompts: tuple[Prompt, ...]  # one, or a /v1/completions batch
    n: int  # choices per prompt
    max_tokens: int | None
    sampling: SamplingParams
    stop_strings: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None = None
    grammar: str | None = None  # what the output must match (router/response_format.py)


@dataclass(frozen=True)
class ParsedRequest:
    request_id: str  # the client's id of the whole request (its response's `id`, what Abort names)
    children: tuple[Child, ...]  # one per choice, in choice order
    n: int  # choices per prompt
    options: ResponseOptions

    @property
    def generate(self) -> GenerateRequest:
        """The request of a single-choice request."""
        assert len(self.children) == 1, "a request with several choices has several GenerateRequests"
        return self.children[0].req


# --------------------------------------------------------------------------- checks

def _validate(model_cls, body):
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        message, param = first_error(e)
        raise invalid(message, param) from None


# Known fields this server does not implement: accepted only at their neutral value.
_NEUTRAL = {"priority": (0,), "suffix": ("",)}


def _single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text)
    return ids[0] if len(ids) == 1 else None


def _refuse_unsupported(req) -> None:
    for name in req.model_fields_set:
        ok = _NEUTRAL.get(name)
        v = getattr(req, name)
        if ok is None or v is None or any(v == o for o in ok):
            continue
        raise invalid(f"'{name}' is not supported by this server (only {ok[0]!r} is accepted)", name)


def _logprobs(req, chat: bool) -> int | None:
    """How many top alternatives each token's logprobs carry; None: no logprobs."""
    if not chat:
        return req.logprobs  # 0: the sampled token's alone
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def check_token_ids(ids, limits: Limits, param: str) -> tuple[int, ...]:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise invalid(f"'{param}' must be an array of integers", param)
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise invalid(f"token id {bad} in '{param}' is out of range [0, {limits.vocab_size})", param)
    return tuple(ids)


def _logit_bias(req, limits: Limits) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, bias) pairs; its keys are token ids written as strings (OpenAI)."""
    out = []
    for key, bias in (req.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= limits.vocab_size:
            raise invalid(f"'logit_bias' key {key!r} is not a token id in [0, {limits.vocab_size})", "logit_bias")
        out.append((int(key), float(bias)))
    if len({t for t, _ in out}) != len(out):
        raise invalid("'logit_bias' names a token twice", "logit_bias")
    return tuple(out)


def check_model(model: str | None, limits: Limits) -> None:
    if model is not None and model not in limits.model_names:
        raise APIError(ErrorCode.MODEL_NOT_FOUND, f"model '{model}' does not exist; this server serves "
                       f"{', '.join(repr(n) for n in limits.model_names)}", "model", openai_code="model_not_found")


def _stop_strings(req, limits: Limits) -> tuple[str, ...]:
    stop = req.stop
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not all(stop):
        raise invalid("'stop' must be a non-empty string or an array of non-empty strings", "stop")
    if len(stop) > limits.max_stop_strings:
        raise invalid(f"'stop' may hold at most {limits.max_stop_strings} strings", "stop")
    if any(len(s) > limits.max_stop_string_chars for s in stop):
        raise invalid(f"each 'stop' string may be at most {limits.max_stop_string_chars} characters", "stop")
    return tuple(stop)


def _choices(req, limits: Limits) -> int:
    """`n` (choices per prompt), bounded; `best_of` is accepted only where it changes nothing (1 or n)."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= limits.max_n:
        raise invalid(f"'n' must be an integer in [1, {limits.max_n}]", "n")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of not in (1, n):
        raise invalid("'best_of' is not supported by this server (only 1 or n, which return every choice)",
                      "best_of")
    return n


def _common(req, limits: Limits, chat: bool, thinking: bool = False, tool_calls: bool = False) -> dict:
    """Fields shared by completions and chat, checked; returns Draft keyword arguments."""
    check_model(req.model, limits)
    _refuse_unsupported(req)
    n = _choices(req, limits)
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        v = getattr(req, name)
        if v is None:
            continue
        if v < 1 and not (v == 0 and getattr(req, "echo", None)):  # 0 with echo: score the prompt only
            raise invalid(f"'{name}' must be at least 1 (0 only with 'echo')" if name == "max_tokens" and not chat
                          else f"'{name}' must be at least 1", name)
        if v > limits.max_tokens_limit:
            raise invalid(f"'{name}' must be at most {limits.max_tokens_limit}", name)
        max_tokens = v
    d = limits.defaults
    temperature = req.temperature if req.temperature is not None else d.temperature
    top_p = req.top_p if req.top_p is not None else d.top_p
    top_k = req.top_k if req.top_k is not None else d.top_k
    seed = req.seed
    if seed is None:
        seed = limits.default_seed if limits.default_seed is not None else secrets.randbits(63)
    stop_ids = req.stop_token_ids or []
    if len(stop_ids) > limits.max_stop_token_ids:
        raise invalid(f"'stop_token_ids' may hold at most {limits.max_stop_token_ids} ids", "stop_token_ids")
    stop_strings = _stop_strings(req, limits)
    logprobs = _logprobs(req, chat)
    return {
        "options": ResponseOptions(
            chat=chat, stream=stream, thinking=thinking, tool_calls=tool_calls,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            continuous_usage=bool(req.stream_options and req.stream_options.include_usage  # as vLLM: needs both
                                  and req.stream_options.continuous_usage_stats),
            return_token_ids=bool(req.return_token_ids),
            include_stop_str=bool(req.include_stop_str_in_output), stop_strings=stop_strings, logprobs=logprobs,
            echo=bool(getattr(req, "echo", None))),
        "n": n,
        "max_tokens": max_tokens,
        "sampling": SamplingParams(
            temperature=float(temperature), top_p=float(top_p), top_k=max(top_k, 0), seed=seed,
            presence_penalty=float(req.presence_penalty or 0), frequency_penalty=float(req.frequency_penalty or 0),
            repetition_penalty=float(req.repetition_penalty or 1), logit_bias=_logit_bias(req, limits),
            min_tokens=req.min_tokens or 0, min_p=float(req.min_p or 0)),
        "stop_strings": stop_strings,
        "stop_token_ids": check_token_ids(stop_ids, limits, "stop_token_ids"),
        "ignore_eos": bool(req.ignore_eos),
        "logprobs": logprobs}


# --------------------------------------------------------------------------- endpoints

def parse_completion(body, limits: Limits) -> Draft:
    """/v1/completions: `prompt` is a string, an array of token ids, or a batch of either (a list of
    strings or of id arrays: each prompt its own `n` choices, indexed prompt-major)."""
    req = _validate(CompletionRequest, body)
    common = _common(req, limits, chat=False)
    common["grammar"] = response_grammar(req.response_format, checked=limits.grammar_checks)
    prompt = req.prompt
    if not prompt:
        raise invalid("'prompt' must not be empty", "prompt")
    batch = isinstance(prompt, list) and isinstance(prompt[0], (str, list))
    prompts = list(prompt) if batch else [prompt]
    if len(prompts) > limits.max_batch_prompts:
        raise invalid(f"a batch may hold at most {limits.max_batch_prompts} prompts", "prompt")
    if len(prompts) * common["n"] > limits.max_children:
        raise invalid(f"n × prompts ({len(prompts) * common['n']}) exceeds this server's limit of "
                      f"{limits.max_children} concurrent generations", "n")
    out = []
    for i, p in enumerate(prompts):
        param = f"prompt[{i}]" if batch else "prompt"
        if not p:
            raise invalid(f"'{param}' must not be empty", param)
        if isinstance(p, str):
            out.append(p)
            continue
        if len(p) > limits.max_prompt_tokens:  # before checking each id of a huge one
            raise invalid(f"the prompt has {len(p)} tokens; the limit is {limits.max_prompt_tokens}",
                          param, openai_code="context_length_exceeded")
        out.append(check_token_ids(p, limits, param))
    return Draft(prompts=tuple(out), **common)


def parse_chat(body, limits: Limits) -> Draft:
    """/v1/chat/completions: messages, tools and thinking mode encoded as DeepSeek-V4 defines them."""
    req = _validate(ChatCompletionRequest, body)
    thinking, effort, drop = chat_mode(req)
    tools = tools_offered(req)
    common = _common(req, limits, chat=True, thinking=thinking, tool_calls=tools is not None)
    common["grammar"] = chat_grammar(req, tools, thinking, limits.think_end_id, limits.grammar_checks)
    raw_tools = [t["function"] for t in body["tools"]] if tools is not None else None
    try:
        text = encode_messages(from_request(req.messages, raw_tools), "thinking" if thinking else "chat",
                               effort, drop)
    except ChatFormatError as e:
        raise invalid(str(e), e.param) from None
    if common["n"] > limits.max_children:
        raise invalid(f"'n' exceeds this server's limit of {limits.max_children} concurrent generations", "n")
    return Draft(prompts=(text,), **common)


async def tokenize(tokenizer, text: str) -> tuple[int, ...]:
    """`tokenizer.encode(text)`, in a thread for a long text so the event loop keeps serving."""
    try:
        if len(text) > THREAD_TOKENIZE_CHARS:
            return tuple(await asyncio.to_thread(tokenizer.encode, text))
        return tuple(tokenizer.encode(text))
    except UnicodeEncodeError:
        raise invalid("the prompt contains invalid Unicode (an unpaired surrogate)", "prompt") from None


async def prompt_ids(draft: Draft, tokenizer) -> list[tuple[int, ...]]:
    """Each prompt of `draft` as token ids (texts tokenized, long ones in a thread)."""
    return [p if isinstance(p, tuple) else await tokenize(tokenizer, p) for p in draft.prompts]


def finalize(draft: Draft, ids: list[tuple[int, ...]], limits: Limits, now: float,
             request_id: str | None = None) -> ParsedRequest:
    """Length checks and defaults for each prompt's ids; the request's choices as child requests.
    `now` is unix seconds (the deadline is absolute)."""
    if request_id is None:
        request_id = ("chatcmpl-" if draft.options.chat else "cmpl-") + secrets.token_hex(12)
    deadline = now + limits.timeout_s if limits.timeout_s is not None else None
    bases = [_generate_request(draft, p, limits, request_id, deadline) for p in ids]
    return ParsedRequest(request_id, plan_children(bases, draft.n, request_id), draft.n, draft.options)


def _generate_request(draft: Draft, prompt_ids: tuple[int, ...], limits: Limits, request_id: str,
                      deadline: float | None) -> GenerateRequest:
    n = len(prompt_ids)
    if n == 0:
        raise invalid("the prompt encodes to no tokens", "prompt")
    if n > limits.max_prompt_tokens:
        raise invalid(f"the prompt has {n} tokens; the limit is {limits.max_prompt_tokens}",
                      "messages" if draft.options.chat else "prompt", openai_code="context_length_exceeded")
    room = limits.max_model_len - n
    max_tokens = draft.max_tokens if draft.max_tokens is not None else min(limits.default_max_tokens, room)
    if draft.sampling.min_tokens > max_tokens:
        raise invalid(f"'min_tokens' ({draft.sampling.min_tokens}) must be at most max_tokens ({max_tokens})",
                      "min_tokens")
    if max_tokens > room or room <= 0:
        raise invalid(f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                      f"length {limits.max_model_len}", "max_tokens", openai_code="context_length_exceeded")
    return GenerateRequest(request_id=request_id, prompt_ids=tuple(prompt_ids), max_tokens=max_tokens,
                           sampling=draft.sampling, stop_token_ids=draft.stop_token_ids,
                           stop_strings=draft.stop_strings, ignore_eos=draft.ignore_eos, deadline=deadline,
                           logprobs=draft.logprobs, prompt_logprobs=draft.logprobs if draft.options.echo else None,
                           grammar=draft.grammar)
