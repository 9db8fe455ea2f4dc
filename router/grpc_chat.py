"""The gRPC `Chat` call: a ChatRequest as the /v1/chat/completions body it stands for, and the
output streamed as ChatResponse messages built by the HTTP chat stream's own `ResponseBuilder`.

The request is not validated here: `chat_body` only rewrites the typed message into the JSON
body (unset optionals omitted, tool schemas parsed from their JSON text), and `parse_chat`
checks it, so gRPC and HTTP accept and refuse the same chats with the same messages. The deltas
(content, reasoning_content, tool-call pieces, finish_reason "tool_calls") are the builder's
streamed chunks carried over field by field.
"""

from __future__ import annotations

import asyncio
import json
import time

from router.errors import invalid
from router.openai_format import ResponseBuilder
from router.openai_protocol import ParsedRequest
from router.proto import v4serve_pb2 as pb
from worker_runtime.wire import Usage

# ChatRequest fields with the GenerateRequest shape and the same name in the HTTP body
SHARED_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_tokens", "min_p")


def shared_fields(req) -> dict:
    """The body fields a GenerateRequest or ChatRequest sets among those they share (numbers 3..23,
    `logprobs` and `echo` aside: their HTTP shapes differ between the endpoints)."""
    body: dict = {name: getattr(req, name) for name in SHARED_OPTIONAL if req.HasField(name)}
    if req.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in req.logit_bias.items()}
    for name in ("stop", "stop_token_ids"):
        if getattr(req, name):
            body[name] = list(getattr(req, name))
    for name in ("ignore_eos", "include_stop_str_in_output"):
        if getattr(req, name):
            body[name] = True
    if req.model:
        body["model"] = req.model
    if req.HasField("response_format"):
        body["response_format"] = response_format_body(req.response_format)
    return body


def response_format_body(fmt: pb.ResponseFormat) -> dict:
    """The OpenAI `response_format` of the message's (the schema's JSON text parsed)."""
    if fmt.type != "json_schema":
        if fmt.json_schema or fmt.name:
            raise invalid("'response_format.json_schema' and '.name' go with type 'json_schema'", "response_format")
        return {"type": fmt.type}
    schema = _json(fmt.json_schema, "response_format.json_schema") if fmt.json_schema else {}
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": schema}}


def _json(text: str, param: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise invalid(f"'{param}' is not JSON: {e}", param) from None


def _message(m: pb.ChatMessage) -> dict:
    """One turn as the HTTP body writes it; fields left empty are left out, so a field the role
    does not have is refused only when set."""
    out: dict = {"role": m.role}
    if m.HasField("content"):
        out["content"] = m.content
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [{**({"id": c.id} if c.id else {}), "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
    if m.HasField("reasoning_content"):
        out["reasoning_content"] = m.reasoning_content
    return out


def _tool(i: int, t: pb.Tool) -> dict:
    fn: dict = {"name": t.name}
    if t.description:
        fn["description"] = t.description
    if t.parameters:
        fn["parameters"] = _json(t.parameters, f"tools[{i}].function.parameters")
    if t.HasField("strict"):
        fn["strict"] = t.strict
    return {"type": "function", "function": fn}


def chat_body(req: pb.ChatRequest) -> dict:
    """The /v1/chat/completions body equivalent to a ChatRequest."""
    body = {"messages": [_message(m) for m in req.messages], **shared_fields(req)}
    if req.HasField("logprobs"):  # the k alternatives: HTTP's logprobs true and top_logprobs k
        body["logprobs"], body["top_logprobs"] = True, req.logprobs
    if req.tools:
        body["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    which = req.tool_choice.WhichOneof("choice") if req.HasField("tool_choice") else None
    if which == "mode":
        body["tool_choice"] = req.tool_choice.mode
    elif which == "function":
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.function}}
    if req.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = req.parallel_tool_calls
    kwargs = {name: getattr(req, name) for name in ("thinking", "drop_thinking") if req.HasField(name)}
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if req.HasField("reasoning_effort"):
        body["reasoning_effort"] = req.reasoning_effort
    return body


def usage_message(usage: Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                    cached_tokens=usage.cached_tokens, spec_proposed=usage.spec_proposed,
                    spec_accepted=usage.spec_accepted)


def token_logprobs(lps) -> list:
    """A chunk's TokenLogprobs as the proto's messages (token ids, not their text)."""
    return [pb.TokenLogprob(token_id=lp.token, logprob=lp.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]) for lp in lps or ()]


def _response(builder: ResponseBuilder, chunk, finish_reason: str | None, usage=None) -> pb.ChatResponse:
    """The ChatResponse of one chunk: the builder's streamed delta, field by field."""
    choice = builder.chunk(chunk.token_ids, chunk.text, finish_reason, chunk.logprobs)["choices"][0]
    delta = choice["delta"]
    calls = [pb.ToolCallDelta(index=d["index"], id=d.get("id", ""), name=d["function"].get("name", ""),
                              arguments=d["function"]["arguments"]) for d in delta.get("tool_calls", ())]
    return pb.ChatResponse(
        request_id=builder.request_id, index=builder.index, content=delta.get("content") or "",
        reasoning_content=delta.get("reasoning_content", ""), tool_calls=calls,
        finish_reason=choice["finish_reason"] or "", token_ids=chunk.token_ids,
        logprobs=token_logprobs(chunk.logprobs),
        usage=None if usage is None else usage_message(usage))


async def stream_chat(dispatcher, tokenizer, model: str, parsed: ParsedRequest, slot, arrival: float,
                      owner: str | None, write) -> None:
    """Run a parsed chat and `write` its ChatResponses; each choice's last chunk is held back until
    its outcome gives the usage (and the final finish_reason). Raises the dispatcher's APIError."""
    created, opts = int(time.time()), parsed.options
    builders = {c.index: ResponseBuilder(parsed.request_id, model, created, opts, tokenizer, index=c.index,
                                         prompt_tokens=len(c.req.prompt_ids)) for c in parsed.children}
    lock = asyncio.Lock()  # choices stream from tasks of their own: one write at a time
    last = {}

    async def emit_choice(k, chunk):
        if chunk.finish_reason is not None:
            last[k] = chunk
            return
        async with lock:
            await write(_response(builders[k], chunk, None))

    if len(parsed.children) == 1:
        outcomes = [await dispatcher.execute(slot, parsed.generate, lambda c: emit_choice(0, c), arrival, owner)]
    else:
        outcomes = await dispatcher.execute_group(slot, parsed.request_id, parsed.children, emit_choice, arrival,
                                                  owner)
    for c, outcome in zip(parsed.children, outcomes):
        await write(_response(builders[c.index], last[c.index], outcome.finish_reason, outcome.usage))
