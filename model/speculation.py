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

A step can run on the device from end to end (`draft(on_device=True)`, `settle_chain`): each
draft is drawn there and fed to the next MTP step, the verify reads its segments there, the
accepted counts are compared there and the roll-back covers every request whatever it accepted.
Nothing in the step waits for the host, which learns the targets and the counts in one copy at
its end: the GPU runs the drafts, the verify and the roll-back back to back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from model.batch import ForwardBatch, to_device
from model.kernels.attention import ring_rows
from model.kv_pool import KVPools, SeqKV
from model.sampling import SamplingParams, draw_rows, sample_rows
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
    one scatter per kind to restore, whatever the batch (`kernels/attention/ring_rows.py`, on
    the model's kernels `impl`)."""

    pages: dict[str, torch.Tensor]  # kind → [R] each request's ring page
    positions: torch.Tensor  # [R, width] int64
    rows: dict[str, torch.Tensor]  # kind → [R, layers, width, words] (`ring_rows.words`)
    slots: torch.Tensor  # [R] each request's MTP slot page (`state_mtp`)
    impl: str = "torch"

    @classmethod
    def take(cls, pools: KVPools, seqs: list[SeqKV], width: int, first: torch.Tensor | None = None,
             impl: str = "torch") -> Snapshot:
        """`first` [R] int64 on the device: the first positions when the host does not know them
        (a step queued ahead, `draft_ahead`), else each seq's num_tokens - 1."""
        kinds = [k for k in RING_KINDS if k in pools.kinds_for()]
        # one host → device copy for every index the step's drafting and roll-back need
        known = [] if first is not None else [s.num_tokens - 1 for s in seqs]
        flat = to_device(known + [s.pages[k][0] for k in (*kinds, "state_mtp") for s in seqs], pools.device,
                         torch.int64)
        if first is None:
            first, *pages, slots = flat.split(len(seqs))
        else:
            *pages, slots = flat.split(len(seqs))
        positions = first[:, None] + torch.arange(width, device=flat.device)
        pages = dict(zip(kinds, pages))
        rows = {k: ring_rows.take(_ring_view(pools, k), pages[k], positions, impl) for k in kinds}
        return cls(pages, positions, rows, slots, impl)

    def restore(self, pools: KVPools, rows: list[int], main_from: list[int], slot_rows: list[int],
                streams: torch.Tensor) -> None:
        """Put back, for each snapshot row `rows[i]`, the entries of positions >= main_from[i] in
        the main layers and >= main_from[i] - 1 in the MTP layer (which lags by one), and set its
        MTP slot to the main streams `streams[slot_rows[i]]` (the last kept position's)."""
        r, keep, at = to_device([*rows, *main_from, *slot_rows], self.positions.device).split(len(rows))
        self.restore_rows(pools, r, keep, at, streams)

    def restore_rows(self, pools: KVPools, r: torch.Tensor, keep: torch.Tensor, at: torch.Tensor,
                     streams: torch.Tensor) -> None:
        """`restore` from device tensors [n] (rows, main_from, slot_rows), without the host. A row
        whose every draft was accepted may be restored too: the positions at and past its
        main_from were not written by the step, so their saved bytes are the ones there."""
        for kind, saved in self.rows.items():
            layers = pools.specs[kind].layers
            mtp = layers.index(pools.mtp_layer) if pools.mtp_layer in layers else -1
            ring_rows.restore(_ring_view(pools, kind), self.pages[kind], self.positions, saved, r, keep, mtp, self.impl)
        pools.write_slots("state_mtp", self.slots[r], streams[at.to(streams.device)])


def _ring_view(pools: KVPools, kind: str) -> torch.Tensor:
    """The ring pool `kind` as [pages, layers, entries_per_page, words] (`ring_rows.words`)."""
    spec = pools.specs[kind]
    return ring_rows.words(pools.buffers[kind].view(-1, len(spec.layers), spec.entries_per_page, spec.entry_bytes))


@dataclass(frozen=True)
class Pending:
    """One request's speculative step between drafting and accepting."""

    seq: SeqKV
    start: int  # n: cached tokens before the step
    last: int  # x_n
    drafts: tuple[int, ...]  # on the host (empty with `chain`)
    params: SamplingParams
    snapshot: Snapshot | None  # the step's ring rows (shared by the step's requests; None: nothing drafted)
    row: int = -1  # this request's row in `snapshot` (and in `chain`)
    binding: bool = True  # False: the drafts are placeholders, never accepted (the verify keeps t_0 alone)
    # the step's verify segments on the device, [R, N+1] int64 (x_n, then d_1..d_N; shared by the
    # step's requests): drafts drawn there and never copied to the host (`draft(on_device=True)`)
    chain: torch.Tensor | None = None

    @property
    def tokens(self) -> list[int]:
        """The verify segment: x_n and the drafts (with `chain`, zeros in the drafts' place: the
        step's ids are the chain's)."""
        if self.chain is None:
            return [self.last, *self.drafts]
        return [self.last] + [0] * (self.chain.shape[1] - 1)


def draft(model: Transformer, pools: KVPools, requests: list[tuple[SeqKV, int, int, SamplingParams]],
          graph_for: Callable[[int], object | None] | None = None, on_device: bool = False,
          chain_for: Callable[[int], object | None] | None = None) -> list[Pending]:
    """Draft up to `depth` tokens for each (seq, last token, depth, sampling) with the MTP block,
    chained, all requests in one MTP step per draft. Every drafting request's ring rows for the
    step are saved first (one `Snapshot`), so that `settle` can undo what the drafts and the
    verify write. `graph_for(rows)`: a captured draft step (`model.cuda_graph.DecodeGraph` with
    `draft=True`) of at least that many rows, or None to run the block eagerly.

    `on_device` (every request at one depth N > 0): each draft is drawn on the device and fed to
    the next MTP step there, and the verify segments stay there (`Pending.chain`): nothing waits
    for the device, so the drafts, the verify and the roll-back (`settle_chain`) queue back to
    back. `chain_for(rows)`: a captured chain of N drafts (`DecodeGraph.run_chain`) of at least
    that many rows, or None: such a step drafts in one replay when its sampling fits the graph's
    draws (`DrawInputs.capturable`), else in N."""
    depths = [depth for _, _, depth, _ in requests]
    if on_device and (len(set(depths)) != 1 or depths[0] == 0):
        raise ValueError(f"drafting on the device takes requests of one depth > 0, got {depths}")
    drafting = [i for i, d in enumerate(depths) if d > 0]
    snapshot = (Snapshot.take(pools, [requests[i][0] for i in drafting], max(depths) + 2, impl=model.impl)
                if drafting else None)
    chain_graph = chain_for(len(requests)) if on_device and chain_for is not None else None
    if chain_graph is not None and chain_graph.chain == depths[0]:
        unadjusted = [p.unadjusted for _, _, _, p in requests]
        if chain_graph.draws.capturable(unadjusted):
            return _draft_in_one_replay(model, pools, requests, chain_graph, unadjusted, snapshot)
    row = {i: r for r, i in enumerate(drafting)}
    drafts: list[list[int]] = [[] for _ in requests]
    chain = None
    if on_device:
        chain = torch.empty(len(requests), depths[0] + 1, dtype=torch.int64, device=pools.device)
        chain[:, 0] = to_device([last for _, last, _, _ in requests], pools.device, torch.int64)
    live, streams = drafting, None
    for k in range(max(depths, default=0)):
        if k == 0:
            streams = pools.read_slots("state_mtp", snapshot.slots).view(len(live), model.cfg.hc_mult,
                                                                       model.cfg.hidden_size)
        seqs = [requests[i][0] for i in live]
        graph = graph_for(len(live)) if graph_for is not None else None
        # a graph reads the batch's segments and host ids only: no device copy of them
        fed = [0] * len(live) if chain is not None else [drafts[i][-1] if k else requests[i][1] for i in live]
        batch = ForwardBatch.build([(SeqKV(s.pages, s.num_tokens - 1 + k), [t]) for s, t in zip(seqs, fed)],
                                   "cpu" if graph is not None else pools.device)
        if chain is not None:  # the ids from the device (a graph copies them into its inputs there)
            batch = ForwardBatch(chain[:, k], batch.positions, batch.segments)
        if graph is not None:
            graph.streams_in[: len(live)] = streams
            logits, out = graph.run(batch), graph.streams[: len(live)]
        else:
            logits, out = model.mtp_step(streams.to(model.embed.weight.dtype), batch, pools)
        # drafts are proposals: the verify applies a request's penalties exactly, so they draw without
        params, positions = [requests[i][3].unadjusted for i in live], [s.num_tokens + 1 + k for s in seqs]
        if chain is not None:
            chain[:, k + 1] = draw_rows(logits, params, positions)
        else:
            for i, t in zip(live, sample_rows(logits, params, positions)):
                drafts[i].append(t)
        keep = [j for j, i in enumerate(live) if depths[i] > k + 1]
        if not keep:
            break
        # (a graph's output is copied into its input before the next replay rewrites it)
        streams = out if len(keep) == len(live) else out[torch.tensor(keep, device=out.device)]
        live = [live[j] for j in keep]
    return [Pending(seq, seq.num_tokens, last, tuple(drafts[i]), params, snapshot if i in row else None, row.get(i, -1),
                    chain=chain)
            for i, (seq, last, _, params) in enumerate(requests)]


def _draft_in_one_replay(model: Transformer, pools: KVPools, requests: list[tuple[SeqKV, int, int, SamplingParams]],
                         graph, params: list[SamplingParams], snapshot: Snapshot) -> list[Pending]:
    """`draft(on_device=True)` through a chain graph: the drafts of every request, N each, in one
    replay, drawn as the step-by-step chain draws them (same params, same positions)."""
    n = len(requests)
    graph.streams_in[:n] = pools.read_slots("state_mtp", snapshot.slots).view(n, model.cfg.hc_mult,
                                                                             model.cfg.hidden_size)
    batch = ForwardBatch.build([(SeqKV(s.pages, s.num_tokens - 1), [last]) for s, last, _, _ in requests], "cpu")
    positions = [[s.num_tokens + 1 + k for k in range(graph.chain)] for s, _, _, _ in requests]
    chain = graph.run_chain(batch, params, positions)
    return [Pending(seq, seq.num_tokens, last, (), p, snapshot, r, chain=chain)
            for r, (seq, last, _, p) in enumerate(requests)]


def draft_ahead(model: Transformer, pools: KVPools, before: list[Pending], accepted: torch.Tensor,
                targets: torch.Tensor, graph, params: list[SamplingParams]) -> list[Pending]:
    """`draft(on_device=True)` through the chain graph `graph` for the requests of step `before`,
    queued before the host knows what it kept: accepted [R] and targets [R, N+1] on the device.
    Each request's seq holds the optimistic count H = n + N + 1 (the verify committed, nothing
    rolled back yet); its true count is n + a + 1, which the graph's inputs take from the device
    (`DecodeGraph.run`'s shift, a + 1 - (N+1) <= 0), as do its first token t_a, its snapshot's
    positions and its draws' keys. The pages must hold positions up to H + N. The Pendings' start
    is H: the caller sets the true one once `accepted` reaches the host."""
    n, L = len(before), targets.shape[1]
    snapshot = before[0].snapshot
    seqs = [p.seq for p in before]
    first = snapshot.positions[:, 0] + accepted + 1  # n' - 1 = (n - 1) + a + 1
    taken = Snapshot.take(pools, seqs, L + 1, first=first, impl=model.impl)
    graph.streams_in[:n] = pools.read_slots("state_mtp", taken.slots).view(n, model.cfg.hc_mult,
                                                                          model.cfg.hidden_size)
    last = targets.gather(1, accepted[:, None]).squeeze(1)
    optimistic = ForwardBatch.build([(SeqKV(s.pages, s.num_tokens - 1), [0]) for s in seqs], "cpu")
    batch = ForwardBatch(last, optimistic.positions, optimistic.segments)
    # the k-th draft's true position n' + 1 + k = (n + 2) + a + k: candidates from n + 2, offset a
    candidates = [[p.start + 2 + i for i in range(2 * graph.chain)] for p in before]
    chain = graph.run_chain(batch, params, candidates, shift=(accepted + 1 - L).int(), offsets=accepted)
    return [Pending(p.seq, p.seq.num_tokens, 0, (), q, taken, r, chain=chain)
            for r, (p, q) in enumerate(zip(before, params))]


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


def accept_counts(drafts: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`accepted` on the device: drafts [R, N], targets [R, N+1] → [R] int64."""
    return (drafts == targets[:, :-1]).long().cumprod(1).sum(1)


def settle_chain(pools: KVPools, pending: list[Pending], targets: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """`settle` for a step drafted on the device (`draft(on_device=True)`; its segments are the
    batch's rows in order, N+1 each), queued without the host: targets [R, N+1] on the device →
    the accepted counts a [R]. Every request's ring rows and MTP slot are rolled back to n + a + 1
    tokens in one restore; the caller sets each `seq.num_tokens` to that once a reaches the host."""
    chain, snapshot = pending[0].chain, pending[0].snapshot
    if any(p.chain is not chain or not p.binding for p in pending):
        raise ValueError("settle_chain takes every request of one draft step on the device, each binding")
    a = accept_counts(chain[:, 1:], targets)
    rows = torch.arange(len(pending), device=a.device)
    kept = snapshot.positions[:, 0] + 2 + a  # n - 1 is the snapshot's first position
    snapshot.restore_rows(pools, rows, kept, rows * chain.shape[1] + a, streams)
    return a
