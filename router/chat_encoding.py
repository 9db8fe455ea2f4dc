"""DeepSeek-V4 chat encoding: OpenAI-style messages → the prompt text the model was trained on.

Follows the official `encoding_dsv4.encode_messages(messages, thinking_mode, reasoning_effort,
drop_thinking)` (the checkpoint's `encoding/encoding_dsv4.py`):

    <｜begin▁of▁sentence｜>[REASONING_EFFORT_MAX]{system}[\\n\\n## Tools …]<｜User｜>{user}<｜Assistant｜></think>
    {answer}[\\n\\n<｜DSML｜tool_calls>…</｜DSML｜tool_calls>]<｜end▁of▁sentence｜>
    <｜User｜><tool_result>{result}</tool_result>\\n\\n{user}<｜Assistant｜>  then  </think> (chat) or <think>

- Tools: the request's `tools` travel in a system message inserted first (as vLLM and SGLang
  do), rendered as the official "## Tools" section with one JSON schema per line.
- Role `tool`: V4 has none; tool results join the user turn that follows the assistant's calls
  as `<tool_result>` blocks (in the order of the calls), and runs of user/tool messages are one
  user turn, their blocks joined by a blank line.
- Assistant `tool_calls` are rendered in DSML: one `<｜DSML｜parameter name=… string="true|false">`
  per argument, strings as is, other values as JSON.
- `thinking`: the last user turn opens `<think>`; earlier turns' reasoning (and developer messages
  before the last user turn) are dropped (`drop_thinking`), except when tools are present, where
  all reasoning is kept. `reasoning_effort="max"` prefixes the first message with
  REASONING_EFFORT_MAX; "high" is the default effort and adds nothing.

The decode side, splitting a thinking completion into `reasoning_content` and `content`, is
`ReasoningSplitter` below; DSML tool calls are parsed back by `router/tool_calls.py`.
"""

from __future__ import annotations

import json
from typing import NamedTuple

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside \
{think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = ("high", "max")


class ChatFormatError(ValueError):
    """A message list this encoding cannot represent; `param` names the offending field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class Message(NamedTuple):  # a tuple: built per message per request, cheaply
    """One message after validation. A user turn holds `blocks`: ("text", s) or ("tool_result", s,
    tool_call_id); `tools` (function schemas, as the client sent them) ride on a system message."""

    role: str
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[tuple[str, dict, str], ...] = ()  # (name, arguments, id)
    tools: tuple[dict, ...] = ()
    blocks: tuple[tuple, ...] = ()


def to_json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


# --------------------------------------------------------------------------- from the request

def text_of(content, param: str, sep: str = "\n") -> str:
    """OpenAI content: a string, or text parts (validated models or dicts) joined by `sep`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return sep.join(p.text if hasattr(p, "text") else p["text"] for p in content)


def from_request(messages, tools: list[dict] | None) -> list[Message]:
    """Validated request messages (router/request_models.py) → `Message`s; `tools`: the function
    schemas to offer (None: none)."""
    out = [Message("system", tools=tuple(tools))] if tools else []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if m.role == "assistant":
            calls = []
            for j, tc in enumerate(m.tool_calls or ()):
                try:
                    args = json.loads(tc.function.arguments)
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    raise ChatFormatError("arguments must be a JSON object",
                                          f"{param}.tool_calls[{j}].function.arguments")
                calls.append((tc.function.name, args, tc.id or ""))
            out.append(Message("assistant", text_of(m.content, param), m.reasoning_content or m.reasoning or "",
                               tuple(calls)))
        elif m.role == "tool":
            out.append(Message("tool", text_of(m.content, param, "\n\n"), blocks=(
                ("tool_result", text_of(m.content, param, "\n\n"), m.tool_call_id or ""),)))
        else:
            text = text_of(m.content, param)
            if m.role == "developer" and not text:
                raise ChatFormatError("developer messages must not be empty", f"{param}.content")
            out.append(Message(m.role, text))
    return out


def parse_messages(raw, tools: list[dict] | None = None) -> list[Message]:
    """An OpenAI `messages` array (plain JSON) validated and converted (raises ChatFormatError)."""
    from pydantic import ValidationError

    from router.request_models import ChatCompletionRequest, first_error

    try:
        req = ChatCompletionRequest.model_validate({"messages": raw})
    except ValidationError as e:
        message, param = first_error(e)
        raise ChatFormatError(message, param) from None
    return from_request(req.messages, tools)


# --------------------------------------------------------------------------- preprocessing

def _merge_user_turns(msgs: list[Message]) -> list[Message]:
    """Tool results and user messages in a row become one user turn of blocks; the tool results
    of a turn are put in the order of the calls of the last assistant turn that made calls."""
    out: list[Message] = []
    for m in msgs:
        if m.role not in ("user", "tool"):
            out.append(m)
            continue
        block = m.blocks[0] if m.role == "tool" else ("text", m.content)
        if out and out[-1].role == "user":
            out[-1] = Message("user", blocks=out[-1].blocks + (block,))
        else:
            out.append(Message("user", blocks=(block,)))
    if sum(m.role == "tool" for m in msgs) < 2:  # no turn with several results to put in order
        return out
    order: dict[str, int] = {}
    for i, m in enumerate(out):
        if m.role == "assistant" and m.tool_calls:
            order = {cid: k for k, (_, _, cid) in enumerate(m.tool_calls) if cid}
        results = [b for b in m.blocks if b[0] == "tool_result"]
        if m.role == "user" and len(results) > 1 and order:
            ranked = iter(sorted(results, key=lambda b: order.get(b[2], 0)))
            out[i] = Message("user", blocks=tuple(next(ranked) if b[0] == "tool_result" else b for b in m.blocks))
    return out


def _last_user_index(msgs: list[Message]) -> int:
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i].role in ("user", "developer"):
            return i
    return -1


