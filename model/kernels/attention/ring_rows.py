"""Saving and putting back rows of the compress-state rings (`state_c4`, `state_c4_indexer`,
`state_c128`) around a speculative step (`model.speculation.Snapshot`).

A ring kind is viewed as [pages, layers, entries_per_page, words] (`words`: an entry's bytes as
int32 words, or bytes where they do not divide by 4); request r's entry for position p in layer
l is [pages[r], l, p % entries_per_page]. For R requests and positions [R, W]:

* `take`: saved [R, layers, W, words] = every layer's entries at those positions;
* `restore`: for the snapshot rows `rows` [n] (each with its `keep` [n]), put back every saved
  entry whose position is at or past keep, or keep - 1 in the layer `mtp` (the MTP block's layer,
  which lags the main layers by one; -1: none), leaving the others as they are.

The references are a handful of torch ops per kind (index arithmetic, a gather, a select, a
scatter); a speculative step at batch 1 spends more in those launches than in the bytes they
move (a few hundred KB). Each kernel is one launch per kind, a program per (request, layer,
position) entry and block of words. A ring holds every position of a step's window
(entries_per_page ≥ W), so no two of a row's positions share an entry.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels import check_impl

BLOCK = 512  # words per program: a C4 entry (8 KB) in 4 programs, an indexer entry (2 KB) in one


def words(view: torch.Tensor) -> torch.Tensor:
    """A [pages, layers, entries, bytes] uint8 ring view as int32 words when the bytes allow."""
    return view.view(torch.int32) if view.shape[-1] % 4 == 0 and view.is_contiguous() else view


def _index(view: torch.Tensor, pages: torch.Tensor, positions: torch.Tensor) -> tuple:
    """Advanced index of `view` for pages [R] at positions [R, W], every layer → [R, layers, W, ·]."""
    layers = torch.arange(view.shape[1], device=pages.device)
    return pages[:, None, None], layers[None, :, None], (positions % view.shape[2])[:, None, :]


def reference_take(view: torch.Tensor, pages: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return view[_index(view, pages, positions)]


def reference_restore(view: torch.Tensor, pages: torch.Tensor, positions: torch.Tensor, saved: torch.Tensor,
                      rows: torch.Tensor, keep: torch.Tensor, mtp: int) -> None:
    first = keep[:, None] - (torch.arange(view.shape[1], device=keep.device) == mtp).long()[None, :]  # [n, layers]
    at = positions[rows]
    back = (at[:, None, :] >= first[:, :, None])[..., None]  # [n, layers, W, 1]
    index = _index(view, pages[rows], at)
    view[index] = torch.where(back, saved[rows], view[index])


def take(view: torch.Tensor, pages: torch.Tensor, positions: torch.Tensor, impl: str) -> torch.Tensor:
    """view [P, layers, E, words], pages [R] int64, positions [R, W] int64 → saved [R, layers, W, words]."""
    if check_impl(impl) == "torch":
        return reference_take(view, pages, positions)
    R, W = positions.shape
    layers, entries, n = view.shape[1], view.shape[2], view.shape[3]
    saved = torch.empty(R, layers, W, n, dtype=view.dtype, device=view.device)
    if R:
        _take_kernel[(R * layers * W, triton.cdiv(n, BLOCK))](
            view, pages, positions, saved, layers, W, entries, n, view.stride(0), view.stride(1), BLOCK=BLOCK)
    return saved


def restore(view: torch.Tensor, pages: torch.Tensor, positions: torch.Tensor, saved: torch.Tensor,
            rows: torch.Tensor, keep: torch.Tensor, mtp: int, impl: str) -> None:
    """Put back the saved entries of snapshot rows `rows` [n] (int64) at or past `keep` [n]
    (keep - 1 in layer `mtp`): see the module docstring. pages [R], positions [R, W] and saved
    [R, layers, W, words] are the snapshot's (`take`)."""
    if check_impl(impl) == "torch":
        return reference_restore(view, pages, positions, saved, rows, keep, mtp)
    W = positions.shape[1]
    layers, entries, n = view.shape[1], view.shape[2], view.shape[3]
    if rows.shape[0]:
        _restore_kernel[(rows.shape[0] * layers * W, triton.cdiv(n, BLOCK))](
            view, pages, positions, saved, rows, keep, mtp, layers, W, entries, n, view.stride(0), view.stride(1),
            BLOCK=BLOCK)


@triton.jit
def _take_kernel(view_ptr, pages_ptr, pos_ptr, saved_ptr, layers, W, entries, n, page_stride, layer_stride,
                 BLOCK: tl.constexpr):
    i = tl.program_id(0)  # (r · layers + layer) · W + w: saved's entry, in order
    w = i % W
    layer = (i // W) % layers
    r = i // (W * layers)
    page = tl.load(pages_ptr + r).to(tl.int64)
    slot = tl.load(pos_ptr + r * W + w).to(tl.int64) % entries
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    src = page * page_stride + layer.to(tl.int64) * layer_stride + slot * n
    x = tl.load(view_ptr + src + cols, mask=mask)
    tl.store(saved_ptr + i.to(tl.int64) * n + cols, x, mask=mask)


@triton.jit
def _restore_kernel(view_ptr, pages_ptr, pos_ptr, saved_ptr, rows_ptr, keep_ptr, mtp, layers, W, entries, n,
                    page_stride, layer_stride, BLOCK: tl.constexpr):
    i = tl.program_id(0)  # (j · layers + layer) · W + w over the rows restored
    w = i % W
    layer = (i // W) % layers
    j = i // (W * layers)
    r = tl.load(rows_ptr + j)
    pos = tl.load(pos_ptr + r * W + w)
    first = tl.load(keep_ptr + j) - (layer == mtp).to(tl.int64)
    if pos >= first:
        page = tl.load(pages_ptr + r).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        src = ((r * layers + layer).to(tl.int64) * W + w) * n
        x = tl.load(saved_ptr + src + cols, mask=mask)
        dst = page * page_stride + layer.to(tl.int64) * layer_stride + (pos.to(tl.int64) % entries) * n
        tl.store(view_ptr + dst + cols, x, mask=mask)
