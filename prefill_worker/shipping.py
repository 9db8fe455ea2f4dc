"""What a prefill worker sends to decode workers: the handshake with each (again when its epoch
changes), the compressed pages each step made final while the prompt is still being computed,
the rest and the completion notice once it is (layer by layer when the last chunk streamed its
layers), and the sender's answers settling each delivery (prefill_worker/delivery.py)."""

from __future__ import annotations

import logging

from kvtransfer.checksum import range_checksum_tensor
from kvtransfer.layout import LayoutDescriptor
from kvtransfer.regions import layer_byte_range
from kvtransfer.sender import Sender
from kvtransfer.transport import metadata_epoch
from kvtransfer.write_plan import SendPart
from model.kv_pool import RATIO_OF_KIND, KVPools
from prefill_worker.delivery import Asker, Deliveries, Delivery, Destination, State, TransferFailed
from prefill_worker.engine import PrefillEngine
from prefill_worker.layer_stream import LayerStream, Streamed
from worker_runtime.wire import TransferHeader

log = logging.getLogger(__name__)


class Shipping:
    def __init__(self, sender: Sender, pools: KVPools, engine: PrefillEngine, deliveries: Deliveries):
        self.sender, self.pools, self.engine, self.deliveries = sender, pools, engine, deliveries
        self.peers: dict[str, str] = {}  # agent name → epoch of the last handshake
        self.streamed_pages = 0  # pages shipped before their request's prefill ended
        self.layer_streamed = 0  # requests whose last chunk went layer by layer as it was computed

    def connect_early(self, dest: Destination | Asker) -> None:
        """Know the decode worker from the moment it reserves pages for us (or is asked to), not
        from the first write: if it gives the reservation up first (lease over, abort), its Ack
        must find us able to answer Fenced, or its pages wait out the receiver's fence timeout. A
        refused handshake is left to _ship, which reports it."""
        try:
            if isinstance(dest, Asker):  # a worker's id is its agent's name
                self.handshake(dest.decode_id, metadata_epoch(dest.metadata), dest.metadata, dest.layout)
            else:
                self.connect(dest)
        except Exception as e:
            log.debug("early handshake with %s failed: %s", getattr(dest, "decode_id", None) or dest.request_id, e)

    def connect(self, dest: Destination) -> None:
        self.handshake(dest.target.agent_name, dest.target.agent_epoch, dest.metadata, dest.layout)

    def handshake(self, name: str, epoch: str, metadata: bytes, layout: bytes) -> None:
        if self.peers.get(name) != epoch:
            self.sender.handshake(name, metadata, LayoutDescriptor.from_bytes(layout))
            self.peers[name] = epoch

    def computed(self, finished: list, stream: LayerStream | None = None) -> None:
        """After a step: ship what the engine finished, stream what became final of the rest."""
        for done in finished:
            d = self.deliveries.find(done.request_id)
            self.deliveries.computed(d, done)
            if d.state is State.SHIPPING:
                self.ship(d, stream.result(d) if stream is not None else None)
        self.stream_progress()

    def stream_progress(self) -> None:
        """Write the compressed pages that became final in this step (every page whose entries
        are all written), so the transfer overlaps the prefill of the next chunks."""
        for d in self.deliveries.in_state(State.COMPUTING):
            job = self.engine.running.get(d.request_id)
            if job is None or job.seq is None:
                continue
            runs, offsets = {}, {}
            for kind, pages in d.dest.target.page_ids:
                if kind not in RATIO_OF_KIND:
                    continue  # SWA (only the last window) and state rings go at the end
                final = job.seq.num_tokens // RATIO_OF_KIND[kind] // self.pools.specs[kind].entries_per_page
                final = min(final, len(pages))
                if final > d.streamed.get(kind, 0):
                    runs[kind] = job.seq.pages[kind][d.streamed.get(kind, 0):final]
                    offsets[kind] = d.streamed.get(kind, 0)
            if not runs:
                continue
            try:
                self.connect(d.dest)
                self.sender.send(d.dest.target, runs, first_page=offsets)
            except Exception as e:  # the target is gone or refused: the KV is parked once computed
                log.warning("streaming %s failed: %s", d.request_id, e)
                self.sender.abort(d.dest.request_id)
                self.deliveries.detach(d, TransferFailed(str(e)))
                continue
            for kind, run in runs.items():
                d.streamed[kind] = offsets[kind] + len(run)
                self.streamed_pages += len(run)

    def ship(self, d: Delivery, streamed: Streamed | None = None) -> None:
        """Write the rest of a computed request (what was not streamed, per chunk or per layer)
        and notify its target."""
        done, dest, sent = d.done, d.dest, d.streamed
        try:
            self.connect(dest)
            # kinds with no pages yet (e.g. c128 before 128 tokens) are not part of the target
            pages = {k: v for k, v in self.pools.resume_pages(done.seq).items() if v}
            sums = None
            if streamed is not None and streamed.failed is None and streamed.pages == pages:
                parts, sums = self._after_layers(streamed)
                if parts:
                    self.sender.send_many(dest.target, parts)
                self.layer_streamed += 1
            else:
                rest = {k: v[sent.get(k, 0):] for k, v in pages.items() if v[sent.get(k, 0):]}
                if rest:
                    self.sender.send(dest.target, rest, first_page={k: sent.get(k, 0) for k in rest})
            header = TransferHeader(done.seq.num_tokens, done.first_token, done.computed_tokens, done.first_logprobs,
                                    done.prompt_logprobs)
            self.sender.finish(dest.target, header.to_bytes(), src_pages=pages, checksums=sums)
        except Exception as e:  # mismatch, stale target, lease over: nothing usable was declared
            log.warning("shipping %s failed: %s", d.request_id, e)
            self.sender.abort(dest.request_id)
            if dest.request_id in self.sender.holding():  # writes in flight: settled at the sender's answer
                self.deliveries.answer(d, TransferFailed(str(e)))
            else:
                self.deliveries.lost(d, TransferFailed(str(e)))

    def _after_layers(self, s: Streamed) -> tuple[list[SendPart], dict]:
        """What the step's layer writes left: the slices of layers the main model does not write
        (the MTP layer's), as parts; and the checksums of the kinds whose every layer went, from
        the terms summed on the device while they were written plus the leading pages that
        earlier steps wrote whole."""
        parts, sums = [], {}
        for kind, pages in s.pages.items():
            first, spec = s.first[kind], self.pools.specs[kind]
            missing = s.missing(self.pools, kind)
            if not missing and kind in s.sums:
                lead = range_checksum_tensor(self.pools.buffers[kind], pages[:first]) if first else 0
                sums[kind] = s.sums[kind] + lead
                continue
            if not missing or not pages[first:]:
                continue
            runs = [[missing[0]]]
            for i in missing[1:]:
                if i == runs[-1][-1] + 1:
                    runs[-1].append(i)
                else:
                    runs.append([i])
            for run in runs:
                r = layer_byte_range(spec.page_bytes, len(spec.layers), run[0], len(run))
                parts.append(SendPart({kind: pages[first:]}, {kind: r}, {kind: first}))
        return parts, sums

    def poll(self) -> None:
        for ev in self.sender.poll():
            d = self.deliveries.find(ev.request_id)
            if d is None or d.state not in (State.SHIPPING, State.ABORTING) or d.dest.request_id != ev.request_id:
                continue  # an earlier delivery of a re-pulled request (or one that never shipped)
            self.deliveries.settle(d, ev.reason)
            if d.state is not State.PARKED:  # acked, given up or aborted: the pages go back
                self.engine.release(d.done)
