"""DeepSeek-V4 DSML tool calls in a completion → OpenAI `tool_calls`, incrementally.

The model writes its calls after its answer text, as the chat encoding renders them:

    {content}\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

`ToolCallParser.feed(text)` takes the completion text in any pieces and returns what is final:
content text, and deltas of the calls in the shape of OpenAI's streamed `tool_calls` (a call's
first delta carries its id and name, later ones pieces of its `arguments`). The arguments are
the JSON object the official `decode_dsml_to_arguments` builds, `{"city": "Paris", "days": 3}`:
a `string="true"` value is streamed as a JSON string as it arrives; any other value is sent
whole once closed, as is when it is valid JSON, else as a JSON string, so the arguments always
parse. Text that could still be the start of markup is held back until the next piece decides
it. Markup that breaks the grammar ends the call in progress (its arguments closed, still valid
JSON) and the rest is returned as content, never dropped.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from router.chat_encoding import DSML, TOOL_CALLS_END, TOOL_CALLS_START

_INVOKE = (f'<{DSML}invoke name="', None, '">')
_PARAM = (f'<{DSML}parameter name="', None, '" string="', None, '">')
_INVOKE_END = (f"</{DSML}invoke>",)
_PARAM_END = f"</{DSML}parameter>"
_BLOCK_END = (TOOL_CALLS_END,)
_MAX_ATTR = 256  # an attribute value longer than this is not markup


@dataclass(frozen=True)
class CallDelta:
    index: int
    arguments: str
    id: str | None = None  # first delta of a call only
    name: str | None = None

    def openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _match(buf: str, tag: tuple) -> tuple[str, list[str], int]:
    """Match `tag` (literal pieces; None = an attribute value up to '"') at the start of `buf`:
    ("match", values, length) | ("partial", …) when buf may still become it | ("fail", …)."""
    at, values = 0, []
    for piece in tag:
        if piece is None:
            end = buf.find('"', at)
            if end < 0:
                ok = len(buf) - at <= _MAX_ATTR and "\n" not in buf[at:]
                return ("partial" if ok else "fail"), values, 0
            if end - at > _MAX_ATTR or "\n" in buf[at:end]:
                return "fail", values, 0
            values.append(buf[at:end])
            at = end
            continue
        have = buf[at:at + len(piece)]
        if have != piece[:len(have)]:
            return "fail", values, 0
        if len(have) < len(piece):
            return "partial", values, 0
        at += len(piece)
    return "match", values, at


def _held_prefix(buf: str, marker: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class ToolCallParser:
    def __init__(self):
        self.calls: list[dict] = []  # {"id", "name", "arguments"} as assembled so far
        self._buf = ""
        self._state = "content"  # content | block | invoke | value
        self._param_string = False  # the open parameter's value is a string (streamed)
        self._params = 0  # parameters of the open call

    # --- output helpers
    def _args(self, text: str, out: list[CallDelta]) -> None:
        self.calls[-1]["arguments"] += text
        out.append(CallDelta(len(self.calls) - 1, text))

    def _close_call(self, out: list[CallDelta], pending: str = "") -> None:
        """End the open call (its arguments stay valid JSON); `pending`: an open value's text."""
        if self._state == "value":
            self._args(_value(pending, self._param_string) + ('"' if self._param_string else ""), out)
        self._args("}" if self._params else "{}", out)
        self._params = 0

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """Content released and call deltas, for the next piece of the completion text."""
        self._buf += text
        content, deltas = [], []
        while self._step(content, deltas):
            pass
        return "".join(content), deltas

    def flush(self) -> tuple[str, list[CallDelta]]:
        """At the end of the completion: whatever was held back (an unfinished call is closed)."""
        deltas: list[CallDelta] = []
        rest = self._buf
        if self._state in ("invoke", "value"):
            if self._state == "value":
                rest = ""
            self._close_call(deltas, self._buf)
        self._buf, self._state = "", "content"
        return rest, deltas

    # --- the grammar, one element per step; False: need more text
    def _step(self, content: list[str], out: list[CallDelta]) -> bool:
        buf = self._buf
        if self._state == "content":
            at = buf.find(TOOL_CALLS_START)
            if at >= 0:
                content.append(buf[:at].rstrip())
                self._buf, self._state = buf[at + len(TOOL_CALLS_START):], "block"
                return True
            keep = _held_prefix(buf, TOOL_CALLS_START)
            body = buf[:len(buf) - keep]
            stripped = body.rstrip()  # whitespace before the block is not content: hold it
            content.append(stripped)
            self._buf = buf[len(stripped):]
            return False
        if self._state == "value":
            at = buf.find(_PARAM_END)
            if at < 0:
                if self._param_string:
                    released = buf[:len(buf) - _held_prefix(buf, _PARAM_END)]
                    if released:
                        self._args(_value(released, True), out)
                        self._buf = buf[len(released):]
                return False
            self._args(_value(buf[:at], self._param_string) + ('"' if self._param_string else ""), out)
            self._buf, self._state = buf[at + len(_PARAM_END):], "invoke"
            return True
        lead = len(buf) - len(buf.lstrip())
        body = buf[lead:]
        if not body:
            return False
        tags = (_INVOKE, _BLOCK_END) if self._state == "block" else (_PARAM, _INVOKE_END)
        results = [_match(body, tag) for tag in tags]
        for tag, (status, values, length) in zip(tags, results):
            if status != "match":
                continue
            self._buf = body[length:]
            if tag is _INVOKE:
                self.calls.append({"id": "call_" + secrets.token_hex(12), "name": values[0], "arguments": ""})
                out.append(CallDelta(len(self.calls) - 1, "", self.calls[-1]["id"], values[0]))
                self._state = "invoke"
            elif tag is _BLOCK_END:
                self._state = "content"
                self._buf = self._buf.lstrip()
            elif tag is _PARAM:
                if values[1] not in ("true", "false"):
                    return self._malformed(body, content, out)
                self._param_string = values[1] == "true"
                self._args(("{" if not self._params else ", ") + json.dumps(values[0], ensure_ascii=False) + ": "
                           + ('"' if self._param_string else ""), out)
                self._params += 1
                self._state = "value"
            else:  # invoke end
                self._close_call(out)
                self._state = "block"
            return True
        if any(status == "partial" for status, _, _ in results):
            return False
        return self._malformed(body, content, out)

    def _malformed(self, body: str, content: list[str], out: list[CallDelta]) -> bool:
        if self._state in ("invoke", "value"):
            self._close_call(out)
        content.append(body)
        self._buf, self._state = "", "content"
        return False


def _value(text: str, string: bool) -> str:
    """A parameter value's text in the arguments JSON: a piece of a string's inside (escaped), or
    a whole non-string value as written when it is JSON, else as a JSON string."""
    if string:
        return json.dumps(text, ensure_ascii=False)[1:-1]
    try:
        json.loads(text)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)
    return text


def parse_all(text: str) -> tuple[str, list[dict]]:
    """The whole completion at once: (content, calls)."""
    p = ToolCallParser()
    content, _ = p.feed(text)
    rest, _ = p.flush()
    return content + rest, p.calls
