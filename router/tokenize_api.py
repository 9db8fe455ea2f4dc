"""`POST /tokenize` and `POST /detokenize`, as vLLM defines them, with the served tokenizer.

    /tokenize    {"prompt": "..."}  or  {"messages": [...], "tools": ..., "chat_template_kwargs": ...}
                 → {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"tokens": [...]} → {"prompt": "..."}

A chat body is encoded exactly as /v1/chat/completions encodes it (the generation prompt
included). `add_special_tokens` (default false, as /v1/completions adds none) prepends BOS to a
prompt; `return_token_strs` adds each token's text.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from router.chat_encoding import ChatFormatError, encode_messages, from_request
from router.chat_options import chat_mode, tools_offered
from router.errors import invalid
from router.openai_protocol import _validate, check_model, check_token_ids
from router.request_models import ChatTemplateKwargs, Message, NamedToolChoice, Tool, _Strict


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    thinking_mode: str | None = None
    reasoning_effort: str | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def tokenize_text(body, limits) -> tuple[str, bool, bool]:
    """(text, add BOS, return token strings) of a /tokenize body; the chat form encoded."""
    if isinstance(body, dict) and "messages" in body:
        req = _validate(TokenizeChatRequest, body)
        if req.add_generation_prompt is False or req.continue_final_message:
            param = "add_generation_prompt" if req.add_generation_prompt is False else "continue_final_message"
            raise invalid(f"'{param}': the chat encoding always ends with the generation prompt", param)
        if req.thinking_mode not in (None, "chat", "thinking"):
            raise invalid("'thinking_mode' must be 'chat' or 'thinking'", "thinking_mode")
        thinking, effort, drop = chat_mode(req)
        tools = tools_offered(req)
        raw_tools = [t["function"] for t in body["tools"]] if tools is not None else None
        try:
            text = encode_messages(from_request(req.messages, raw_tools), "thinking" if thinking else "chat",
                                   effort, drop)
        except ChatFormatError as e:
            raise invalid(str(e), e.param) from None
        if req.add_special_tokens:
            raise invalid("'add_special_tokens': the chat encoding already begins with BOS", "add_special_tokens")
    else:
        req = _validate(TokenizeCompletionRequest, body)
        text = req.prompt
    check_model(req.model, limits)
    return text, bool(req.add_special_tokens), bool(req.return_token_strs)


def tokenize_response(tokenizer, ids: list[int], add_bos: bool, token_strs: bool, limits) -> dict:
    if add_bos and tokenizer.bos_id is not None:
        ids = [tokenizer.bos_id, *ids]
    return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids,
            "token_strs": [tokenizer.decode([t]) for t in ids] if token_strs else None}


def detokenize(body, tokenizer, limits) -> dict:
    req = _validate(DetokenizeRequest, body)
    check_model(req.model, limits)
    return {"prompt": tokenizer.decode(list(check_token_ids(req.tokens, limits, "tokens")))}
