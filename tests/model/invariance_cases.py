"""Shared pieces of the invariance tests (invariant 1): a tiny model whose indexer ties are real,
long prompts, the reference a request is held to, and a model stand-in that records, request by
request, the logits the engines sample from.

`index_topk` is 16 here, so prompts of 600+ tokens give each late query 150+ causal entries for
16 picks, and ReLU's zero scores make exact ties at the 16th score common."""

from __future__ import annotations

import random
from collections import defaultdict

import torch

from model.generate import generate
from model.kv_pool import KVPools
from model.tiny import random_weights, tiny_config
from model.transformer import Transformer
from worker_runtime.wire import GenerateRequest

TIE_TOPK = 16


def tie_model(seed: int = 0) -> Transformer:
    cfg = tiny_config(index_topk=TIE_TOPK)
    model = Transformer(cfg)
    model.load_state_dict(random_weights({k: v.shape for k, v in model.state_dict().items()}, cfg, seed))
    return model


def long_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


def reference(model: Transformer, req: GenerateRequest, fmt: str = "fp32", chunk_size: int | None = None):
    """`v4serve generate`'s answer for the request alone: (tokens, logits [tokens, vocab])."""
    pools = KVPools(model.cfg, fmt, max_tokens=len(req.prompt_ids) + req.max_tokens, max_seqs=1)
    stop = frozenset() if req.ignore_eos else frozenset({model.cfg.eos_token_id})
    out = generate(model, pools, list(req.prompt_ids), req.max_tokens, req.sampling, chunk_size=chunk_size,
                   stop_ids=stop, keep_logits=True)
    return out.token_ids, out.logits


class LogitRecorder:
    """Stands in for the model in prefill and decode engines: runs it and keeps, per request, the
    logits of each row that samples a token (a prompt's last chunk, every decode row), in order.
    `engines` (filled after they are built) say which request a segment's pages belong to."""

    def __init__(self, model: Transformer):
        self.model = model
        self.engines: list = []
        self.rows: dict[str, list[torch.Tensor]] = defaultdict(list)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, batch, pools):
        logits = self.model(batch, pools)
        owners = {id(job.seq): job.req for e in self.engines for job in e.running.values() if job.seq is not None}
        for i, seg in enumerate(batch.segments):
            req = owners[id(seg.seq)]
            if seg.end >= len(req.prompt_ids):
                self.rows[req.request_id].append(logits[i].clone())
        return logits

    def logits(self, request_id: str) -> torch.Tensor:
        return torch.stack(self.rows[request_id])


def assert_same_as_alone(model: Transformer, recorder: LogitRecorder, got: dict[str, list[int]],
                         reqs: list[GenerateRequest], fmt: str = "fp32") -> None:
    """Every request's tokens and logits, bit for bit, are those of `generate` alone (a decode step
    queued ahead of its last token's arrival on the host, `decode_worker/overlap.py`, adds at most
    one row after them, whose token is dropped)."""
    for r in reqs:
        tokens, logits = reference(model, r, fmt)
        assert got[r.request_id] == tokens, r.request_id
        recorded = recorder.logits(r.request_id)
        assert len(logits) <= len(recorded) <= len(logits) + 1, r.request_id
        assert torch.equal(recorded[: len(logits)], logits), r.request_id
