"""Per-request logit adjustments before sampling: logit_bias, min_tokens, repetition_penalty,
presence_penalty and frequency_penalty (vLLM's order: the first two, then the penalties).

* `logit_bias`: token id → a value added to its logit (OpenAI).
* `min_tokens`: until the request has generated that many tokens, its stop ids (EOS unless
  ignored, and `stop_token_ids`) are masked to -inf (vLLM).
* `repetition_penalty` r (HF / vLLM): every token of the prompt or the output so far has its logit
  divided by r when positive, multiplied by r when not.
* `presence_penalty` p, `frequency_penalty` f (OpenAI): a token that occurs c > 0 times in the
  output so far loses p + c·f.

Each is a function of the row's logits and the request's own prompt and output alone, applied
elementwise per row (no reduction), so a row's result does not depend on the batch, and it runs
on the logits' device, the same ops on the CPU and the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGIT_BIAS = 300


@dataclass(frozen=True)
class History:
    """What one row's adjustments read: the request's prompt, its output before this token, and the
    ids `min_tokens` masks."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    stop_ids: tuple[int, ...] = ()


def adjust(logits: torch.Tensor, params: list, histories: list[History | None]) -> torch.Tensor:
    """logits [R, V] → fp32 logits with each row's adjustments applied (rows whose params are
    neutral are left as they are). `params[i]` is a SamplingParams; a row that needs its history
    must have one."""
    rows = [i for i, p in enumerate(params) if p.adjusts]
    if not rows:
        return logits
    out = logits.float().clone()
    dev, vocab = out.device, out.shape[-1]
    for i in rows:
        p, h = params[i], histories[i]
        if h is None:
            raise ValueError("a request with penalties, logit_bias or min_tokens was sampled without its history")
        row = out[i]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=dev)
            row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=dev))
        if len(h.output) < p.min_tokens and h.stop_ids:
            row[torch.tensor(h.stop_ids, device=dev)] = float("-inf")
        if p.repetition_penalty != 1:
            seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
            seen[torch.tensor(h.prompt + h.output, dtype=torch.long, device=dev)] = True
            r = p.repetition_penalty
            row.copy_(torch.where(seen, torch.where(row > 0, row / r, row * r), row))
        if (p.presence_penalty or p.frequency_penalty) and h.output:
            counts = torch.bincount(torch.tensor(h.output, device=dev), minlength=vocab)[:vocab].float()
            row.sub_(counts * p.frequency_penalty + (counts > 0).float() * p.presence_penalty)
    return out
