"""Inbound (KV arriving at a decode worker) without Ray: a real Receiver over in-process agents
(kvtransfer.LocalAgent), a real DecodeEngine on the tiny model, and a prefill side made of a
PrefillEngine and a Sender that ships what it computed, as the prefill worker does.

A verified delivery decodes exactly the tokens of the engine's own prefill of the request; a
delivery that fails in any way (corrupt, lease over, prefill worker failed) is recomputed here and
still yields those tokens; and every page returns to its pool."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace

import pytest

from decode_worker.engine import DecodeEngine
from decode_worker.inbound import Inbound
from decode_worker.outbound import Outbound
from kvtransfer import AgentDirectory, LocalAgent, Receiver, Sender
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tiny import random_model, tiny_config
from model.tokenizer import ByteTokenizer
from prefill_worker.engine import PrefillEngine, Prefilled
from worker_runtime.kv_link import layout_of, pool_buffers
from worker_runtime.wire import GenerateRequest, TransferHeader

ENCODING = "fp8_pack"  # the production page encoding: its bytes are what the checksums cover
LEASE_S = 120.0  # prefill runs Triton kernels in the interpreter here: slow


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(index_topk=128))  # top-k covers every compressed entry: no tie-order effects


# --------------------------------------------------------------------------- the two sides

@dataclass
class DecodeSide:
    """A decode worker's transfer parts, as the actor wires them, minus Ray."""

    name: str
    pools: KVPools
    agent: LocalAgent
    engine: DecodeEngine
    receiver: Receiver
    sender: Sender
    inbound: Inbound
    outbound: Outbound
    chunks: dict = field(default_factory=dict)  # request id -> its TokenChunks, in order

    def route(self, chunks) -> None:
        """As the actor routes chunks: a transfer's stats ride on the request's next chunk."""
        for c in chunks:
            stats = self.inbound.stats.pop(c.request_id, None)
            if stats is not None:
                c = replace(c, transfer=stats)
            self.chunks.setdefault(c.request_id, []).append(c)

    def pause(self, rid: str):
        """As the actor pauses for a migration: the chunks of a step the pause settled go out first."""
        r = self.engine.pause(rid)
        self.route(self.engine.take_failed())
        return r

    def tokens(self, rid: str) -> list[int]:
        return [t for c in self.chunks.get(rid, []) for t in c.token_ids]

    def text(self, rid: str) -> str:
        return "".join(c.text for c in self.chunks.get(rid, []))

    def ended(self, rid: str) -> bool:
        return any(c.finish_reason or c.error or c.moved for c in self.chunks.get(rid, []))

    def idle(self) -> bool:
        """Page accounting back at its idle level, nothing held for a transfer either way."""
        return (self.pools.num_free() == self.pools.idle_free() and self.receiver.idle()
                and not self.sender.holding() and not self.inbound and not self.outbound)


def decode_side(model, directory: AgentDirectory, name: str, max_seqs: int = 4) -> DecodeSide:
    pools = KVPools(model.cfg, ENCODING, max_tokens=512, max_seqs=max_seqs)
    agent = LocalAgent(name, pool_buffers(pools), directory)
    layout = layout_of(pools)
    engine = DecodeEngine(model, pools, ByteTokenizer(model.cfg.vocab_size), name)
    receiver = Receiver(agent, pools, layout, grace_s=0.05)
    sender = Sender(agent, layout, post_margin_s=0.02)
    return DecodeSide(name, pools, agent, engine, receiver, sender, Inbound(receiver, pools, engine),
                      Outbound(sender, pools, engine))


