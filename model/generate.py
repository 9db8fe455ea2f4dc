"""One request, one process: chunked prefill then decode — the reference output of invariant 1.

Every serving path (batched, disaggregated, migrated, retried) must reproduce exactly the
tokens this loop produces for the same prompt and sampling parameters. With
`speculative_tokens` > 0 it decodes speculatively through the MTP block (`model/speculation.py`),
which changes how many forwards it takes, never the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model import speculation
from model.batch import ForwardBatch
from model.kv_pool import KVPools, SeqKV
from model.penalties import History
from model.sampling import SamplingParams, sample, sample_rows
from model.transformer import Transformer


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS / stop token) or "length"
    logits: torch.Tensor | None  # [len(token_ids), vocab] float32: what each token was sampled from
    proposed: int = 0  # drafted tokens verified (speculative decoding)
    accepted: int = 0  # of which the target's own


def generate(model: Transformer, pools: KVPools, prompt: list[int], max_new_tokens: int,
             params: SamplingParams, chunk_size: int | None = None, stop_ids: frozenset[int] = frozenset(),
             keep_logits: bool = False, speculative_tokens: int = 0) -> Generation:
    if not prompt:
        raise ValueError("prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if speculation.check_depth(speculative_tokens):
        speculation.check_model(model, pools)
    seq = SeqKV()
    pools.reserve(seq, len(prompt) + max_new_tokens - 1)
    tokens: list[int] = []
    kept: list[torch.Tensor] = []
    proposed = accepted = 0

    stops = tuple(sorted(stop_ids))

    def history(extra: tuple[int, ...] = ()) -> History | None:
        return History(tuple(prompt), tuple(tokens) + extra, stops) if params.adjusts else None

    def done(reason: str) -> Generation:
        return Generation(tokens, reason, torch.stack(kept) if keep_logits else None, proposed, accepted)

    try:
        step = chunk_size or len(prompt)
        for start in range(0, len(prompt), step):
            logits = _step(model, pools, seq, prompt[start:start + step])
        new = [sample(logits[0], params, position=seq.num_tokens, history=history())]
        while True:
            for i, token in enumerate(new):
                tokens.append(token)
                if keep_logits:
                    kept.append(logits[i].float().cpu())
                if token in stop_ids:
                    return done("stop")
                if len(tokens) == max_new_tokens:
                    return done("length")
            depth = min(speculative_tokens, max_new_tokens - len(tokens) - 1)
            if not speculative_tokens:
                logits = _step(model, pools, seq, [tokens[-1]])
                new = [sample(logits[0], params, position=seq.num_tokens, history=history())]
                continue
            logits, new = _speculate(model, pools, seq, tokens[-1], depth, params, history)
            proposed += depth
            accepted += len(new) - 1
    finally:
        pools.release(seq)


def _step(model: Transformer, pools: KVPools, seq: SeqKV, tokens: list[int]) -> torch.Tensor:
    batch = ForwardBatch.build([(seq, tokens)], device=pools.device)
    logits = model(batch, pools)
    batch.commit()
    pools.trim_window(seq)
    return logits


def _speculate(model: Transformer, pools: KVPools, seq: SeqKV, last: int, depth: int, params: SamplingParams,
               history):
    """One draft → verify → accept step: (the verify's logits [depth+1, vocab], the tokens emitted).
    Verify row j samples as if drafts[:j] were accepted: `history(drafts[:j])` is its output so far."""
    pending = speculation.draft(model, pools, [(seq, last, depth, params)])[0]
    batch = ForwardBatch.build([(seq, pending.tokens)], device=pools.device)
    logits, streams = model(batch, pools, all_logits=True, return_streams=True)
    batch.commit()
    targets = sample_rows(logits, [params] * (depth + 1), list(range(pending.start + 1, pending.start + depth + 2)),
                          histories=[history(pending.drafts[:j]) for j in range(depth + 1)])
    new = speculation.settle(pools, [pending], [targets], streams, [0])[0]
    pools.trim_window(seq)
    return logits, new
