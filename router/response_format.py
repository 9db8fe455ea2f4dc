"""The grammar a request's output must match (`GenerateRequest.grammar`), built at admission and
checked here, so a bad schema is a 400 naming the problem before any worker sees the request.

- `response_format` `{"type": "json_object"}`: a JSON object; `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`: JSON valid against the schema (always enforced,
  `strict` or not). Compact JSON: no whitespace between tokens.
- `tool_choice` "required" / a named function, and `strict` functions: the output is DeepSeek-V4's
  DSML tool-call block as `router/chat_encoding.py` renders it and `router/tool_calls.py` parses
  it, one `invoke` per call (for a named function, exactly one of it; "required": one or more of
  the offered, or exactly one with `parallel_tool_calls` false). Each parameter is a property of
  the function's `parameters` schema, in its order, every required one present, no others: a
  plain string property as raw text (`string="true"`, as the model writes it; text without
  `</`), any other as JSON valid against the property's schema (`string="false"`). So the
  arguments `tool_calls.py` assembles validate against the schema.
- `tool_choice` "auto" with a `strict` function: free text without DSML markup, then optionally
  the block, whose calls of strict functions are held to their schemas (others take any
  parameters).
- In thinking mode the grammar starts after the reasoning: anything up to the `</think>` token.

The grammar is a Lark grammar in llguidance's dialect (`%json{...}` embeds a JSON schema).
"""

from __future__ import annotations

import json
import re

from model import grammar as grammars
from router.chat_encoding import DSML, TOOL_CALLS_END, TOOL_CALLS_START
from router.errors import invalid

_JSON_OPTIONS = {"x-guidance": grammars.JSON_OPTIONS}
_RAW_STRING_KEYS = {"type", "description", "title", "examples", "default"}  # no constraint on a raw string
_DEFS = ("$defs", "definitions")
_ANY_PARAMS = f'(_NL "<{DSML}parameter name=\\"" PNAME "\\" string=\\"false\\">" %json{{}} "</{DSML}parameter>")*'


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json(schema: dict, defs: dict) -> str:
    """`%json{...}` of a (sub)schema, with the root's definitions its `$ref`s may name."""
    return "%json " + json.dumps({**defs, **schema, **_JSON_OPTIONS}, ensure_ascii=False)


def _check(text: str, param: str, checked: grammars.CheckedGrammars | None) -> str:
    try:
        (checked.check if checked is not None else grammars.check)(text)
    except grammars.GrammarError as e:  # its first line, without the grammar's position
        reason = re.sub(r"^at \d+\(\d+\): ", "", str(e).splitlines()[0])
        raise invalid(f"'{param}' cannot be enforced: {reason}", param) from None
    return text


def _reasoning(think_end_id: int | None, param: str) -> str:
    if think_end_id is None:
        raise invalid(f"'{param}' in thinking mode needs '</think>' to be one token of the tokenizer", param)
    return f"REASONING <[{think_end_id}]> "


def response_grammar(fmt, thinking: bool = False, think_end_id: int | None = None,
                     checked: grammars.CheckedGrammars | None = None) -> str | None:
    """The grammar of a typed `response_format` (None: free text); `checked`: verdicts to reuse."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        schema = {"type": "object"}
    else:
        schema = fmt.json_schema.schema_
        if schema is None:
            schema = {}
        if not isinstance(schema, dict):
            raise invalid("'response_format.json_schema.schema' must be a JSON object", "response_format")
    head = _reasoning(think_end_id, "response_format") if thinking else ""
    lark = f"start: {head}answer\nanswer: {_json(schema, {})}\n" + ("REASONING: /(?s:.*)/\n" if thinking else "")
    return _check(grammars.from_lark(lark), "response_format", checked)


# --------------------------------------------------------------------------- DSML tool calls

def _raw(sub: dict) -> str | None:
    """The Lark of a string property's value written as text (`string="true"`), or None when its
    schema constrains it beyond what text can be checked for here (then only JSON is allowed)."""
    enum = sub.get("enum")
    if enum is not None:
        if set(sub) - _RAW_STRING_KEYS - {"enum"} or not all(isinstance(v, str) and "<" not in v for v in enum):
            return None
        return "(" + " | ".join(_lit(v) for v in enum) + ")" if enum else None
    if sub.get("type") != "string" or set(sub) - _RAW_STRING_KEYS - {"minLength", "maxLength"}:
        return None
    if "minLength" in sub or "maxLength" in sub:  # text without '<', its length bounded
        low, high = int(sub.get("minLength", 0)), sub.get("maxLength")
        return f"/[^<]{{{low},{'' if high is None else int(high)}}}/"
    return "RAW"


def _params(name: str, index: int, schema: dict | None, rules: list[str]) -> str:
    """The parameter list of function `name`'s invoke (rules added to `rules`), from its schema."""
    param = f"tools[{index}].function.parameters"
    if schema is None or schema == {}:
        return ""
    if schema.get("type") != "object" or not isinstance(schema.get("properties", {}), dict):
        raise invalid(f"function '{name}' cannot be enforced: its parameters must be an object schema with "
                      "'properties'", param)
    props = schema.get("properties", {})
    if not props and schema.get("additionalProperties", True) is not False:
        return _ANY_PARAMS
    required = set(schema.get("required", ()))
    if required - set(props):
        raise invalid(f"function '{name}' requires parameters it does not define: {sorted(required - set(props))}",
                      param)
    defs = {k: schema[k] for k in _DEFS if k in schema}
    out = []
    for j, (key, sub) in enumerate(props.items()):
        if not key or any(c in key for c in '"<>\n'):
            raise invalid(f"function '{name}': parameter name {key!r} cannot be written in a tool call", param)
        if not isinstance(sub, dict):
            raise invalid(f"function '{name}': the schema of parameter {key!r} must be an object", param)
        rule, end = f"p{index}_{j}", _lit(f"</{DSML}parameter>")
        tag = f'<{DSML}parameter name="{key}" string='
        forms = [f"""{_lit(tag + '"false">')} {_json(sub, defs)}"""]
        raw = _raw(sub)
        if raw is not None:  # a string may also be written as text, as the model writes strings
            forms.append(f"""{_lit(tag + '"true">')} {raw}""")
        rules.append(f"{rule}: _NL ({' | '.join(forms)}) {end}")
        out.append(rule if key in required else f"{rule}?")
    return " ".join(out)


