"""Turning page-id lists into as few (offset, length) transfer descriptors as possible.

A request's pages on the sender map one-to-one, in order, onto its reserved pages on the receiver.
Every descriptor costs NIXL/UCX a fixed overhead, and transfers under ~256 KiB run far below link
speed, so runs of pages that are consecutive on BOTH sides become one descriptor.

Streaming: a page of a per-layer pool is laid out [layer][tokens][entry], so one layer's part of a
page is a byte sub-range (offset_in_page, length). Shipping a sub-range of each page lets the
sender push a layer as soon as its prefill chunk is done. A strict sub-range is never contiguous
across pages, so it yields one descriptor per page.

The sender builds spans as rows (`coalesce_rows`) and hands a write's spans on as one
`SpanBatch` (one int64 array); `Span` lists remain for tests and fault injection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Span:
    """One transfer descriptor, offsets in bytes from the start of each side's pool buffer."""

    src_offset: int
    dst_offset: int
    nbytes: int


Rows = list[tuple[int, int, int]] | np.ndarray   # (src_offset, dst_offset, nbytes) per span


def coalesce(src_pages: Sequence[int], dst_pages: Sequence[int], page_bytes: int,
             byte_range: tuple[int, int] | None = None) -> list[Span]:
    """Descriptors moving src page src_pages[i] to dst page dst_pages[i] for every i.

    byte_range: (offset_in_page, length) to move only that part of every page; None = whole page.
    Returns spans in list order; whole-page runs consecutive on both sides are merged.
    """
    rows = coalesce_rows(src_pages, dst_pages, page_bytes, byte_range)
    return [Span(*r) for r in (rows.tolist() if isinstance(rows, np.ndarray) else rows)]


def coalesce_rows(src_pages: Sequence[int], dst_pages: Sequence[int], page_bytes: int,
                  byte_range: tuple[int, int] | None = None) -> Rows:
    """As coalesce, as rows (src_offset, dst_offset, nbytes): a Python list where that is cheap
    (one run, or a short list), else an int64 [n, 3] array built with whole-array numpy ops (a
    per-layer write of a long request has thousands of page slices; each numpy call costs a few
    µs, which the handful of pools of a whole-page write would pay many times over)."""
    n = len(src_pages)
    if n != len(dst_pages):
        raise ValueError(f"page lists differ in length: {n} != {len(dst_pages)}")
    if not n:
        return []
    off, length = (0, page_bytes) if byte_range is None else byte_range
    if off < 0 or length <= 0 or off + length > page_bytes:
        raise ValueError(f"byte_range {byte_range} outside page of {page_bytes} bytes")
    if length != page_bytes:
        # Gaps between the slices of neighbouring pages: nothing to merge.
        if n <= _SHORT:
            return [(int(s) * page_bytes + off, int(d) * page_bytes + off, length)
                    for s, d in zip(src_pages, dst_pages)]
        return slice_rows(src_pages, dst_pages, page_bytes, [byte_range])
    s0, d0 = int(src_pages[0]), int(dst_pages[0])
    if (int(src_pages[-1]) - s0 == n - 1 and int(dst_pages[-1]) - d0 == n - 1
            and list(src_pages) == list(range(s0, s0 + n))
            and list(dst_pages) == list(range(d0, d0 + n))):   # one run on both sides (common)
        return [(s0 * page_bytes, d0 * page_bytes, n * page_bytes)]
    if n <= _SHORT:
        out_rows: list[tuple[int, int, int]] = []
        run_s, run_d, run_n = s0, d0, 1
        for s, d in zip(src_pages[1:], dst_pages[1:]):
            if s == run_s + run_n and d == run_d + run_n:
                run_n += 1
            else:
                out_rows.append((run_s * page_bytes, run_d * page_bytes, run_n * page_bytes))
                run_s, run_d, run_n = int(s), int(d), 1
        out_rows.append((run_s * page_bytes, run_d * page_bytes, run_n * page_bytes))
        return out_rows
    # A run breaks wherever either side is not the previous page id + 1.
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    out = np.empty((len(starts), 3), dtype=np.int64)
    out[:, 0] = src[starts] * page_bytes
    out[:, 1] = dst[starts] * page_bytes
    out[:, 2] = np.diff(np.concatenate((starts, [n]))) * page_bytes
    return out


_SHORT = 16   # page lists up to this long are coalesced in Python


