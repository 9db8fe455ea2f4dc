"""CUDA graphs for decode steps: capture one step per batch-size bucket, replay with new inputs.

A decode step launches a few hundred small kernels; replaying them as one graph removes the
launch gaps that dominate small batches. What makes a step capturable: the kernel path
(`impl="triton"`) never synchronises with the host and its grids depend on shapes only, and every
per-step input lives in a static buffer the graph was captured on — token ids, positions and the
batch's `BatchMeta` (page tables padded to the pools' longest request, `max_end` fixed at the
bucket's context capacity, so the indexer's top-k width K is fixed too; extra -1 picks change
nothing).

A bucket of B rows serves any decode batch of n ≤ B requests: rows n..B-1 are padding that
decodes a private scratch request whose pages are reserved here, so their writes never touch a
real request's pages and their logits are dropped.
"""

from __future__ import annotations

import numpy as np
import torch

from model.batch import BatchMeta, ForwardBatch
from model.kv_pool import ALL_KINDS, KVPools, SeqKV


class DecodeGraph:
    """One captured decode step for up to `batch_size` requests of up to `max_context` tokens."""

    def __init__(self, model, pools: KVPools, batch_size: int, max_context: int, scratch: SeqKV | None = None):
        """`scratch`: a request reserved for `max_context` tokens that the padding rows decode
        (graphs of several buckets share one); by default this graph reserves its own."""
        if pools.device == "cpu" or torch.device(pools.device).type != "cuda":
            raise ValueError("CUDA graphs need pools on a CUDA device")
        self.model, self.pools, self.B, self.max_context = model, pools, batch_size, max_context
        device = torch.device(pools.device)
        self.owns_scratch = scratch is None
        self.scratch = SeqKV() if scratch is None else scratch
        if self.owns_scratch:
            pools.reserve(self.scratch, max_context)
        self.widths = {k: max(1, n) for k, n in pools.pages_needed(SeqKV(), max_context).items()}
        self.widths.update({k: 1 for k in ALL_KINDS if k not in self.widths})
        B = batch_size
        self.host = HostInputs(B, [self.widths[k] for k in ALL_KINDS], pinned=True)
        # the per-step inputs as views of one device buffer laid out as `host.array`: a step's
        # inputs arrive in one copy, and only ids and positions are widened to int64 after it
        self.flat = torch.from_numpy(self.host.array).to(device)
        ids, positions, seg_start, seg_end, *tables = self.flat.split([B] * 4 + [B * self.widths[k] for k in ALL_KINDS])
        self.ids = ids.long()
        self.positions = positions.long()
        self.meta = BatchMeta(
            token_seq=torch.arange(B, dtype=torch.int32, device=device),
            positions=positions, seg_start=seg_start, seg_end=seg_end,
            tables={k: t.view(B, self.widths[k]) for k, t in zip(ALL_KINDS, tables)},
            max_end=max_context)
        self.copied = torch.cuda.Event()  # the last copy out of `host.array` (pinned memory)
        self.copied.record()
        self.batch = ForwardBatch(self.ids, self.positions, ())
        self.batch.__dict__["meta"] = self.meta  # the static meta, in place of the per-batch build
        self._load([], [])
        for _ in range(2):  # compile every kernel and settle allocations before capture
            self.model(self.batch, pools, all_logits=True)
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.model(self.batch, pools, all_logits=True)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [n, vocab] of a decode batch (one token per segment); the caller commits it."""
        segs = batch.segments
        if len(segs) > self.B or any(s.length != 1 for s in segs):
            raise ValueError(f"a decode graph of {self.B} rows runs up to {self.B} one-token segments, "
                             f"got {[s.length for s in segs]}")
        if any(s.end > self.max_context for s in segs):
            raise ValueError(f"request longer than the graph's {self.max_context}-token capacity")
        self._load(segs, list(batch.host_ids) if batch.host_ids else batch.input_ids.tolist())
        self.graph.replay()
        return self.logits[: len(segs)]

    def run_padding(self) -> None:
        """Replay with padding rows alone: a rank of an expert-parallel group without a request
        joins its peers' captured exchanges this way."""
        self._load([], [])
        self.graph.replay()

    def _load(self, segs, ids: list[int]) -> None:
        """Copy a batch into the static buffers (one host→device copy and two widening copies,
        queued behind the previous step without waiting for it), padding with the scratch."""
        rows = [(s.seq, s.start) for s in segs] + [(self.scratch, 0)] * (self.B - len(segs))
        B = self.B
        self.copied.synchronize()  # the last step's copy has read `host.array`: it may be rewritten
        host = self.host.array
        host[:B] = ids + [0] * (B - len(segs))
        host[B:2 * B] = [p for _, p in rows]
        host[2 * B:3 * B] = host[B:2 * B]  # one-token segments start at their position
        host[3 * B:4 * B] = [p + 1 for _, p in rows]
        self.host.update_tables([[seq.pages[k] for seq, _ in rows] for k in ALL_KINDS])
        self.flat.copy_(torch.from_numpy(host), non_blocking=True)
        self.copied.record()
        self.ids.copy_(self.flat[:B])
        self.positions.copy_(self.flat[B:2 * B])

    def close(self) -> None:
        if self.owns_scratch:
            self.pools.release(self.scratch)


class HostInputs:
    """The host side of a decode graph's per-step inputs: one int32 array laid out as ids [B],
    positions [B], segment starts [B], segment ends [B], then each kind's page table [B, width]
    padded with -1, sent to the GPU in one copy per step (`pinned`: the array is page-locked
    memory, which the copy reads asynchronously).

    A table row is rewritten only when its request's page list differs from the one it was last
    written from (a list comparison, in C): a decode step changes few rows, while building every
    row afresh cost 15-35 ms of host time per step at 256 requests × 32K tokens (5 kinds × 128
    pages a row; 15 on the H100 host, 35 on a slower CPU), as long as a GPU step."""

    def __init__(self, rows: int, widths: list[int], pinned: bool = False):
        self.rows, self.widths = rows, widths
        size = 4 * rows + rows * sum(widths)
        self.array: np.ndarray = (torch.full((size,), -1, dtype=torch.int32, pin_memory=True).numpy() if pinned
                                  else np.full(size, -1, dtype=np.int32))
        self._written: list[list[list[int] | None]] = [[None] * rows for _ in widths]

    def table(self, kind: int) -> np.ndarray:
        """Kind `kind`'s page table [rows, width] (a view into `array`)."""
        start = 4 * self.rows + self.rows * sum(self.widths[:kind])
        return self.array[start:start + self.rows * self.widths[kind]].reshape(self.rows, self.widths[kind])

    def update_tables(self, pages: list[list[list[int]]]) -> None:
        """pages[kind][row]: that row's page list (longer than the width: cut to it)."""
        for kind, (width, rows) in enumerate(zip(self.widths, pages)):
            written, table = self._written[kind], None
            for r, row_pages in enumerate(rows):
                if written[r] == row_pages:
                    continue
                table = self.table(kind) if table is None else table
                n = min(len(row_pages), width)
                table[r, :n] = row_pages[:n]
                table[r, n:] = -1
                written[r] = list(row_pages)
