"""Per-layer streaming of a prompt's last chunk: while the engine runs the step that completes a
request's prompt, each model layer's slice of the request's resume pages is written into its
decode target as soon as that layer is computed, so after the last layer only the TransferDone
is left to send.

    ls = LayerStream.plan(planned, deliveries, pools, sender, group=1)   # loop thread, before run
    engine.run(planned, layer_done=ls)      # step thread: ls(i) after model layer i
    ls.result(d) → Streamed                 # loop thread, when shipping d

After model layer i, every byte of layer i in the request's final resume pages is final: the
last chunk wrote its entries, the earlier chunks the rest; SWA window pages, compressed pages
and compress-state rows alike hold each layer in its own slice of the page ([layer][...], see
model/kv_pool.py). A kind's slice of layers [a, b] is one byte range of every page
(`layer_byte_range` over the kind's own layers). Compressed pages that earlier steps already
wrote whole (`Delivery.streamed`) are not written again.

Each write also adds that slice's checksum terms on the device the pages live on
(`range_checksum_tensor`, no synchronisation), so the sender's TransferDone checksums are sums of
tensors computed while the model ran. The checksum is the same function of the same bytes as
`page_checksum` over whole pages: the receiver's verification is unchanged. A kind whose layers
the main model does not all write (the MTP layer, written after them) keeps its other layers for
the ship. On CUDA each write waits for an event recorded after its layer (posted as soon as it
fired, `Sender.post_ready`); on CPU the layer is complete when its hook runs.

The step thread only calls the sender (the loop thread does not touch it while a step runs) and
never raises into the model: a failed write marks the request, whose pages then go whole at the
ship as without streaming.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtransfer.checksum import range_checksum_tensor
from kvtransfer.regions import layer_byte_range
from kvtransfer.sender import Sender
from kvtransfer.write_plan import SendPart
from model.kv_pool import KVPools, SeqKV
from prefill_worker.delivery import Deliveries, Delivery, State


@dataclass
class Streamed:
    """What the step wrote of one request's resume pages, per kind."""

    pages: dict[str, list[int]]  # kind → the final resume pages (as the ship will find them)
    first: dict[str, int]  # kind → leading pages written whole by earlier steps (not written per layer)
    layers: dict[str, set[int]] = field(default_factory=dict)  # kind → its local layer indices written
    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # kind → checksum terms of those slices
    failed: str | None = None  # a write failed: ship everything as without streaming

    def missing(self, pools: KVPools, kind: str) -> list[int]:
        """Local layer indices of `kind` not written by the step."""
        return [i for i in range(len(pools.specs[kind].layers)) if i not in self.layers.get(kind, ())]


@dataclass
class _Request:
    delivery: Delivery
    streamed: Streamed


class LayerStream:
    """Writes the finishing requests' layers of one step; `group` model layers per write."""

    def __init__(self, sender: Sender, pools: KVPools, requests: list[_Request], group: int, num_layers: int):
        self.sender, self.pools, self.requests, self.group, self.num_layers = sender, pools, requests, group, num_layers
        self.local = {k: {layer: i for i, layer in enumerate(s.layers)} for k, s in pools.specs.items()}
        self._next = 0  # first model layer not written yet
        self._cuda = torch.device(pools.device).type == "cuda"

    @classmethod
    def plan(cls, owners: Sequence, deliveries: Deliveries, pools: KVPools, sender: Sender, group: int,
             num_layers: int) -> LayerStream | None:
        """For the jobs of a planned step (`Planned.owners`) whose prompt it completes and whose
        delivery has a target: the stream, or None when there is nothing to stream."""
        if group <= 0:
            return None
        out = []
        for job in owners:
            n = len(job.req.prompt_ids)
            d = deliveries.find(job.req.request_id)
            if job.done != n or d is None or d.state is not State.COMPUTING or d.dest is None:
                continue
            final = pools.resume_pages(SeqKV(job.seq.pages, n))
            pages = {k: list(v) for k, v in final.items() if v}
            first = {k: d.streamed.get(k, 0) for k in pages}
            out.append(_Request(d, Streamed(pages, first)))
        return cls(sender, pools, out, group, num_layers) if out else None

    def result(self, d: Delivery) -> Streamed | None:
        return next((r.streamed for r in self.requests if r.delivery is d), None)

    # --- the step thread -------------------------------------------------------------------
    def __call__(self, layer: int) -> None:
        """Model layer `layer` is computed (its kernels queued, on CUDA)."""
        if (layer + 1) % self.group and layer != self.num_layers - 1:
            return
        lo, self._next = self._next, layer + 1
        ready = None
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record()
        for r in self.requests:
            if r.streamed.failed is None:
                self._write(r, range(lo, layer + 1), ready)
        if self._cuda:
            self.sender.post_ready()

    def _write(self, r: _Request, layers: range, ready) -> None:
        s = r.streamed
        try:
            src, ranges, firsts, wrote = {}, {}, {}, {}
            for kind, pages in s.pages.items():
                local = [self.local[kind][m] for m in layers if m in self.local[kind]]
                rest = pages[s.first[kind]:]
                if not local or not rest:
                    continue
                if local[-1] - local[0] + 1 != len(local):
                    raise ValueError(f"{kind}: layers {list(layers)} are not one run of its pages' slices")
                spec = self.pools.specs[kind]
                src[kind], firsts[kind] = rest, s.first[kind]
                ranges[kind] = layer_byte_range(spec.page_bytes, len(spec.layers), local[0], len(local))
                wrote[kind] = local
            if not src:
                return
            self.sender.send_many(r.delivery.dest.target, (SendPart(src, ranges, firsts),), ready)
            for kind, local in wrote.items():
                s.layers.setdefault(kind, set()).update(local)
                term = range_checksum_tensor(self.pools.buffers[kind], src[kind], firsts[kind], ranges[kind])
                s.sums[kind] = s.sums[kind] + term if kind in s.sums else term
        except Exception as e:  # never into the model's forward: the ship sends the pages whole
            s.failed = f"{type(e).__name__}: {e}"
