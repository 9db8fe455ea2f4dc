"""Turning page-id lists into as few (offset, length) transfer descriptors as possible.

A request's pages on the sender map one-to-one, in order, onto its reserved pages on the receiver.
Every descriptor costs NIXL/UCX a fixed overhead, and transfers under ~256 KiB run far below link
speed, so runs of pages that are consecutive on BOTH sides become one descriptor.

Streaming: a page of a per-layer pool is laid out [layer][tokens][entry], so one layer's part of a
page is a byte sub-range (offset_in_page, length). Shipping a sub-range of each page lets the
sender push a layer as soon as its prefill chunk is done. A strict sub-range is never contiguous
across pages, so it yields one descriptor per page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """One transfer descriptor, offsets in bytes from the start of each side's pool buffer."""

    src_offset: int
    dst_offset: int
    nbytes: int


def coalesce(src_pages: Sequence[int], dst_pages: Sequence[int], page_bytes: int,
             byte_range: tuple[int, int] | None = None) -> list[Span]:
    """Descriptors moving src page src_pages[i] to dst page dst_pages[i] for every i.

    byte_range: (offset_in_page, length) to move only that part of every page; None = whole page.
    Returns spans in list order; whole-page runs consecutive on both sides are merged.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"page lists differ in length: {len(src_pages)} != {len(dst_pages)}")
    if not len(src_pages):
        return []
    off, length = (0, page_bytes) if byte_range is None else byte_range
    if off < 0 or length <= 0 or off + length > page_bytes:
        raise ValueError(f"byte_range {byte_range} outside page of {page_bytes} bytes")
    if length != page_bytes:
        # Gaps between the slices of neighbouring pages: nothing to merge.
        return [Span(int(s) * page_bytes + off, int(d) * page_bytes + off, length)
                for s, d in zip(src_pages, dst_pages)]
    n, s0, d0 = len(src_pages), int(src_pages[0]), int(dst_pages[0])
    if (list(src_pages) == list(range(s0, s0 + n))
            and list(dst_pages) == list(range(d0, d0 + n))):   # one run on both sides (common)
        return [Span(s0 * page_bytes, d0 * page_bytes, n * page_bytes)]
    # A run breaks wherever either side is not the previous page id + 1. (A plain loop: page
    # lists are short, and numpy's per-call overhead dominated at these sizes.)
    out: list[Span] = []
    run_s, run_d, run_n = int(src_pages[0]), int(dst_pages[0]), 1
    for s, d in zip(src_pages[1:], dst_pages[1:]):
        if s == run_s + run_n and d == run_d + run_n:
            run_n += 1
        else:
            out.append(Span(run_s * page_bytes, run_d * page_bytes, run_n * page_bytes))
            run_s, run_d, run_n = int(s), int(d), 1
    out.append(Span(run_s * page_bytes, run_d * page_bytes, run_n * page_bytes))
    return out


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
