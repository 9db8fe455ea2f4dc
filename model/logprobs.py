"""Log-probabilities of sampled tokens and of each row's most likely ones (OpenAI's `logprobs`).

The values are the log-softmax of the model's raw logits: before temperature, top-k / top-p,
penalties and logit_bias (vLLM's default, `raw_logprobs`), so they are the model's own
distribution whatever the request's sampling controls. Each row is reduced on its own with the
batch-invariant pairwise sum (`model/kernels/common/invariant.py`), so a token's logprob has the
same bits alone or batched; only the few values asked for reach the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.kernels.common import invariant

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's logprob and the `top` most likely tokens' (id, logprob), best first
    (ties: lower id first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax along the last dim, in fp32, each row by itself in a fixed order."""
    x = logits.float()
    shifted = x - x.amax(-1, keepdim=True)
    return shifted - torch.log(invariant.sum(torch.exp(shifted), -1, keepdim=True))


def token_logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int | None]) -> list[TokenLogprobs | None]:
    """logits [R, V], the token drawn at each row, and how many top alternatives each row wants
    (0..MAX_TOP_LOGPROBS; None: no logprobs for that row) → a TokenLogprobs per row that asked,
    None elsewhere. The rows that ask are reduced together; one copy to the host."""
    assert logits.dim() == 2 and logits.shape[0] == len(tokens) == len(tops), (logits.shape, len(tokens))
    asked = [i for i, k in enumerate(tops) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    if not asked:
        return out
    lp = log_softmax(logits[asked] if len(asked) < len(tokens) else logits)
    chosen = lp.gather(-1, torch.tensor([tokens[i] for i in asked], device=lp.device)[:, None]).squeeze(-1)
    k = min(max(tops[i] for i in asked), lp.shape[-1])
    values, ids = invariant.top_k(lp, k) if k else (lp[:, :0], lp[:, :0].long())
    for i, c, v, t in zip(asked, chosen.tolist(), values.tolist(), ids.tolist()):
        n = tops[i]
        out[i] = TokenLogprobs(tokens[i], c, tuple(zip(t[:n], v[:n])))
    return out


# --- prompt logprobs (echo) ---------------------------------------------------------------
# A request asking for its prompt's logprobs needs the logits at every prompt position, not only
# at each segment's last token: `logit_rows` widens the head to those rows for the segments that
# ask (and only when one does), `prompt_logprobs` turns one segment's rows into the logprobs of
# the prompt tokens they predict.

def logit_rows(segments, wants: list[bool]) -> tuple[list[int] | None, list[int]]:
    """The token rows to run the LM head on (for `Transformer.forward(logit_rows=...)`) and, per
    segment, the index of its last row among them. None when no segment wants every row: then the
    head runs on the last rows alone, as without prompt logprobs."""
    if not any(wants):
        return None, list(range(len(segments)))
    rows, last = [], []
    for s, w in zip(segments, wants):
        rows += range(s.offset, s.offset + s.length) if w else [s.offset + s.length - 1]
        last.append(len(rows) - 1)
    return rows, last


def prompt_logprobs(logits: torch.Tensor, prompt: tuple[int, ...], start: int, top: int) -> list[TokenLogprobs]:
    """Logits [n, V] at prompt positions start..start+n-1 → the TokenLogprobs of the prompt tokens
    they predict (start+1.., those inside the prompt: the last position predicts the first new
    token, not a prompt token)."""
    targets = list(prompt[start + 1:start + 1 + logits.shape[0]])
    if not targets:
        return []
    return token_logprobs(logits[:len(targets)], targets, [top] * len(targets))
