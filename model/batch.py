"""A forward batch: several requests' new tokens flattened into one token axis.

Each segment is one request contributing `length` tokens starting at position `start`
(= tokens already in its pools): a prefill chunk (any start, any length, e.g. after a cached
prefix) or a single-token decode. Segments are independent; the model reads and writes each
request's pools through its own `SeqKV` page tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.kv_pool import SeqKV


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
        return cls(torch.tensor(ids, dtype=torch.long, device=device),
                   torch.tensor(pos, dtype=torch.long, device=device), tuple(segs))

    @property
    def last_rows(self) -> torch.Tensor:
        """Index of each segment's last token: the rows whose logits sample the next token."""
        return torch.tensor([s.offset + s.length - 1 for s in self.segments], device=self.input_ids.device)

    def commit(self) -> None:
        """Mark the batch's tokens as cached in their requests' pools (after a forward)."""
        for s in self.segments:
            s.seq.num_tokens = s.end
