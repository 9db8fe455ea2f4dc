"""A forward batch: several requests' new tokens flattened into one token axis.

Each segment is one request contributing `length` tokens starting at position `start`
(= tokens already in its pools): a prefill chunk (any start, any length, e.g. after a cached
prefix) or a single-token decode. Segments are independent; the model reads and writes each
request's pools through its own `SeqKV` page tables.

The torch reference path walks `segments`; the kernels read the same facts as device tensors
(`BatchMeta`, built once per batch in one host→device copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from model.kv_pool import ALL_KINDS, SeqKV


@dataclass(frozen=True)
class BatchMeta:
    """Device-side view of a batch for the kernels (int32 unless noted).

    token_seq [T]: segment of each token; positions [T]; seg_start, seg_end [B] (absolute
    positions, end exclusive); tables[kind] [B, P_kind]: page ids (-1 released), padded with -1;
    max_end: the largest `seg_end` (host int: bounds the compressed entries any query can see).
    """

    token_seq: torch.Tensor
    positions: torch.Tensor
    seg_start: torch.Tensor
    seg_end: torch.Tensor
    tables: dict[str, torch.Tensor]
    max_end: int

    @classmethod
    def build(cls, segments: tuple["Segment", ...], device: torch.device) -> "BatchMeta":
        widths = {k: max(1, max(len(s.seq.pages[k]) for s in segments)) for k in ALL_KINDS}
        token_seq = [i for i, s in enumerate(segments) for _ in range(s.length)]
        positions = [p for s in segments for p in range(s.start, s.end)]
        parts = [token_seq, positions, [s.start for s in segments], [s.end for s in segments]]
        for k in ALL_KINDS:
            for s in segments:
                pages = s.seq.pages[k]
                parts.append(list(pages) + [-1] * (widths[k] - len(pages)))
        flat = torch.tensor([v for part in parts for v in part], dtype=torch.int32).to(device, non_blocking=True)
        T, B = len(token_seq), len(segments)
        views = list(flat.split([T, T, B, B] + [B * widths[k] for k in ALL_KINDS]))
        tables = {k: v.view(B, widths[k]) for k, v in zip(ALL_KINDS, views[4:])}
        return cls(views[0], views[1], views[2], views[3], tables, max(s.end for s in segments))


@dataclass(frozen=True)
class Segment:
    seq: SeqKV
    start: int  # absolute position of the first new token
    length: int
    offset: int  # index of the first new token in the flattened batch

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.length)


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    segments: tuple[Segment, ...]
    host_ids: tuple[int, ...] = ()  # input_ids as the host built them (read without a device sync)

    @classmethod
    def build(cls, items: list[tuple[SeqKV, list[int]]], device: str | torch.device = "cpu") -> "ForwardBatch":
        """items: (request pools, its new token ids); positions continue from `seq.num_tokens`."""
        ids, pos, segs, offset = [], [], [], 0
        for seq, tokens in items:
            if not tokens:
                raise ValueError("a segment needs at least one token")
            segs.append(Segment(seq, seq.num_tokens, len(tokens), offset))
            ids.extend(tokens)
            pos.extend(range(seq.num_tokens, seq.num_tokens + len(tokens)))
            offset += len(tokens)
        # through page-locked memory (`to_device`): a copy from pageable memory would wait for the
        # work queued before it
        flat = to_device(ids + pos, device, torch.long)
        return cls(flat[:offset], flat[offset:], tuple(segs), tuple(ids))

    @cached_property
    def meta(self) -> BatchMeta:
        """The batch as device tensors for the kernels (built on first use)."""
        return BatchMeta.build(self.segments, self.input_ids.device)

    @property
    def last_rows(self) -> torch.Tensor:
        """Index of each segment's last token: the rows whose logits sample the next token."""
        return torch.tensor([s.offset + s.length - 1 for s in self.segments], device=self.input_ids.device)

    def commit(self) -> None:
        """Mark the batch's tokens as cached in their requests' pools (after a forward)."""
        for s in self.segments:
            s.seq.num_tokens = s.end


def to_device(values: list, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a tensor on `device`; to a GPU through page-locked memory, so the copy
    is queued on the stream rather than waiting for the work queued before it (a copy from
    pageable memory waits for it)."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor's copy on `device`, as `to_device` makes it."""
    device = torch.device(device)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


@dataclass(frozen=True)
class HostCopy:
    """A device tensor's copy to the host, queued on the stream (into page-locked memory on a GPU,
    which the copy fills asynchronously): work queued after it does not delay it, and `wait`
    waits for the copy alone."""

    host: torch.Tensor
    copied: torch.cuda.Event | None

    @classmethod
    def queue(cls, t: torch.Tensor) -> "HostCopy":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=True)
        copied = torch.cuda.Event() if t.is_cuda else None
        if copied is not None:
            copied.record()
        return cls(host, copied)

    def wait(self) -> list:
        """The values, as `tolist` gives them, once the copy has run."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()