@dataclass
class PrefillSide:
    name: str
    pools: KVPools
    agent: LocalAgent
    engine: PrefillEngine
    sender: Sender
    shipped: dict = field(default_factory=dict)  # target request id -> Prefilled, until answered
    answers: dict = field(default_factory=dict)  # target request id -> the sender's last reason

    def prefill(self, req: GenerateRequest) -> Prefilled:
        self.engine.submit(req)
        done: list[Prefilled] = []
        while not done:
            done = self.engine.step()
        return done[0]

    def ship(self, target, done: Prefilled) -> None:
        """What the prefill worker does with a computed request: WRITE its resume pages, then
        TransferDone with the header; its pages stay held until the sender's answer."""
        pages = {k: v for k, v in self.pools.resume_pages(done.seq).items() if v}
        self.sender.send(target, pages)
        header = TransferHeader(done.seq.num_tokens, done.first_token, done.computed_tokens)
        self.sender.finish(target, header.to_bytes(), src_pages=pages)
        self.shipped[target.request_id] = done

    def poll(self) -> None:
        for ev in self.sender.poll():
            self.answers[ev.request_id] = ev.reason
            done = self.shipped.pop(ev.request_id, None)
            if done is not None:
                self.engine.release(done)

    def idle(self) -> bool:
        return self.pools.num_free() == self.pools.idle_free() and not self.sender.holding()


def prefill_side(model, directory: AgentDirectory, name: str = "p0") -> PrefillSide:
    pools = KVPools(model.cfg, ENCODING, max_tokens=512, max_seqs=4)
    agent = LocalAgent(name, pool_buffers(pools), directory)
    return PrefillSide(name, pools, agent, PrefillEngine(model, pools, name),
                       Sender(agent, layout_of(pools), post_margin_s=0.02))


def connect(p: PrefillSide, d: DecodeSide) -> None:
    p.sender.handshake(d.name, d.agent.metadata(), d.receiver.layout)
    d.agent.add_peer(p.name, p.agent.metadata())  # so its Acks reach the prefill worker


