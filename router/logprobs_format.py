"""The OpenAI `logprobs` objects of a choice, from the `TokenLogprobs` the workers send.

Chat (`logprobs: true`, `top_logprobs: k`): {"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}. Completions (`logprobs: k`):
{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}, ...], "text_offset"}, the top
list holding the sampled token too, as OpenAI's legacy endpoint does (tokens of the same text, such
as byte pieces of one character, share a key: it keeps the best one's value). A token's text is its own
decoding (a byte-level piece of a character shows as U+FFFD; `bytes` carries the exact UTF-8).
The values are the model's raw log-softmax (model/logprobs.py).
"""

from __future__ import annotations

from model.logprobs import TokenLogprobs


def _piece(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def chat_entries(tokenizer, lps) -> list[dict]:
    def one(token: int, logprob: float) -> dict:
        text = _piece(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return [{**one(lp.token, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]} for lp in lps]


def completion_logprobs(tokenizer, lps: list[TokenLogprobs], offset: int) -> dict:
    """`offset`: characters of the completion's text before these tokens (for `text_offset`)."""
    tokens, offsets = [], []
    for lp in lps:
        tokens.append(_piece(tokenizer, lp.token))
        offsets.append(offset)
        offset += len(tokens[-1])
    tops = []
    for lp in lps:
        top: dict[str, float] = {}
        for t, v in lp.top:  # best first: a text several tokens decode to keeps the best one's value
            top.setdefault(_piece(tokenizer, t), v)
        top.setdefault(_piece(tokenizer, lp.token), lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": tops,
            "text_offset": offsets}


def prompt_logprobs(tokenizer, prompt_ids, lps: list[TokenLogprobs] | None, offset: int) -> dict:
    """The completions `logprobs` object of an echoed prompt: every prompt token, the first with
    logprob and top_logprobs null (it has no context), as vLLM and OpenAI's legacy endpoint do.
    `lps`: the TokenLogprobs of prompt tokens 1.. from the worker."""
    if lps is None or len(lps) != len(prompt_ids) - 1:
        raise ValueError(f"{0 if lps is None else len(lps)} prompt logprobs for a prompt of {len(prompt_ids)} tokens")
    rest = completion_logprobs(tokenizer, lps, offset + len(_piece(tokenizer, prompt_ids[0])))
    return {"tokens": [_piece(tokenizer, prompt_ids[0])] + rest["tokens"],
            "token_logprobs": [None] + rest["token_logprobs"], "top_logprobs": [None] + rest["top_logprobs"],
            "text_offset": [offset] + rest["text_offset"]}


def joined(a: dict, b: dict) -> dict:
    """Two completions `logprobs` objects of consecutive tokens as one."""
    return {k: a[k] + b[k] for k in a}
