"""DeepSeek-V4 chat encoding: OpenAI-style messages → the prompt text the model was trained on.

Follows the official `encoding_dsv4.encode_messages(messages, thinking_mode, reasoning_effort)`
for the roles a chat API carries (system, developer, user, assistant with optional
`reasoning_content`):

    <｜begin▁of▁sentence｜>[REASONING_EFFORT_MAX]{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>...
    ... <｜User｜>{last user}<｜Assistant｜>  then  </think> (chat)  or  <think> (thinking)

- `thinking_mode="thinking"` opens `<think>` after the last user turn so the model reasons first;
  earlier turns' reasoning is dropped (the official `drop_thinking=True`), and developer messages
  before the last user turn are dropped with it.
- `reasoning_effort="max"` (thinking only) prefixes the first message with REASONING_EFFORT_MAX;
  "high" is the default effort and adds nothing.

Tool calling (tools, tool_calls, role "tool") is not supported by this front door and is refused
with a clear error instead of being silently mis-encoded. The decode side, splitting a thinking
completion into `reasoning_content` and `content`, is `ReasoningSplitter` below.
"""

from __future__ import annotations

from dataclasses import dataclass

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)

THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = (None, "high", "max")
_ROLES = ("system", "developer", "user", "assistant")


class ChatFormatError(ValueError):
    """A message list this encoding cannot represent; `param` names the offending field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    reasoning_content: str = ""


# --------------------------------------------------------------------------- validation

def _text_of(content, param: str) -> str:
    """OpenAI content: a string, or a list of {"type": "text", "text": ...} parts (joined by '\\n')."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatFormatError("only text content parts are supported", f"{param}[{j}]")
            parts.append(part["text"])
        return "\n".join(parts)
    raise ChatFormatError("content must be a string or a list of text parts", param)


def parse_messages(raw) -> list[Message]:
    """Validate an OpenAI `messages` array into `Message`s (raises ChatFormatError)."""
    if not isinstance(raw, list) or not raw:
        raise ChatFormatError("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatFormatError("each message must be an object", param)
        role = m.get("role")
        if role == "tool" or m.get("tool_calls") or m.get("tools"):
            raise ChatFormatError("tool calling is not supported", param)
        if role not in _ROLES:
            raise ChatFormatError(f"role must be one of {', '.join(_ROLES)}", f"{param}.role")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        text = _text_of(content, f"{param}.content")
        if role == "developer" and not text:
            raise ChatFormatError("developer messages must not be empty", f"{param}.content")
        reasoning = m.get("reasoning_content") or ""
        if not isinstance(reasoning, str):
            raise ChatFormatError("reasoning_content must be a string", f"{param}.reasoning_content")
        out.append(Message(role, text, reasoning if role == "assistant" else ""))
    return out


# --------------------------------------------------------------------------- encoding

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
            out.append(Message("assistant", m.content))
    return out


def _render(i: int, msgs: list[Message], last_user: int, thinking: bool, effort: str | None, drop: bool) -> str:
    m = msgs[i]
    out = REASONING_EFFORT_MAX if (i == 0 and thinking and effort == "max") else ""
    if m.role == "system":
        out += m.content
    elif m.role in ("user", "developer"):
        out += USER + m.content
    else:  # assistant
        keep_reasoning = thinking and (not drop or i > last_user)
        out += (m.reasoning_content + THINK_END if keep_reasoning else "") + m.content + EOS
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
    if reasoning_effort not in REASONING_EFFORTS:
        raise ChatFormatError("reasoning_effort must be 'high' or 'max'", "reasoning_effort")
    thinking = thinking_mode == "thinking"
    msgs = _drop_thinking(list(messages)) if (thinking and drop_thinking) else list(messages)
    last_user = _last_user_index(msgs)  # once: per message it made long conversations quadratic
    return BOS + "".join(_render(i, msgs, last_user, thinking, reasoning_effort, drop_thinking)
                         for i in range(len(msgs)))


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
