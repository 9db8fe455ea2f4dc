"""The OpenAI `logprobs` objects of a choice, from the `TokenLogprobs` the workers send.

Chat (`logprobs: true`, `top_logprobs: k`): {"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}. Completions (`logprobs: k`):
{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}, ...], "text_offset"}, the top
list holding the sampled token too, as OpenAI's legacy endpoint does. A token's text is its own
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
        top = {_piece(tokenizer, t): v for t, v in lp.top}
        top.setdefault(_piece(tokenizer, lp.token), lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": tops,
            "text_offset": offsets}
