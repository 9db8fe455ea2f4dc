"""The OpenAI request bodies as typed models (pydantic v2): what a request may hold, with types
and ranges; `GET /openapi.json` publishes them.

Every model forbids unknown fields, so a field this server does not know is a 400 naming it,
never silently dropped. Fields that are known but not implemented (priority, suffix,
…) are typed here so their values can be checked, and refused at any non-neutral value by
`openai_protocol` with a message naming the field. Validation is strict: no string → number or
bool → int coercion; numbers are compared exactly whatever their size.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_SEED = 1 << 64
MAX_TOP_K = 1 << 31

Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = Annotated[int, Field(ge=-1, lt=MAX_TOP_K)]
Seed = Annotated[int, Field(gt=-MAX_SEED, lt=MAX_SEED)]
TokenIds = list[int]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Bias = Annotated[float, Field(ge=-100, le=100)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(None, description="extension (vLLM's): the usage so far on every chunk")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


Content = str | list[TextPart]


class ChatTemplateKwargs(_Strict):
    """The `chat_template_kwargs` vLLM and SGLang accept for DeepSeek-V4."""

    thinking: bool | None = None
    enable_thinking: bool | None = None
    drop_thinking: bool | None = None


class FunctionDef(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class NamedFunction(_Strict):
    name: str


class JsonSchemaSpec(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="the schema is enforced either way")


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]
FORMAT_TYPES = ("text", "json_object", "json_schema")


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class SystemMessage(_Strict):
    role: Literal["system"]
    content: Content
    name: str | None = None


class DeveloperMessage(_Strict):
    role: Literal["developer"]
    content: Content
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: Content | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's name for reasoning_content
    tool_calls: list[ToolCall] | None = None
    name: str | None = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None


Message = Annotated[SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
                    Field(discriminator="role")]
ROLES = ("system", "developer", "user", "assistant", "tool")


class _Common(_Strict):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = Field(None, description="extension: 0 or -1 = off")
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = Field(None, description="extension")
    include_stop_str_in_output: bool | None = Field(None, description="extension: keep the stop string")
    ignore_eos: bool | None = Field(None, description="extension")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = Field(None, description="extension: token_ids on every choice and chunk")
    user: str | None = None
    n: int | None = Field(None, description="choices per prompt, 1..16 (RouterConfig.max_n)")
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = Field(None, description="extension (vLLM's)")
    logit_bias: Annotated[dict[str, Bias], Field(max_length=300)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = Field(None, description="extension (vLLM's)")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = Field(
        None, description="extension (vLLM's): keep tokens of probability >= min_p x the top token's")
    # known, not implemented: refused at any value other than the neutral one
    priority: int | None = None
    response_format: ResponseFormat | None = Field(
        None, description="json_object or json_schema: enforced by grammar-constrained decoding")


class CompletionRequest(_Common):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    echo: bool | None = Field(None, description="the prompt (and with logprobs its tokens' logprobs) before the output")
    logprobs: TopLogprobs | None = Field(None, description="each token's logprob and the k most likely (0..20)")
    suffix: str | None = None
    best_of: int | None = Field(None, description="1 or n only")


class ChatCompletionRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = Field(None, description="with logprobs: the k most likely tokens (0..20)")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    thinking_mode: Literal["chat", "thinking"] | None = Field(None, description="extension")
    reasoning_effort: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


# --------------------------------------------------------------------------- errors

def _param(loc: tuple) -> str:
    """A pydantic error location as the request path a client reads: `messages[0].content[1].text`
    (union member labels and the role tag of a message dropped)."""
    out = ""
    for i, part in enumerate(loc):
        if i >= 1 and loc[i - 1] == "response_format" and part in FORMAT_TYPES:  # the format union's tag
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "list", "dict") or part.startswith(
                ("function-", "literal")) or i >= 2 and loc[i - 2] == "messages" and isinstance(loc[i - 1], int) and part in ROLES:
            continue
        else:
            out += ("." if out else "") + part
    return out


# what a top-level field must be, in the words of the error message
_WHAT = {
    "temperature": "a number in [0, 2]", "top_p": "a number in (0, 1]",
    "top_k": f"an integer in [-1, {MAX_TOP_K}) (-1 or 0: off)", "seed": "a 64-bit integer",
    "max_tokens": "an integer", "max_completion_tokens": "an integer", "stream": "a boolean",
    "ignore_eos": "a boolean", "return_token_ids": "a boolean", "include_stop_str_in_output": "a boolean",
    "model": "a string", "n": "an integer", "stop": "a non-empty string or an array of non-empty strings",
    "stop_token_ids": "an array of integers", "prompt": "a string or an array of token ids",
    "messages": "a non-empty array of messages", "stream_options": "an object",
    "top_logprobs": "an integer in [0, 20]", "presence_penalty": "a number in [-2, 2]",
    "frequency_penalty": "a number in [-2, 2]", "repetition_penalty": "a number in (0, 2]",
    "min_tokens": "a non-negative integer", "min_p": "a number in [0, 1]",
    "logit_bias": "an object of at most 300 token ids (as strings) to numbers in [-100, 100]",
}


def first_error(err: ValidationError) -> tuple[str, str]:
    """(message, param) for the most specific error of a failed validation."""
    errors = err.errors(include_url=False, include_context=False)
    best = max(errors, key=lambda e: len(e["loc"]))
    if any(e["loc"] and e["loc"][0] == "prompt" for e in errors):  # a union: report the field itself
        best = next(e for e in errors if e["loc"][0] == "prompt")
    param = _param(best["loc"])
    if best["type"] == "extra_forbidden":
        return f"unknown field '{param}'", param
    if best["type"] == "missing":
        return f"'{param}' is required", param
    top = param.split(".")[0].split("[")[0]
    if top in _WHAT and (param == top or top in ("prompt", "stop", "stop_token_ids", "logit_bias")):
        return f"'{top}' must be {_WHAT[top]}", top
    if best["type"] == "union_tag_invalid" and param.startswith("response_format"):
        return f"'response_format.type' must be one of {', '.join(FORMAT_TYPES)}", "response_format.type"
    if best["type"] == "union_tag_invalid":
        return f"'{param}.role' must be one of {', '.join(ROLES)}", f"{param}.role"
    return f"'{param}': {best['msg']}", param