def _invoke(tool, index: int, strict: bool, rules: list[str]) -> str:
    """The rule of one call of `tool` (its arguments held to its schema when `strict`)."""
    f = tool.function
    params = _params(f.name, index, f.parameters, rules) if strict else _ANY_PARAMS
    rule = f"invoke{index}"
    start, end = _lit(f'<{DSML}invoke name="{f.name}">'), _lit(f"</{DSML}invoke>")
    rules.append(f"{rule}: {start} {params} _NL _NL? {end}")  # no parameters: rendered with a blank line
    return rule


def tool_grammar(tools, choice, parallel: bool | None, thinking: bool = False,
                 think_end_id: int | None = None, checked: grammars.CheckedGrammars | None = None) -> str | None:
    """The grammar of a chat request's output given its tools and `tool_choice` (after
    `chat_options.tools_offered` checked them); None when nothing is enforced."""
    if not tools or choice == "none":
        return None
    named = choice is not None and not isinstance(choice, str)
    if choice in (None, "auto") and parallel is not False and not any(t.function.strict for t in tools):
        return None
    rules: list[str] = []
    if named:
        index = next((i for i, t in enumerate(tools) if t.function.name == choice.function.name), None)
        if index is None:
            raise invalid(f"'tool_choice' names function '{choice.function.name}', which is not among 'tools'",
                          "tool_choice.function.name")
        calls = _invoke(tools[index], index, True, rules)
    else:
        invokes = [_invoke(t, i, choice == "required" or bool(t.function.strict), rules) for i, t in enumerate(tools)]
        rules.append("call: " + " | ".join(invokes))
        calls = "call" if parallel is False else 'call (_NL call)*'
    rest = f"_NL {calls} _NL {_lit(TOOL_CALLS_END)}"
    if choice in (None, "auto"):
        # free text that holds no DSML markup, or such text up to the block's start, then the calls: the
        # start is inside one lazy lexeme, which ends at the first block start (a lexeme of its own
        # could not be told from text that might still become one)
        body = f"CONTENT | lead {rest}"
        no_markup = f"~/(?s:.*<{DSML}.*<{DSML}.*)/"
        rules += [f"CONTENT: /(?s:.*)/ & ~/(?s:.*<{DSML}.*)/",
                  f"lead[lazy]: /(?s:.*){re.escape(TOOL_CALLS_START)}/ & {no_markup}"]
    else:
        body = f"{_lit(TOOL_CALLS_START)} {rest}"
    head = _reasoning(think_end_id, "tool_choice") if thinking else ""
    lark = "\n".join([f"start: {head}answer", f"answer: {body}", *rules, "_NL: \"\\n\"", 'PNAME: /[^"<>\\n]{1,64}/',
                      r"RAW: /([^<]|<[^\/<])*/", "REASONING: /(?s:.*)/"]) + "\n"
    return _check(grammars.from_lark(lark), "tools", checked)


def chat_grammar(req, tools, thinking: bool, think_end_id: int | None,
                 checked: grammars.CheckedGrammars | None = None) -> str | None:
    """A chat request's grammar: its `response_format`'s or its tools' (`tools`: those offered)."""
    fmt = response_grammar(req.response_format, thinking, think_end_id, checked)
    calls = tool_grammar(tools, req.tool_choice, req.parallel_tool_calls, thinking, think_end_id, checked)
    if fmt is not None and calls is not None:
        raise invalid("'response_format' and 'tool_choice' (or strict tools) both constrain the output; "
                      "give one of them", "response_format")
    return fmt if fmt is not None else calls
