"""Speculative decoding with the MTP block that never changes the output.

A request at n cached tokens whose last sampled token x_n is fed next takes one step as:

* **draft**: the MTP block at position n-1 on the main streams there (the `state_mtp` slot) and
  x_n gives d_1; chained, the block at n on its own output streams and d_1 gives d_2, and so on
  up to the request's depth. Drafts are drawn with the target's own sampler at the positions the
  target will sample them (same seed, same noise), so a draft close to the target agrees with it.
* **verify**: x_n, d_1..d_k through the model in one segment at positions n..n+k; row i's
  logits sample the target's token t_i at position n+1+i, exactly as a single step would.
* **accept**: the longest prefix with d_{i+1} = t_i; the tokens emitted are t_0..t_a (the first
  mismatch, or the token after the last draft, is the target's own). Since sampling is a pure
  function of (logits, seed, position), and the reference path's logits are the same bits for a
  row alone or among others, the tokens are those of decoding without speculation.
* **roll back**: the request keeps n+a+1 tokens. KV entries of the rejected positions (SWA and
  compressed) are rewritten before any later query can read them, but the compress-state rings
  (`state_c4`, `state_c4_indexer`, `state_c128`) lose the rows those positions overwrote: their
  rows for the step's positions are copied before drafting (`Pending.snapshot`) and put back for
  every rejected position; the MTP slot takes the main streams at the last kept position.

A chain writes the MTP layer at positions n-1..n+k-2 with drafted inputs; the verify's forward
rewrites n-1..n+k-1 from the main streams (`Transformer.extend_mtp`), and the roll-back restores
the MTP layer's rows from position n+a on, which it holds for n+a+1 cached tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.batch import ForwardBatch
from model.kv_pool import KVPools, SeqKV
from model.sampling import SamplingParams, sample_rows
from model.transformer import Transformer

MAX_SPECULATIVE_TOKENS = 3
RING_KINDS = ("state_c4", "state_c4_indexer", "state_c128")


def check_depth(speculative_tokens: int) -> int:
    if not 0 <= speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative tokens must be in 0..{MAX_SPECULATIVE_TOKENS} (0: off), "
                         f"got {speculative_tokens}")
    return speculative_tokens


def check_model(model: Transformer, pools: KVPools) -> None:
    """Speculation needs the MTP block and its layer in the pools."""
    if not model.mtp:
        raise ValueError("speculative decoding needs the model's MTP block (load it with with_mtp=True; the "
                         "checkpoint must have mtp.* tensors and num_nextn_predict_layers >= 1)")
    if not pools.with_mtp:
        raise ValueError("speculative decoding needs KV pools with the MTP layer (KVPools(..., with_mtp=True))")


@dataclass(frozen=True)
class Snapshot:
    """The compress-state ring rows of one request for positions [first, end), every layer."""

    first: int
    end: int
    rows: dict[str, torch.Tensor]  # kind → [layers, positions, entry_bytes] uint8

    @classmethod
    def take(cls, pools: KVPools, seq: SeqKV, first: int, end: int) -> Snapshot:
        rows = {}
        for kind in RING_KINDS:
            if kind in pools.kinds_for():
                view, idx = _ring_view(pools, seq, kind, first, end)
                rows[kind] = view[:, idx].clone()
        return cls(first, end, rows)

    def restore(self, pools: KVPools, seq: SeqKV, main_from: int) -> None:
        """Put back the rows of positions >= main_from in the main layers and >= main_from - 1 in
        the MTP layer (which lags by one)."""
        for kind, saved in self.rows.items():
            view, idx = _ring_view(pools, seq, kind, self.first, self.end)
            layers = torch.tensor(pools.specs[kind].layers, device=saved.device)
            first = torch.full_like(layers, main_from)
            if pools.mtp_layer is not None:
                first = torch.where(layers == pools.mtp_layer, main_from - 1, first)
            positions = torch.arange(self.first, self.end, device=saved.device)
            back = (positions[None, :] >= first[:, None])[..., None]
            view[:, idx] = torch.where(back, saved, view[:, idx])


def _ring_view(pools: KVPools, seq: SeqKV, kind: str, first: int, end: int):
    spec = pools.specs[kind]
    page = pools.buffers[kind][seq.pages[kind][0]]
    view = page.view(len(spec.layers), spec.entries_per_page, spec.entry_bytes)
    return view, torch.arange(first, end, device=page.device) % spec.entries_per_page


@dataclass(frozen=True)
class Pending:
    """One request's speculative step between drafting and accepting."""

    seq: SeqKV
    start: int  # n: cached tokens before the step
    last: int  # x_n
    drafts: tuple[int, ...]
    params: SamplingParams
    snapshot: Snapshot

    @property
    def tokens(self) -> list[int]:
        """The verify segment: x_n and the drafts."""
        return [self.last, *self.drafts]


