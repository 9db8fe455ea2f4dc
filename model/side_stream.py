"""A stream beside the current one, for work of a block whose results are read later in the same
step: the mHC entries' post / comb (`mhc.EntryScratch`) and the attention's compressors
(`Attention.forward`). At one token these are chains of small latency-bound launches; beside the
weight-streaming products of the main stream they cost nothing on its critical path.

Invariants: side work is queued after everything the current stream had when it was forked
(`fork`), the current stream waits for all of it at `join`, and a tensor made on the side stream
and read on the current one is `keep`-marked so its memory is not handed out again before that
read. A join with nothing launched since the last one adds no wait, so a captured graph never
waits on a stream it did not fork.
"""

from __future__ import annotations

import contextlib

import torch


class SideStreams:
    """A model's two side streams on one device, taken at its first step there and used by every
    layer and step after: the blocks' (`SideStream`) and the MoE's shared expert. Both come from
    torch's high-priority pool, which only the model's side work draws from (kvtransfer's copy
    streams come from the default one), so no other thread's work shares them or joins a graph
    captured on them.

    One pair, not a stream per call: the caching allocator keeps freed memory per stream, and a
    stream per call (the pool has 32) would make each of them hold its own copy of a step's side
    activations, which at prefill sizes no other stream could reuse (GiBs beyond what one step
    needs, found only once load has cycled through the pool)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.block = torch.cuda.Stream(self.device, priority=-1)
        self.shared = torch.cuda.Stream(self.device, priority=-1)

    @classmethod
    def on(cls, device: torch.device | str) -> "SideStreams | None":
        """Side streams on a CUDA device, None elsewhere (the work then runs in order)."""
        return cls(device) if torch.device(device).type == "cuda" else None

    def __deepcopy__(self, memo) -> "SideStreams":
        return self  # a copied model steps on the same device: it may share the streams


class SideStream:
    """A block's side work in one step, on `stream` (the model's `SideStreams.block`)."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream):
        self.device, self.stream = device, stream
        self._pending = False  # side work launched since the last join

    @classmethod
    def beside(cls, device: torch.device | str) -> "SideStream | None":
        """A side stream of its own on a CUDA device, None elsewhere (the work then runs in order)."""
        streams = SideStreams.on(device)
        return cls(streams.device, streams.block) if streams is not None else None

    def fork(self) -> contextlib.AbstractContextManager:
        """A context for side launches, queued after the work so far on the current stream (in
        order when the pool's stream is the current one)."""
        main = torch.cuda.current_stream(self.device)
        if main == self.stream:
            return contextlib.nullcontext()
        self.stream.wait_stream(main)
        self._pending = True
        return torch.cuda.stream(self.stream)

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """Mark `t`, made on the side stream, as read by the current one (its memory is reused only
        after that use); returns t."""
        t.record_stream(torch.cuda.current_stream(self.device))
        return t

    def join(self) -> None:
        """The current stream waits for the side work launched since the last join."""
        if self._pending:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._pending = False


def fork(side: SideStream | None) -> contextlib.AbstractContextManager:
    """`side.fork()`, or in order without a side stream."""
    return side.fork() if side is not None else contextlib.nullcontext()


def join(side: SideStream | None) -> None:
    """`side.join()`; nothing without a side stream."""
    if side is not None:
        side.join()
