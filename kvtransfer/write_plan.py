"""What one Sender.send() / send_many() writes: parts checked against both layouts, as spans.

A part names, per pool kind, the sender's page ids in request order, optionally where in the
target's page list they start (`first_page`: streaming pages as they become final) and which
byte range of every page to write (`page_byte_range`: one layer, or a run of layers, of
[layer][...] pages; one range for every kind, or one per kind since each kind holds its own
layers). A send_many() of many parts (e.g. every layer of a prefill chunk) is checked as a whole
and posted as ONE write, so a request streamed per layer pays the posting and notification cost
per call, not per layer and pool.

Page checks use C builtins (min/max) on the lists; coalescing is Python for short lists and one
run, numpy for the long ones (a per-layer write of a 32K-token request has ~8,000 page slices,
and a Python object per slice would be most of send()'s host time).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .layout import LayoutDescriptor, PoolLayout
from .protocol import TransferTarget
from .regions import Rows, SpanBatch, coalesce_rows, slice_rows

ByteRange = tuple[int, int]


@dataclass(frozen=True)
class SendPart:
    """One piece of a send_many().

    src_pages: kind -> this worker's page ids in request order (all of the target's pages of
        that kind, or a run of them starting at first_page[kind]).
    page_byte_range: None (whole pages), one (offset_in_page, length) for every kind, or
        kind -> (offset, length) | None per kind (every kind of src_pages must be named).
    first_page: kind -> index into the target's pages where src_pages[kind][0] goes.
    """

    src_pages: Mapping[str, Sequence[int]]
    page_byte_range: ByteRange | Mapping[str, ByteRange | None] | None = None
    first_page: Mapping[str, int] | None = None


def target_pages(target: TransferTarget,
                 peer_layout: LayoutDescriptor) -> dict[str, tuple[int, ...]]:
    """kind -> the target's page ids, each list checked once against the peer's pool size; kept
    per request so later sends only slice it."""
    out = {}
    for kind, ids in target.page_ids:
        if ids and (min(ids) < 0 or max(ids) >= peer_layout.pool(kind).num_pages):
            raise ValueError(f"pool {kind!r}: target page id out of range")
        out[kind] = ids
    return out


def plan_write(request_id: str, parts: Sequence[SendPart], dst: Mapping[str, Sequence[int]],
               pools: Mapping[str, PoolLayout]) -> tuple[SpanBatch, dict[str, tuple[int, ...]]]:
    """(the spans of `parts`, kind -> full source page list for the parts that gave one without
    first_page). Raises ValueError for unknown kinds, counts or ids out of range, bad ranges.

    dst: target_pages() of the request. pools: kind -> this worker's PoolLayout.
    """
    rows: list[tuple[str, Rows]] = []
    full: dict[str, tuple[int, ...]] = {}
    # slices of the same page lists in several parts (a layer each): built together at the end
    sliced: dict[tuple[str, int, int | None], tuple[Sequence[int], Sequence[int], list]] = {}
    for part in parts:
        offsets = part.first_page or {}
        ranges = part.page_byte_range
        for kind, ids in part.src_pages.items():
            to = dst.get(kind)
            if to is None:
                raise ValueError(f"target of {request_id!r} has no pool {kind!r}")
            if isinstance(ids, np.ndarray):
                ids = ids.reshape(-1).tolist()
            start = offsets.get(kind)
            if start is not None:
                to = to[start:start + len(ids)] if start >= 0 else to[:0]
            if len(ids) != len(to) or (start is not None and start < 0):
                raise ValueError(f"pool {kind!r}: {len(ids)} source pages for "
                                 f"{len(dst[kind])} target pages (first page {start})")
            mine = pools[kind]
            if ranges is None or isinstance(ranges, tuple):
                byte_range = ranges
            elif kind in ranges:
                byte_range = ranges[kind]
            else:
                raise ValueError(f"page_byte_range names no range for pool {kind!r}")
            if start is None:   # a partial run is not the full list finish() checksums
                full[kind] = tuple(ids)
            if (byte_range is not None and byte_range[1] != mine.page_bytes
                    and (len(ids) > 1 or len(parts) > 1)):
                # the same list object for many layers: one group (the parts keep it alive)
                sliced.setdefault((kind, id(ids), start), (ids, to, []))[2].append(byte_range)
                continue
            rows.append((kind, coalesce_rows(ids, to, mine.page_bytes, byte_range)))
    for (kind, _, _), (ids, to, byte_ranges) in sliced.items():
        rows.append((kind, slice_rows(ids, to, pools[kind].page_bytes, byte_ranges)))
    for kind, spans in rows:
        pool = pools[kind]
        if not _inside(spans, pool.num_pages * pool.page_bytes):
            raise ValueError(f"pool {kind!r}: source page id out of range")
    return SpanBatch.build(rows), full


def _inside(rows: Rows, pool_bytes: int) -> bool:
    """Every span's source bytes lie in [0, pool_bytes). Checked on the (few) coalesced runs
    rather than on every page id: a run covers exactly its pages, so this is the same check."""
    if isinstance(rows, np.ndarray):
        return not len(rows) or (rows[:, 0].min() >= 0
                                 and int((rows[:, 0] + rows[:, 2]).max()) <= pool_bytes)
    return all(s >= 0 and s + n <= pool_bytes for s, _, n in rows)
