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
  rows for the step's positions are copied before drafting (`Snapshot`, one per step) and put
  back for every rejected position; the MTP slot takes the main streams at the last kept position.

A chain writes the MTP layer at positions n-1..n+k-2 with drafted inputs; the verify's forward
rewrites n-1..n+k-1 from the main streams (`Transformer.extend_mtp`), and the roll-back restores
the MTP layer's rows from position n+a on, which it holds for n+a+1 cached tokens.
"""

from __future__ import annotations

from collections.abc import Callable
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
    """The compress-state ring rows of a step's drafting requests at positions [n_r - 1,
    n_r - 1 + width) (n_r: request r's cached tokens), every layer: one gather per kind to take,
    one scatter per kind to restore, whatever the batch."""

    pages: dict[str, torch.Tensor]  # kind → [R] each request's ring page
    positions: torch.Tensor  # [R, width] int64
    rows: dict[str, torch.Tensor]  # kind → [R, layers, width, entry_bytes] uint8
    slots: torch.Tensor  # [R] each request's MTP slot page (`state_mtp`)

    @classmethod
    def take(cls, pools: KVPools, seqs: list[SeqKV], width: int) -> Snapshot:
        kinds = [k for k in RING_KINDS if k in pools.kinds_for()]
        # one host → device copy for every index the step's drafting and roll-back need
        flat = torch.tensor([s.num_tokens - 1 for s in seqs] + [s.pages[k][0] for k in (*kinds, "state_mtp")
                                                                for s in seqs], device=pools.device)
        first, *pages, slots = flat.split(len(seqs))
        positions = first[:, None] + torch.arange(width, device=flat.device)
        pages = dict(zip(kinds, pages))
        rows = {k: _ring_view(pools, k)[_ring_index(pools, k, pages[k], positions)] for k in kinds}
        return cls(pages, positions, rows, slots)

    def restore(self, pools: KVPools, rows: list[int], main_from: list[int], slot_rows: list[int],
                streams: torch.Tensor) -> None:
        """Put back, for each snapshot row `rows[i]`, the entries of positions >= main_from[i] in
        the main layers and >= main_from[i] - 1 in the MTP layer (which lags by one), and set its
        MTP slot to the main streams `streams[slot_rows[i]]` (the last kept position's)."""
        device = self.positions.device
        r, keep, at = torch.tensor([*rows, *main_from, *slot_rows], device=device).split(len(rows))
        positions = self.positions[r]
        for kind, saved in self.rows.items():
            layers = pools.specs[kind].layers
            mtp = layers.index(pools.mtp_layer) if pools.mtp_layer in layers else -1
            first = keep[:, None] - (torch.arange(len(layers), device=device) == mtp).long()[None, :]  # [n, layers]
            back = (positions[:, None, :] >= first[:, :, None])[..., None]  # [n, layers, width, 1]
            view, index = _ring_view(pools, kind), _ring_index(pools, kind, self.pages[kind][r], positions)
            view[index] = torch.where(back, saved[r], view[index])
        pools.write_slots("state_mtp", self.slots[r], streams[at.to(streams.device)])


def _ring_view(pools: KVPools, kind: str) -> torch.Tensor:
    """The ring pool `kind` as [pages, layers, entries_per_page, entry_bytes] uint8."""
    spec = pools.specs[kind]
    return pools.buffers[kind].view(-1, len(spec.layers), spec.entries_per_page, spec.entry_bytes)


def _ring_index(pools: KVPools, kind: str, pages: torch.Tensor, positions: torch.Tensor) -> tuple:
    """Advanced index of `_ring_view` for pages [R] at positions [R, W], every layer: → [R, layers, W, bytes]."""
    spec = pools.specs[kind]
    layers = torch.arange(len(spec.layers), device=pages.device)
    return pages[:, None, None], layers[None, :, None], (positions % spec.entries_per_page)[:, None, :]


@dataclass(frozen=True)
class Pending:
    """One request's speculative step between drafting and accepting."""

    seq: SeqKV
    start: int  # n: cached tokens before the step
    last: int  # x_n
    drafts: tuple[int, ...]
    params: SamplingParams
    snapshot: Snapshot | None  # the step's ring rows (shared by the step's requests; None: nothing drafted)
    row: int = -1  # this request's row in `snapshot`
    binding: bool = True  # False: the drafts are placeholders, never accepted (the verify keeps t_0 alone)

    @property
    def tokens(self) -> list[int]:
        """The verify segment: x_n and the drafts."""
        return [self.last, *self.drafts]


def draft(model: Transformer, pools: KVPools, requests: list[tuple[SeqKV, int, int, SamplingParams]],
          graph_for: Callable[[int], object | None] | None = None) -> list[Pending]:
    """Draft up to `depth` tokens for each (seq, last token, depth, sampling) with the MTP block,
    chained, all requests in one MTP step per draft. Every drafting request's ring rows for the
    step are saved first (one `Snapshot`), so that `settle` can undo what the drafts and the
    verify write. `graph_for(rows)`: a captured draft step (`model.cuda_graph.DecodeGraph` with
    `draft=True`) of at least that many rows, or None to run the block eagerly."""
    depths = [depth for _, _, depth, _ in requests]
    drafting = [i for i, d in enumerate(depths) if d > 0]
    snapshot = Snapshot.take(pools, [requests[i][0] for i in drafting], max(depths) + 2) if drafting else None
    row = {i: r for r, i in enumerate(drafting)}
    drafts: list[list[int]] = [[] for _ in requests]
    live, streams = drafting, None
    for k in range(max(depths, default=0)):
        if k == 0:
            streams = pools.read_slots("state_mtp", snapshot.slots).view(len(live), model.cfg.hc_mult,
                                                                       model.cfg.hidden_size)
        seqs = [requests[i][0] for i in live]
        graph = graph_for(len(live)) if graph_for is not None else None
        # a graph reads the batch's segments and host ids only: no device copy of them
        batch = ForwardBatch.build([(SeqKV(s.pages, s.num_tokens - 1 + k), [drafts[i][-1] if k else requests[i][1]])
                                    for s, i in zip(seqs, live)], "cpu" if graph is not None else pools.device)
        if graph is not None:
            graph.streams_in[: len(live)] = streams
            logits, out = graph.run(batch), graph.streams[: len(live)]
        else:
            logits, out = model.mtp_step(streams.to(model.embed.weight.dtype), batch, pools)
        # drafts are proposals: the verify applies a request's penalties exactly, so they draw without
        tokens = sample_rows(logits, [requests[i][3].unadjusted for i in live],
                             [s.num_tokens + 1 + k for s in seqs])
        for i, t in zip(live, tokens):
            drafts[i].append(t)
        keep = [j for j, i in enumerate(live) if depths[i] > k + 1]
        if not keep:
            break
        # (a graph's output is copied into its input before the next replay rewrites it)
        streams = out if len(keep) == len(live) else out[torch.tensor(keep, device=out.device)]
        live = [live[j] for j in keep]
    return [Pending(seq, seq.num_tokens, last, tuple(drafts[i]), params, snapshot if i in row else None, row.get(i, -1))
            for i, (seq, last, _, params) in enumerate(requests)]


def accepted(drafts: tuple[int, ...], targets: list[int]) -> int:
    """How many leading drafts equal the target's own tokens (targets has one more entry)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def settle(pools: KVPools, pending: list[Pending], targets: list[list[int]], streams: torch.Tensor,
           offsets: list[int]) -> list[list[int]]:
    """After the verify's forward (committed) and the targets sampled from its rows: roll each
    request back to its kept tokens and return the tokens each emits (t_0..t_a). `streams`: the
    verify's main streams [T, hc, D]; `offsets`: each request's first row in them. Every roll-back
    of the step is one restore and one slot write."""
    emitted, back, back_from, slot_rows = [], [], [], []
    for p, t, offset in zip(pending, targets, offsets):
        a = accepted(p.drafts, t) if p.binding else 0
        kept = p.start + a + 1
        if kept < p.seq.num_tokens:
            back.append(p)
            back_from.append(kept)
            slot_rows.append(offset + a)
            p.seq.num_tokens = kept
        emitted.append(t[: a + 1])
    if back:
        snapshot = back[0].snapshot
        if any(p.snapshot is not snapshot for p in back):
            raise ValueError("settle takes the requests of one draft step (one snapshot)")
        snapshot.restore(pools, [p.row for p in back], back_from, slot_rows, streams)
    return emitted