def slice_rows(src_pages: Sequence[int], dst_pages: Sequence[int], page_bytes: int,
               byte_ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """Rows (src_offset, dst_offset, nbytes), int64 [len(byte_ranges) * n, 3], moving slice r of
    src page src_pages[i] to the same slice of dst page dst_pages[i], range by range: e.g. many
    layers of the same pages in one go (a handful of numpy calls however many ranges)."""
    for off, length in byte_ranges:
        if off < 0 or length <= 0 or off + length > page_bytes:
            raise ValueError(f"byte_range {(off, length)} outside page of {page_bytes} bytes")
    n, ranges = len(src_pages), np.asarray(byte_ranges, dtype=np.int64).reshape(-1, 2)
    out = np.empty((len(ranges), n, 3), dtype=np.int64)
    out[:, :, 0] = np.asarray(src_pages, dtype=np.int64) * page_bytes
    out[:, :, 1] = np.asarray(dst_pages, dtype=np.int64) * page_bytes
    out[:, :, :2] += ranges[:, None, :1]
    out[:, :, 2] = ranges[:, None, 1]
    return out.reshape(-1, 3)


@dataclass(frozen=True, eq=False)
class SpanBatch:
    """The spans of one write: `rows`, int64 [count, 4] of (kind index into `kinds`, src_offset,
    dst_offset, nbytes), offsets in bytes from the start of each side's pool buffer, in write
    order; nbytes: bytes in all. Build with `build()` / `from_pairs()`."""

    kinds: tuple[str, ...]
    rows: np.ndarray
    nbytes: int

    @property
    def count(self) -> int:
        return len(self.rows)

    @classmethod
    def build(cls, parts: Sequence[tuple[str, Rows]]) -> SpanBatch:
        """One batch of (kind, rows) parts, rows as coalesce_rows() returns them."""
        index: dict[str, int] = {}
        short: list[tuple[int, int, int, int]] = []
        arrays: list[np.ndarray] = []
        nbytes = 0
        for kind, rows in parts:
            if not len(rows):
                continue
            k = index.setdefault(kind, len(index))
            if isinstance(rows, np.ndarray):
                a = np.empty((len(rows), 4), dtype=np.int64)
                a[:, 0] = k
                a[:, 1:] = rows
                arrays.append(a)
                nbytes += int(rows[:, 2].sum())
            else:
                short += [(k, s, d, n) for s, d, n in rows]
                nbytes += sum(r[2] for r in rows)
        if short or not arrays:
            arrays.insert(0, np.array(short, dtype=np.int64).reshape(-1, 4))
        return cls(tuple(index), arrays[0] if len(arrays) == 1 else np.concatenate(arrays),
                   nbytes)

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[str, Span]]) -> SpanBatch:
        return cls.build([(k, [(s.src_offset, s.dst_offset, s.nbytes)]) for k, s in pairs])

    def pairs(self) -> list[tuple[str, Span]]:
        """(kind, Span) per span, in order (tests, fault injection)."""
        return [(self.kinds[k], Span(s, d, n)) for k, s, d, n in self.rows.tolist()]

    def prefix(self, fraction: float) -> SpanBatch:
        """The first `fraction` of the bytes, in order (fault injection: a partial write)."""
        keep, out = int(self.nbytes * fraction), []
        for kind, s in self.pairs():
            part = truncate([s], keep)
            out += [(kind, p) for p in part]
            keep -= total_bytes(part)
        return SpanBatch.from_pairs(out)


def as_batch(spans: SpanBatch | Sequence[tuple[str, Span]]) -> SpanBatch:
    return spans if isinstance(spans, SpanBatch) else SpanBatch.from_pairs(spans)


def total_bytes(spans: Sequence[Span]) -> int:
    return sum(s.nbytes for s in spans)


def truncate(spans: Sequence[Span], keep_bytes: int) -> list[Span]:
    """The first `keep_bytes` bytes of `spans` (in order): models a partially written transfer."""
    out: list[Span] = []
    left = keep_bytes
    for s in spans:
        if left <= 0:
            break
        n = min(s.nbytes, left)
        out.append(Span(s.src_offset, s.dst_offset, n))
        left -= n
    return out


def layer_byte_range(page_bytes: int, num_layers: int, first_layer: int,
                     count: int = 1) -> tuple[int, int]:
    """(offset_in_page, length) of layers [first_layer, first_layer+count) of a page whose bytes
    are laid out [layer][...] with `num_layers` equal slices."""
    if page_bytes % num_layers:
        raise ValueError(f"page_bytes {page_bytes} not divisible into {num_layers} layers")
    if not (0 <= first_layer and count >= 1 and first_layer + count <= num_layers):
        raise ValueError(f"layers [{first_layer}, {first_layer + count}) outside 0..{num_layers}")
    per = page_bytes // num_layers
    return first_layer * per, count * per
