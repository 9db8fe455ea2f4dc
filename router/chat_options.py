"""A chat request's choices that shape its prompt and its parsing: thinking mode, reasoning
effort and the tools offered, each checked, with conflicting or unsupported values refused.

- Thinking: `chat_template_kwargs.thinking` or `.enable_thinking` (as vLLM and SGLang accept
  them for DeepSeek-V4), or the `thinking_mode` extension; they must agree when several are set.
  `reasoning_effort` is one of V4's thinking efforts, "high" (the default) or "max"; naming one
  turns thinking on, and asking for it with thinking turned off is refused.
- Tools: offered when `tools` is set and `tool_choice` is "auto" (its default then), "required"
  or a named function (which must be among `tools`). With `tool_choice` "none" the model is not
  shown the tools. "required", a named function, `strict` functions and `parallel_tool_calls:
  false` are enforced by grammar-constrained decoding (`router/response_format.py` builds the
  grammar: the output is a DSML tool-call block whose arguments validate against each function's
  schema; a named function is called exactly once).
"""

from __future__ import annotations

from router.chat_encoding import REASONING_EFFORTS
from router.errors import invalid
from router.request_models import ChatCompletionRequest


def chat_mode(req: ChatCompletionRequest) -> tuple[bool, str | None, bool]:
    """(thinking, reasoning effort, drop earlier turns' reasoning); also for a /tokenize chat body,
    which has the same fields."""
    kw = req.chat_template_kwargs
    said = []  # (field, thinking?)
    if kw is not None:
        said += [(f"chat_template_kwargs.{k}", v) for k, v in (("thinking", kw.thinking),
                                                                ("enable_thinking", kw.enable_thinking))
                 if v is not None]
    if req.thinking_mode is not None:
        said.append(("thinking_mode", req.thinking_mode == "thinking"))
    if len({v for _, v in said}) > 1:
        raise invalid(f"{' and '.join(f for f, _ in said)} disagree on thinking mode", said[-1][0])
    thinking = said[0][1] if said else None
    effort = req.reasoning_effort
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise invalid(f"'reasoning_effort' must be one of {', '.join(map(repr, REASONING_EFFORTS))} "
                          f"(DeepSeek-V4's thinking efforts), got {effort!r}", "reasoning_effort")
        if thinking is False:
            raise invalid(f"'reasoning_effort' needs thinking mode, which {said[0][0]} turns off",
                          "reasoning_effort")
        thinking = True
    drop = kw.drop_thinking if kw is not None and kw.drop_thinking is not None else True
    return bool(thinking), effort, drop


def tools_offered(req: ChatCompletionRequest) -> list | None:
    """The tools to show the model (None: none), after refusing what cannot be honoured."""
    choice = req.tool_choice
    if choice is not None and choice != "none" and not req.tools:
        raise invalid("'tool_choice' needs 'tools'", "tool_choice")
    if choice is not None and not isinstance(choice, str) and all(
            t.function.name != choice.function.name for t in req.tools):
        raise invalid(f"'tool_choice' names function '{choice.function.name}', which is not among 'tools'",
                      "tool_choice.function.name")
    names = [t.function.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise invalid("'tools' names a function twice", "tools")
    if not req.tools or choice == "none":
        return None
    return req.tools