def draft(model: Transformer, pools: KVPools, requests: list[tuple[SeqKV, int, int, SamplingParams]]
          ) -> list[Pending]:
    """Draft up to `depth` tokens for each (seq, last token, depth, sampling) with the MTP block,
    chained, all requests in one MTP step per draft. Every request's ring rows for the step are
    saved first, so that `settle` can undo what the drafts and the verify write."""
    out = [Pending(seq, seq.num_tokens, last, (), params,
                   Snapshot.take(pools, seq, seq.num_tokens - 1, seq.num_tokens + depth + 1) if depth
                   else Snapshot(0, 0, {}))
           for seq, last, depth, params in requests]
    depths = [depth for _, _, depth, _ in requests]
    drafts: list[list[int]] = [[] for _ in requests]
    live = [i for i, d in enumerate(depths) if d > 0]
    streams = None
    for k in range(max(depths, default=0)):
        if k == 0:
            layer = pools.mtp_layer
            zero = torch.zeros(1, dtype=torch.long, device=pools.device)
            streams = torch.stack([pools.read("state_mtp", layer, out[i].seq.pages["state_mtp"], zero)
                                   .view(model.cfg.hc_mult, model.cfg.hidden_size) for i in live])
        items = [(SeqKV(out[i].seq.pages, out[i].start - 1 + k), [drafts[i][-1] if k else out[i].last])
                 for i in live]
        logits, streams = model.mtp_step(streams.to(model.embed.weight.dtype), ForwardBatch.build(items, pools.device),
                                         pools)
        # drafts are proposals: the verify applies a request's penalties exactly, so they draw without
        tokens = sample_rows(logits, [out[i].params.unadjusted for i in live], [out[i].start + 1 + k for i in live])
        for i, t in zip(live, tokens):
            drafts[i].append(t)
        keep = [j for j, i in enumerate(live) if depths[i] > k + 1]
        live = [live[j] for j in keep]
        streams = streams[keep]
        if not live:
            break
    return [Pending(p.seq, p.start, p.last, tuple(d), p.params, p.snapshot) for p, d in zip(out, drafts)]


def accepted(drafts: tuple[int, ...], targets: list[int]) -> int:
    """How many leading drafts equal the target's own tokens (targets has one more entry)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def settle(pools: KVPools, p: Pending, targets: list[int], streams: torch.Tensor) -> list[int]:
    """After the verify's forward (committed) and the targets sampled from its rows: roll the
    request back to its kept tokens and return the tokens it emits (t_0..t_a). `streams`: the
    verify segment's main streams [k+1, hc, D]."""
    a = accepted(p.drafts, targets)
    kept = p.start + a + 1
    if kept < p.seq.num_tokens:
        p.snapshot.restore(pools, p.seq, kept)
        p.seq.num_tokens = kept
        zero = torch.zeros(1, dtype=torch.long, device=streams.device)
        pools.write("state_mtp", pools.mtp_layer, p.seq.pages["state_mtp"], zero, streams[a].reshape(1, -1))
    return targets[: a + 1]
