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

A step's host work, writing its positions and page tables into pinned memory, grows with the
batch, and the GPU would sit idle for it before the replay. `HostStaging` moves
it into the previous step: right after a replay is queued, the next step's inputs are written
for the same requests one position on, and when the next batch is exactly that, its step writes
only the token ids.

A graph of `tokens_per_row` L > 1 is a speculative verify step (`model/speculation.py`): each row
is one request's segment of L tokens (its last sampled token and L-1 drafts), with logits and
main streams at every token, and the MTP block's extension is captured with it
(`Transformer.extend_mtp` on the static batch: every row's MTP segment is its tokens one position
back), so a verify step and its extension are one replay.

A draft graph (`draft=True`) is one step of the MTP block and the head at one token a row
(`Transformer.mtp_step`), beside the streams the caller puts in `streams_in`: a speculative step
drafts N tokens in N replays of it (`model/speculation.py`). A chain graph (`draft=True`,
`chain=N`) drafts all N in one replay: each MTP step one position on from the last, on its output
streams, fed the token drawn from its logits inside the graph (`model.sampling.DrawInputs`), so
the host neither builds nor launches anything between the drafts.
"""

from __future__ import annotations

import numpy as np
import torch

from model.batch import BatchMeta, ForwardBatch
from model.kv_pool import ALL_KINDS, KVPools, SeqKV
from model.sampling import DrawInputs, SamplingParams


class DecodeGraph:
    """One captured decode step for up to `batch_size` requests of up to `max_context` tokens."""

    def __init__(self, model, pools: KVPools, batch_size: int, max_context: int, scratch: SeqKV | None = None,
                 tokens_per_row: int = 1, draft: bool = False, chain: int = 0):
        """`scratch`: a request reserved for `max_context` tokens that the padding rows decode
        (graphs of several buckets share one); by default this graph reserves its own.
        `tokens_per_row`: L tokens a row (L > 1: a verify step, logits and streams at every token).
        `draft`: a draft step of the MTP block (one token a row) on the streams in `streams_in`
        [B, hc, D]; `run` returns its logits and its output streams are `streams`. With `chain`
        N > 0, N draft steps drawn in the graph (`run_chain`)."""
        if draft and tokens_per_row != 1:
            raise ValueError("a draft graph takes one token a row")
        if chain and not draft:
            raise ValueError("a chain of drafts is a draft graph's (draft=True)")
        if pools.device == "cpu" or torch.device(pools.device).type != "cuda":
            raise ValueError("CUDA graphs need pools on a CUDA device")
        self.model, self.pools, self.B, self.max_context = model, pools, batch_size, max_context
        self.L = L = tokens_per_row
        device = torch.device(pools.device)
        self.owns_scratch = scratch is None
        self.scratch = SeqKV() if scratch is None else scratch
        if self.owns_scratch:
            pools.reserve(self.scratch, max_context)
        self.widths = {k: max(1, n) for k, n in pools.pages_needed(SeqKV(), max_context).items()}
        self.widths.update({k: 1 for k in ALL_KINDS if k not in self.widths})
        B = batch_size
        self.staging = HostStaging(B, [self.widths[k] for k in ALL_KINDS], self.scratch, pools.cfg.sliding_window,
                                   pools.page_size, pinned=True, tokens_per_row=L)
        # the per-step inputs as views of one device buffer laid out as a `HostInputs` array: a
        # step's inputs arrive in one copy, and only ids and positions are widened to int64 after it
        # (inside the graph)
        self.flat = torch.from_numpy(self.staging.buffers[0].array).to(device)
        ids, positions, seg_start, seg_end, *tables = self.flat.split(
            [B * L, B * L, B, B] + [B * self.widths[k] for k in ALL_KINDS])
        self.ids = ids.long()
        self.positions = positions.long()
        self.meta = BatchMeta(
            token_seq=torch.arange(B, dtype=torch.int32, device=device).repeat_interleave(L),
            positions=positions, seg_start=seg_start, seg_end=seg_end,
            tables={k: t.view(B, self.widths[k]) for k, t in zip(ALL_KINDS, tables)},
            max_end=max_context)
        # copied[i]: the last copy out of staging buffer i (pinned memory), which must have read
        # it before the host writes it again
        self.copied = [torch.cuda.Event(), torch.cuda.Event()]
        for event in self.copied:
            event.record()
        self.batch = ForwardBatch(self.ids, self.positions, ())
        self.batch.__dict__["meta"] = self.meta  # the static meta, in place of the per-batch build
        self.draft = draft
        if draft:
            c = model.cfg
            self.streams_in = torch.zeros(B, c.hc_mult, c.hidden_size, dtype=model.embed.weight.dtype, device=device)
            self.all_rows = torch.arange(B, device=device)
        self.chain = chain
        if chain:  # row r: its last token, then its N drafts
            # a step queued ahead draws at one of 2N candidate positions a row (`run_chain`'s offsets)
            self.draws = DrawInputs(B, chain, model.cfg.vocab_size, device, span=2 * chain)
            self.chain_ids = torch.zeros(B, chain + 1, dtype=torch.int64, device=device)
        self.load_inputs(self.staging.rows([]), [])
        for _ in range(2):  # compile every kernel and settle allocations before capture
            self._step()
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # the widening copies are the graph's first nodes
            out = self._step()
        self.logits, self.streams = out if L > 1 or draft else (out, None)

    def _step(self):
        """The captured work: widen the inputs, then the model's step (or the MTP block's)."""
        self._widen()
        if self.chain:
            return self._chain_step()
        if self.draft:
            return self.model.mtp_step(self.streams_in, self.batch, self.pools, rows=self.all_rows)
        return self.model(self.batch, self.pools, all_logits=True, return_streams=self.L > 1)

    def _chain_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """N draft steps, the k-th k positions past the loaded one, each fed the token the one
        before drew: → (chain ids [B, N+1], the last step's output streams)."""
        streams, meta = self.streams_in, self.meta
        self.chain_ids[:, 0] = self.ids
        for k in range(self.chain):
            batch = ForwardBatch(self.chain_ids[:, k].contiguous(), self.positions + k, ())
            batch.__dict__["meta"] = BatchMeta(meta.token_seq, meta.positions + k, meta.seg_start + k,
                                               meta.seg_end + k, meta.tables, meta.max_end)
            logits, streams = self.model.mtp_step(streams, batch, self.pools, rows=self.all_rows)
            self.chain_ids[:, k + 1] = self.draws.draw(logits, k, self.model.impl)
        return self.chain_ids, streams

    def run_chain(self, batch: ForwardBatch, params: list[SamplingParams], positions: list[list[int]],
                  shift: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """A chain graph's drafts for `batch` (each segment its request's last token, one position
        back, as a draft graph's first step; the streams there in `streams_in`), row r's k-th draft
        drawn with params[r] at positions[r][k]: → the rows' chain ids [n, N+1] (a copy: the next
        replay rewrites the graph's). `shift`, `offsets`: the segments' true positions on the
        device (see `run`), and the k-th draft at positions[r][offsets[r] + k] of 2N candidates."""
        if any(s.end + self.chain - 1 > self.max_context for s in batch.segments):
            raise ValueError(f"request longer than the graph's {self.max_context}-token capacity")
        self.draws.load(params, positions, offsets)
        return self.run(batch, shift).clone()

    def run(self, batch: ForwardBatch, shift: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n·L, vocab] of a batch of n segments of L tokens each (L = 1: a decode step); the
        caller commits it. Without `host_ids` the batch's ids are read on the device, in stream
        order (an overlapped step's, `decode_worker/overlap.py`). With L > 1 the step's main
        streams are `streams[: n·L]` until the next replay (a draft graph's: the MTP block's
        output streams).

        `shift` [n] int32 on the device (<= 0): each segment starts that many positions before the
        host's `batch` says, which the host does not know yet (a speculative step queued before the
        one ahead of it kept its drafts, `decode_worker/overlap.py`); the page tables must hold the
        pages either way."""
        segs = batch.segments
        # (one pass over the rows: until the replay is queued the GPU waits on the host)
        if len(segs) > self.B or any(s.length != self.L or s.end > self.max_context for s in segs):
            if len(segs) > self.B or any(s.length != self.L for s in segs):
                raise ValueError(f"a decode graph of {self.B} rows runs up to {self.B} segments of {self.L} "
                                 f"token(s), got {[s.length for s in segs]}")
            raise ValueError(f"request longer than the graph's {self.max_context}-token capacity")
        rows = self.staging.rows(segs)
        staged = self.load_inputs(rows, list(batch.host_ids))
        if not batch.host_ids:  # ids still on the device (sampled by the step before): after the inputs' copy
            self.flat[: batch.input_ids.shape[0]].copy_(batch.input_ids)
        if shift is not None:  # positions [B, L], then segment starts and ends [B]: the first n rows
            n, B, L = len(segs), self.B, self.L
            self.flat[B * L:2 * B * L].view(B, L)[:n] += shift[:, None]
            self.flat[2 * B * L:2 * B * L + 2 * B].view(2, B)[:, :n] += shift
        self.graph.replay()
        self._stage_next(rows, staged)
        return self.logits[: len(segs) * self.L]

    def run_padding(self) -> None:
        """Replay with padding rows alone: a rank of an expert-parallel group without a request
        joins its peers' captured exchanges this way."""
        rows = self.staging.rows([])
        staged = self.load_inputs(rows, [])
        self.graph.replay()
        self._stage_next(rows, staged)

    def load_inputs(self, rows: list[tuple[SeqKV, int]], ids: list[int]) -> bool:
        """Copy a step's inputs into the static buffer `flat` (one host→device copy, queued behind
        the previous step without waiting for it; the graph widens ids and positions itself).
        True when they were staged during the previous step and only the ids were written now."""
        i = self.staging.current
        self.copied[i].synchronize()  # that buffer's last copy has read it: it may be rewritten
        staged = self.staging.load(rows, ids)
        self.flat.copy_(torch.from_numpy(self.staging.buffers[i].array), non_blocking=True)
        self.copied[i].record()
        return staged

    def _widen(self) -> None:
        """ids and positions from `flat`'s int32 into the int64 tensors the model reads."""
        n = self.B * self.L
        self.ids.copy_(self.flat[:n])
        self.positions.copy_(self.flat[n:2 * n])

    def _stage_next(self, rows: list[tuple[SeqKV, int]], staged: bool) -> None:
        """While the GPU runs the step just queued: check the staged tables it read, then stage the
        next step's inputs into the other buffer, whose last copy ran before this step's."""
        if staged:
            self.staging.check(rows)
        self.copied[self.staging.current ^ 1].synchronize()
        self.staging.stage_next(rows)

    def close(self) -> None:
        if self.owns_scratch:
            self.pools.release(self.scratch)


class HostInputs:
    """The host side of a decode graph's per-step inputs: one int32 array laid out as ids [B·L],
    positions [B·L] (L tokens a row, row-major), segment starts [B], segment ends [B], then each
    kind's page table [B, width] padded with -1, sent to the GPU in one copy per step (`pinned`:
    the array is page-locked memory, which the copy reads asynchronously).

    A table row is rewritten only when its request's page list differs from the one it was last
    written from (a list comparison, in C): a decode step changes few rows, while building every
    row afresh at 256 requests × 32K tokens (5 kinds × 128 pages a row) takes as long as a GPU
    step."""

    def __init__(self, rows: int, widths: list[int], pinned: bool = False, tokens_per_row: int = 1):
        self.rows, self.widths, self.L = rows, widths, tokens_per_row
        size = 2 * rows * tokens_per_row + 2 * rows + rows * sum(widths)
        self.array: np.ndarray = (torch.full((size,), -1, dtype=torch.int32, pin_memory=True).numpy() if pinned
                                  else np.full(size, -1, dtype=np.int32))
        self._written: list[list[list[int] | None]] = [[None] * rows for _ in widths]

    def table(self, kind: int) -> np.ndarray:
        """Kind `kind`'s page table [rows, width] (a view into `array`)."""
        start = 2 * self.rows * self.L + 2 * self.rows + self.rows * sum(self.widths[:kind])
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

    def differences(self, pages: list[list[list[int]]]):
        """(kind, row, list the row was written from, `pages[kind][row]`) wherever they differ."""
        for kind, (written, rows) in enumerate(zip(self._written, pages)):
            for r, row_pages in enumerate(rows):
                if written[r] != row_pages:
                    yield kind, r, written[r], row_pages


class HostStaging:
    """Two `HostInputs` buffers used in turn, and the next step's inputs staged ahead in the one
    not being copied: the rows of the step just queued, each one position on (padding rows stay
    at position 0).

    A staged buffer is used when the next step decodes exactly those rows (the same request
    objects at the staged positions); the step then writes only the ids. Between two steps a
    request's page lists change only by `trim_window`, which frees SWA pages the next query no
    longer sees (its window starts at the first page it keeps), so the staged tables hold every
    page the step reads. `check` verifies that after the step is queued, while the GPU runs it,
    and raises on any other change rather than let a step read another request's pages unseen."""

    def __init__(self, rows: int, widths: list[int], scratch: SeqKV, window: int, page_size: int,
                 pinned: bool = False, tokens_per_row: int = 1):
        """`window`, `page_size`: the model's sliding window and the pools' tokens per SWA page.
        `tokens_per_row` L: a row is a segment of L tokens; the next step is staged L positions on
        (every draft accepted), and loaded afresh when fewer were."""
        self.buffers = [HostInputs(rows, widths, pinned, tokens_per_row) for _ in range(2)]
        self.L = tokens_per_row
        self.scratch, self.window, self.page_size = scratch, window, page_size
        self.current = 0  # the buffer the next step's inputs go in
        self.staged: list[tuple[SeqKV, int]] | None = None  # the rows `buffers[current]` holds
        self.hits = 0  # steps that found their inputs staged

    def rows(self, segs) -> list[tuple[SeqKV, int]]:
        """(request, first position) of every row of a step of L-token segments `segs`, padded with
        the scratch request at position 0."""
        rows = [(s.seq, s.start) for s in segs]
        return rows + [(self.scratch, 0)] * (self.buffers[0].rows - len(rows))

    def load(self, rows: list[tuple[SeqKV, int]], ids: list[int]) -> bool:
        """Write a step's inputs into `buffers[current]` (its last copy done); True when they were
        staged and only the ids were written."""
        host = self.buffers[self.current]
        n, a = host.rows * self.L, host.array
        staged = rows == self.staged  # in C: requests by identity (SeqKV), positions by value
        a[:n] = ids + [0] * (n - len(ids))
        if staged:
            self.hits += 1
        else:
            _write_rows(host, rows)
        self.staged = None
        return staged

    def check(self, rows: list[tuple[SeqKV, int]]) -> None:
        """The tables of the buffer just loaded (staged) still hold every page its step reads: a
        row's lists may differ from the staged ones only by SWA pages freed (-1) below the page
        that holds the first position of its window."""
        pages = [[seq.pages[k] for seq, _ in rows] for k in ALL_KINDS]
        for kind, r, written, now in self.buffers[self.current].differences(pages):
            first_live = max(0, rows[r][1] - self.window + 1) // self.page_size
            if ALL_KINDS[kind] == "swa" and written is not None and len(now) == len(written) and all(
                    n == w or (n == -1 and i < first_live) for i, (n, w) in enumerate(zip(now, written))):
                continue
            raise RuntimeError(f"row {r}: its {ALL_KINDS[kind]} pages changed after its decode step's inputs "
                               f"were staged ({written[:8]}... → {now[:8]}...); only window pages it no longer "
                               "sees may be freed")

    def stage_next(self, rows: list[tuple[SeqKV, int]]) -> None:
        """After loading `buffers[current]` for `rows`: switch buffers and stage the same rows one
        position on in the other (its last copy done)."""
        self.current ^= 1
        self.staged = [(seq, 0 if seq is self.scratch else p + self.L) for seq, p in rows]
        _write_rows(self.buffers[self.current], self.staged)


def _write_rows(host: HostInputs, rows: list[tuple[SeqKV, int]]) -> None:
    """Positions, L-token segment bounds and page tables of `rows` into `host` (ids aside)."""
    B, L, a = host.rows, host.L, host.array
    n = B * L
    a[n:2 * n] = [p + j for _, p in rows for j in range(L)]
    a[2 * n:2 * n + B] = [p for _, p in rows]
    a[2 * n + B:2 * n + 2 * B] = [p + L for _, p in rows]
    host.update_tables([[seq.pages[k] for seq, _ in rows] for k in ALL_KINDS])