def _drop_thinking(msgs: list[Message]) -> list[Message]:
    """Before the last user turn: assistant reasoning removed, developer messages dropped."""
    last = _last_user_index(msgs)
    out = []
    for i, m in enumerate(msgs):
        if m.role in ("user", "system") or i >= last:
            out.append(m)
        elif m.role == "assistant":
            out.append(Message("assistant", m.content, "", m.tool_calls))
    return out


# --------------------------------------------------------------------------- rendering

def render_tools(tools: tuple[dict, ...]) -> str:
    return TOOLS_TEMPLATE.format(dsml=DSML, think_start=THINK_START, think_end=THINK_END,
                                 schemas="\n".join(to_json(t) for t in tools))


def render_tool_calls(calls) -> str:
    invokes = []
    for name, args, _ in calls:
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f'{v if isinstance(v, str) else to_json(v)}</{DSML}parameter>' for k, v in args.items())
        invokes.append(f'<{DSML}invoke name="{name}">\n{params}\n</{DSML}invoke>')
    return f"\n\n{TOOL_CALLS_START}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_END}"


def _render(i: int, msgs: list[Message], last_user: int, thinking: bool, effort: str | None, drop: bool) -> str:
    m = msgs[i]
    out = REASONING_EFFORT_MAX if (i == 0 and thinking and effort == "max") else ""
    tools = "\n\n" + render_tools(m.tools) if m.tools else ""
    if m.role == "system":
        out += m.content + tools
    elif m.role == "developer":
        out += USER + m.content + tools
    elif m.role == "user":
        out += USER + "\n\n".join(b[1] if b[0] == "text" else f"<tool_result>{b[1]}</tool_result>"
                                  for b in m.blocks)
    else:  # assistant
        keep_reasoning = thinking and (not drop or i > last_user)
        calls = render_tool_calls(m.tool_calls) if m.tool_calls else ""
        out += (m.reasoning + THINK_END if keep_reasoning else "") + m.content + calls + EOS
    # a user turn followed by the assistant's (or by the end: the generation prompt)
    if i + 1 < len(msgs) and msgs[i + 1].role != "assistant":
        return out
    if m.role in ("user", "developer"):
        open_think = thinking and (not drop or i >= last_user)
        out += ASSISTANT + (THINK_START if open_think else THINK_END)
    return out


def encode_messages(messages: list[Message], thinking_mode: str = "chat",
                    reasoning_effort: str | None = None, drop_thinking: bool = True) -> str:
    """The prompt text (BOS included) for `messages`; tokenize it with special tokens recognised."""
    if thinking_mode not in THINKING_MODES:
        raise ChatFormatError("thinking_mode must be 'chat' or 'thinking'", "thinking_mode")
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise ChatFormatError("reasoning_effort must be 'high' or 'max'", "reasoning_effort")
    thinking = thinking_mode == "thinking"
    msgs = _merge_user_turns(list(messages))
    drop = drop_thinking and not any(m.tools for m in msgs)  # with tools, all reasoning is kept
    if thinking and drop:
        msgs = _drop_thinking(msgs)
    last_user = _last_user_index(msgs)  # once: per message it made long conversations quadratic
    return BOS + "".join(_render(i, msgs, last_user, thinking, reasoning_effort, drop) for i in range(len(msgs)))


# --------------------------------------------------------------------------- decoding

class ReasoningSplitter:
    """Splits a thinking-mode completion stream into (reasoning, content) deltas at `</think>`.

    The prompt already ends with `<think>`, so everything up to the first `</think>` is reasoning.
    A suffix that could still grow into `</think>` is held back until the next delta decides it.
    """

    def __init__(self):
        self._in_reasoning = True
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        if not self._in_reasoning:
            return "", text
        buf = self._held + text
        at = buf.find(THINK_END)
        if at >= 0:
            self._in_reasoning, self._held = False, ""
            return buf[:at], buf[at + len(THINK_END):]
        keep = next((k for k in range(min(len(THINK_END) - 1, len(buf)), 0, -1)
                     if buf.endswith(THINK_END[:k])), 0)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], ""

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self._in_reasoning else ("", held)
