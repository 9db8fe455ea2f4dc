"""DeepSeek-V4's chat encoding written out step by step on plain message dicts, as the
checkpoint's `encoding/encoding_dsv4.py` defines it (merge tool results into user turns, order
them by the calls, drop earlier reasoning, render message by message looking up the last user
turn each time). An independent statement of the rule, for router/chat_encoding.py to be checked
against on many conversations (transformers ships no DeepSeek-V4 chat template to compare with)."""

import copy
import json

from router.chat_encoding import REASONING_EFFORT_MAX, TOOLS_TEMPLATE

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
DSML = "｜DSML｜"


def _json(v):
    return json.dumps(v, ensure_ascii=False)


def _tools(tools):
    return TOOLS_TEMPLATE.format(dsml=DSML, think_start="<think>", think_end="</think>",
                                 schemas="\n".join(_json(t["function"]) for t in tools))


def _merge(messages):
    out = []
    for m in copy.deepcopy(messages):
        if m["role"] == "tool":
            block = {"type": "tool_result", "id": m.get("tool_call_id", ""), "content": m["content"]}
            if out and out[-1]["role"] == "user" and "blocks" in out[-1]:
                out[-1]["blocks"].append(block)
            else:
                out.append({"role": "user", "blocks": [block]})
        elif m["role"] == "user":
            block = {"type": "text", "text": m["content"]}
            if out and out[-1]["role"] == "user" and "blocks" in out[-1]:
                out[-1]["blocks"].append(block)
            else:
                out.append({"role": "user", "blocks": [block]})
        else:
            out.append(m)
    order = {}
    for m in out:
        if m["role"] == "assistant" and m.get("tool_calls"):
            order = {tc["id"]: k for k, tc in enumerate(m["tool_calls"]) if tc.get("id")}
        elif m["role"] == "user":
            results = [b for b in m["blocks"] if b["type"] == "tool_result"]
            if len(results) > 1 and order:
                ranked = iter(sorted(results, key=lambda b: order.get(b["id"], 0)))
                m["blocks"] = [next(ranked) if b["type"] == "tool_result" else b for b in m["blocks"]]
    return out


def _last_user(ms):
    return max((i for i, m in enumerate(ms) if m["role"] in ("user", "developer")), default=-1)


def _render(i, ms, thinking, effort, drop):
    m, lu = ms[i], _last_user(ms)
    out = REASONING_EFFORT_MAX if (i == 0 and thinking and effort == "max") else ""
    if m["role"] == "system":
        out += (m.get("content") or "") + ("\n\n" + _tools(m["tools"]) if m.get("tools") else "")
    elif m["role"] == "developer":
        out += USER + m["content"] + ("\n\n" + _tools(m["tools"]) if m.get("tools") else "")
    elif m["role"] == "user":
        out += USER + "\n\n".join(b["text"] if b["type"] == "text" else f"<tool_result>{b['content']}</tool_result>"
                                  for b in m["blocks"])
    else:
        calls = ""
        if m.get("tool_calls"):
            invokes = []
            for tc in m["tool_calls"]:
                args = json.loads(tc["function"]["arguments"])
                params = "\n".join(
                    f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                    f'{v if isinstance(v, str) else _json(v)}</{DSML}parameter>' for k, v in args.items())
                invokes.append(f'<{DSML}invoke name="{tc["function"]["name"]}">\n{params}\n</{DSML}invoke>')
            calls = f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"
        think = (m.get("reasoning_content") or "") + "</think>" if thinking and (not drop or i > lu) else ""
        out += think + (m.get("content") or "") + calls + EOS
    if i + 1 < len(ms) and ms[i + 1]["role"] != "assistant":
        return out
    if m["role"] in ("user", "developer"):
        out += ASSISTANT + ("<think>" if thinking and (not drop or i >= lu) else "</think>")
    return out


def reference_encode(messages, tools=None, thinking=False, effort=None, drop=True):
    """The prompt for an OpenAI request's `messages` and `tools` (tools in a first system message)."""
    messages = list(messages)
    if tools:
        messages.insert(0, {"role": "system", "tools": tools})
    ms = _merge(messages)
    if any(m.get("tools") for m in ms):
        drop = False
    if thinking and drop:
        lu = _last_user(ms)
        kept = []
        for i, m in enumerate(ms):
            if m["role"] in ("user", "system") or i >= lu:
                kept.append(m)
            elif m["role"] == "assistant":
                kept.append({k: v for k, v in m.items() if k != "reasoning_content"})
        ms = kept
    return BOS + "".join(_render(i, ms, thinking, effort, drop) for i in range(len(ms)))