def run(sides, until, timeout_s: float = 120.0) -> None:
    """The workers' loops, interleaved: poll transfers in and out, step the engines."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for s in sides:
            if isinstance(s, PrefillSide):
                s.poll()
                continue
            s.route(s.inbound.poll())
            s.route(s.outbound.poll())
            if s.engine.has_work():
                s.route(s.engine.step())
        if until():
            return
        time.sleep(0.001)
    raise AssertionError("did not settle")


def local_run(model, req: GenerateRequest) -> tuple[list[int], str]:
    """Tokens and text of the request prefilled and decoded by one engine alone."""
    d = decode_side(model, AgentDirectory(), "solo")
    d.engine.submit(req)
    run([d], lambda: d.ended(req.request_id))
    return d.tokens(req.request_id), d.text(req.request_id)


def request(rid: str, n: int, seed: int, max_tokens: int = 8) -> GenerateRequest:
    rng = random.Random(seed)
    sampling = SamplingParams(temperature=0.8, top_k=40, seed=seed) if seed % 2 else SamplingParams()
    return GenerateRequest(rid, tuple(rng.randrange(256) for _ in range(n)), max_tokens=max_tokens,
                           sampling=sampling, ignore_eos=True)


@pytest.fixture
def pd(model):
    """(prefill side, decode side) connected over one directory."""
    directory = AgentDirectory()
    p, d = prefill_side(model, directory), decode_side(model, directory, "d0")
    connect(p, d)
    return p, d


# --------------------------------------------------------------------------- deliveries

@pytest.mark.parametrize("n", [40, 300])  # within one SWA window, and past it (C4/C128 pages)
def test_a_verified_delivery_decodes_as_the_local_prefill_would(model, pd, n):
    p, d = pd
    req = request(f"v{n}", n, seed=n)
    target = d.inbound.expect_prefill(req, "prefill", LEASE_S, None, p.agent.nixl_name)
    assert target is not None and d.inbound.awaiting[req.request_id].source == "prefill"
    done = p.prefill(req)
    p.ship(target, done)
    run([p, d], lambda: d.ended(req.request_id) and not p.shipped)
    want_tokens, want_text = local_run(model, req)
    assert d.tokens(req.request_id) == want_tokens and d.text(req.request_id) == want_text
    first = d.chunks[req.request_id][0]
    assert first.token_ids == (done.first_token,) and first.transfer.failure is None
    assert first.transfer.nbytes > 0 and first.transfer.source == "prefill"
    assert p.answers == {req.request_id: "acked"} and d.inbound.counts["fallbacks"] == 0
    assert d.idle() and p.idle()


def flip_a_landed_byte(p: PrefillSide, d: DecodeSide, target) -> None:
    """Let the writes land and TransferDone go out, then damage one byte of the landed pages
    before the receiver verifies them."""
    while p.sender.in_flight(target.request_id):
        p.sender.poll()
    kind, ids = next((k, ids) for k, ids in target.page_ids if ids)
    d.pools.buffers[kind][ids[0], 7] ^= 0x10


def test_a_corrupt_transfer_is_recomputed_here(model, pd):
    p, d = pd
    req = request("c", 150, seed=3)
    target = d.inbound.expect_prefill(req, "prefill", LEASE_S, None, p.agent.nixl_name)
    p.ship(target, p.prefill(req))
    flip_a_landed_byte(p, d, target)
    run([p, d], lambda: d.ended(req.request_id) and not p.shipped)
    assert d.tokens(req.request_id) == local_run(model, req)[0]
    stats = d.chunks[req.request_id][0].transfer
    assert stats.failure == "corrupt" and stats.nbytes == 0
    assert d.inbound.counts["fallbacks"] == 1 and d.receiver.metrics.failures["checksum"] == 1
    assert p.answers == {req.request_id: "rejected"}  # the prefill worker hears it and lets go
    assert d.idle() and p.idle()


def test_a_lease_that_runs_out_is_recomputed_here(model, pd):
    p, d = pd
    req = request("l", 60, seed=4)
    d.inbound.expect_prefill(req, "prefill", 0.2, None, p.agent.nixl_name)  # the prefill never comes
    run([p, d], lambda: d.ended(req.request_id) and d.idle())
    assert d.tokens(req.request_id) == local_run(model, req)[0]
    assert d.chunks[req.request_id][0].transfer.failure == "expired"
    assert d.inbound.counts["fallbacks"] == 1


def test_a_failed_prefill_is_recomputed_here(model, pd):
    p, d = pd
    req = request("f", 90, seed=5)
    target = d.inbound.expect_prefill(req, "prefill", LEASE_S, None, p.agent.nixl_name)
    d.inbound.failed(req.request_id, "prefill_failed")  # its actor call raised
    assert not d.inbound and d.receiver.held() == {req.request_id: "fencing"}
    run([p], lambda: d.receiver.poll() == [] and d.receiver.idle())
    assert time.time() < target.lease_deadline  # freed on the sender's Fenced, not at the lease
    run([p, d], lambda: d.ended(req.request_id) and d.idle())
    assert d.tokens(req.request_id) == local_run(model, req)[0]
    assert d.chunks[req.request_id][0].transfer.failure == "prefill_failed"
    assert d.inbound.counts["fallbacks"] == 1


def test_a_failure_report_for_a_migration_leaves_it_to_its_source(model, pd):
    _, d = pd
    req = request("m", 30, seed=6)
    d.inbound.expect_migration(req, 30, 0.3, "elsewhere#0")
    d.inbound.failed(req.request_id, "prefill_failed")
    assert req.request_id in d.inbound.awaiting and not d.engine.waiting
    d.inbound.abort(req.request_id)  # its sender never answers: the pages wait out the lease
    run([d], lambda: d.idle())
    assert not d.chunks and d.inbound.counts["fallbacks"] == 0


@pytest.mark.parametrize("when", ["reserved", "writing", "written", "decoding"])
def test_an_abort_at_any_point_frees_every_page(model, pd, when):
    p, d = pd
    req = request(f"a-{when}", 300, seed=7, max_tokens=50)
    target = d.inbound.expect_prefill(req, "prefill", LEASE_S, None, p.agent.nixl_name)
    if when != "reserved":
        done = p.prefill(req)
        pages = {k: v for k, v in p.pools.resume_pages(done.seq).items() if v}
        p.sender.send(target, pages)  # posted, not landed
        p.shipped[req.request_id] = done
        if when != "writing":
            p.sender.finish(target, TransferHeader(done.seq.num_tokens, done.first_token,
                                                   done.computed_tokens).to_bytes(), src_pages=pages)
            while p.sender.in_flight(req.request_id):
                p.sender.poll()
        if when == "decoding":
            run([p, d], lambda: len(d.tokens(req.request_id)) >= 3)
    assert not d.idle()
    seen = len(d.tokens(req.request_id))
    # what the actor's _abort does: the reservation, then the engine
    d.inbound.abort(req.request_id)
    d.engine.abort(req.request_id)
    run([p, d], lambda: d.idle() and p.idle())
    assert (seen > 0) == (when == "decoding")
    assert len(d.tokens(req.request_id)) == seen and not d.ended(req.request_id)  # nothing more
    assert d.inbound.counts["fallbacks"] == 0 and not d.engine.waiting


# --------------------------------------------------------------------------- reserved when the prefill starts

def test_a_request_queued_at_the_prefill_worker_holds_nothing_and_never_expires(model, pd):
    """await_prefill reserves nothing: however long the prefill worker's queue, no lease runs; the
    pages are reserved when that worker is about to start it, and the KV then arrives verified."""
    p, d = pd
    req = request("q", 40, seed=8)
    free = d.pools.num_free()
    d.inbound.await_prefill(req, None, p.agent.nixl_name)
    with pytest.raises(ValueError, match="already awaited"):
        d.inbound.await_prefill(req, None, p.agent.nixl_name)
    a = d.inbound.awaiting[req.request_id]
    assert a.queued and d.pools.num_free() == free and d.receiver.idle()
    time.sleep(0.3)  # longer than a (short) lease: nothing is held, so nothing expires
    assert d.inbound.poll() == [] and a.queued
    target = d.inbound.reserve(req.request_id, LEASE_S)  # the lease covers the compute and transfer only
    assert target is not None and not a.queued and d.inbound.reserve(req.request_id, LEASE_S) == target
    assert d.receiver.held() == {req.request_id: "waiting"}
    p.ship(target, p.prefill(req))
    run([p, d], lambda: d.ended(req.request_id) and not p.shipped)
    assert d.tokens(req.request_id) == local_run(model, req)[0]
    assert d.chunks[req.request_id][0].transfer.failure is None and d.inbound.counts["fallbacks"] == 0
    with pytest.raises(KeyError):  # not awaited here any more: the prefill worker is told "gone"
        d.inbound.reserve(req.request_id, LEASE_S)
    assert d.idle() and p.idle()


def test_no_room_at_the_reservation_keeps_it_queued_until_there_is(model):
    directory = AgentDirectory()
    p, d = prefill_side(model, directory), decode_side(model, directory, "d0", max_seqs=1)
    connect(p, d)
    first, second = request("n1", 400, seed=9), request("n2", 400, seed=10)
    d.inbound.await_prefill(first, None, p.agent.nixl_name)
    d.inbound.await_prefill(second, None, p.agent.nixl_name)
    target = d.inbound.reserve(first.request_id, LEASE_S)
    assert target is not None
    assert d.inbound.reserve(second.request_id, LEASE_S) is None  # no room: still queued, nothing held
    assert d.inbound.awaiting[second.request_id].queued and set(d.receiver.held()) == {first.request_id}
    d.inbound.abort(first.request_id)
    d.engine.abort(first.request_id)
    run([p, d], lambda: d.receiver.idle())
    assert d.inbound.reserve(second.request_id, LEASE_S) is not None


@pytest.mark.parametrize("how", ["abort", "prefill_failed"])
def test_a_queued_request_aborted_or_failed_frees_nothing_it_never_had(model, pd, how):
    p, d = pd
    req = request(f"x-{how}", 40, seed=11)
    d.inbound.await_prefill(req, None, p.agent.nixl_name)
    if how == "abort":
        assert d.inbound.abort(req.request_id).queued
        assert not d.engine.waiting and not d.inbound
    else:  # the prefill worker died while the request was queued there: recomputed here
        d.inbound.failed(req.request_id, "prefill_failed")
        run([p, d], lambda: d.ended(req.request_id))
        assert d.tokens(req.request_id) == local_run(model, req)[0]
        assert d.chunks[req.request_id][0].transfer.failure == "prefill_failed"
    assert d.idle() and p.idle()

