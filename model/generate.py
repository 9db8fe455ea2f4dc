"""One request, one process: chunked prefill then decode — the reference output of invariant 1.

Every serving path (batched, disaggregated, migrated, retried) must reproduce exactly the
tokens this loop produces for the same prompt and sampling parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.batch import ForwardBatch
from model.kv_pool import KVPools, SeqKV
from model.sampling import SamplingParams, sample
from model.transformer import Transformer


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS / stop token) or "length"
    logits: torch.Tensor | None  # [len(token_ids), vocab] float32: what each token was sampled from


def generate(model: Transformer, pools: KVPools, prompt: list[int], max_new_tokens: int,
             params: SamplingParams, chunk_size: int | None = None, stop_ids: frozenset[int] = frozenset(),
             keep_logits: bool = False) -> Generation:
    if not prompt:
        raise ValueError("prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    seq = SeqKV()
    pools.reserve(seq, len(prompt) + max_new_tokens - 1)
    tokens: list[int] = []
    kept: list[torch.Tensor] = []
    try:
        step = chunk_size or len(prompt)
        for start in range(0, len(prompt), step):
            logits = _step(model, pools, seq, prompt[start:start + step])
        while True:
            token = sample(logits[0], params, position=seq.num_tokens)
            tokens.append(token)
            if keep_logits:
                kept.append(logits[0].float().cpu())
            if token in stop_ids:
                return Generation(tokens, "stop", torch.stack(kept) if keep_logits else None)
            if len(tokens) == max_new_tokens:
                return Generation(tokens, "length", torch.stack(kept) if keep_logits else None)
            logits = _step(model, pools, seq, [token])
    finally:
        pools.release(seq)


def _step(model: Transformer, pools: KVPools, seq: SeqKV, tokens: list[int]) -> torch.Tensor:
    batch = ForwardBatch.build([(seq, tokens)], device=pools.device)
    logits = model(batch, pools)
    batch.commit()
    pools.trim_window(seq)
    return logits
