"""Outbound (live migration out of a decode worker) into another worker's Inbound, without Ray:
real Senders and Receivers over in-process agents, real DecodeEngines on the tiny model, driven
the way the decode actor drives them (`_migrate_one` / `migrate_in`).

A committed migration continues the token stream and its text exactly where the source paused; a
refused or failed one resumes at the source, exactly; a migration cancelled by its client frees
every page on both workers."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from kvtransfer import AgentDirectory, decode_target
from model.kv_pool import PoolExhausted
from model.tokenizer import ByteTokenizer
from worker_runtime.wire import ErrorCode
from test_inbound import (LEASE_S, DecodeSide, decode_side, local_run, model, request,  # noqa: F401
                          run)


FFFD = "\ufffd"


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class TargetActor:
    """The target worker's actor as Outbound calls it (`actor.abort.remote(id)`), run in place:
    the actor's _abort for a request migrating in: drop its reservation, or the request."""

    def __init__(self, side: DecodeSide):
        self.abort = _Remote(lambda rid: (side.inbound.abort(rid), side.engine.abort(rid)))


def migrate_in(dst: DecodeSide, src: DecodeSide, req, num_tokens: int, lease_s: float = LEASE_S) -> dict:
    """The target's migrate_in: load the source's agent (its Acks must reach it), reserve."""
    dst.agent.add_peer(src.name, src.agent.metadata())
    target = dst.inbound.expect_migration(req, num_tokens, lease_s, src.agent.nixl_name)
    return {"target": target.to_bytes(), "metadata": dst.agent.metadata(),
            "layout": dst.receiver.layout.to_bytes()}


async def migrate(src: DecodeSide, dst: DecodeSide, rid: str, between=None) -> dict:
    """The source's _migrate_one, both workers' loops running until the migration settles.
    between(migration, offer): called once after the ship (the client may leave, bytes may rot)."""
    r = src.pause(rid)
    assert r is not None
    m = src.outbound.begin(r, f"{rid}>m1", dst.name, TargetActor(dst))
    offer = None
    try:
        offer = migrate_in(dst, src, replace(r.req, request_id=m.new_id), r.seq.num_tokens)
        src.outbound.ship(m, offer)
    except Exception as e:  # refused, target gone, stale handshake, lease over: resume here
        src.outbound.fail(m, f"{type(e).__name__}: {e}")
    if between is not None:
        between(m, offer)
    while not m.done.done():
        run([src, dst], lambda: True)
        await asyncio.sleep(0)
    return m.done.result()


def started(model, req, tokens_before=4, **kw):
    """Two decode workers; `req` decoding on the first, `tokens_before` tokens out."""
    directory = AgentDirectory()
    src, dst = decode_side(model, directory, "dA"), decode_side(model, directory, "dB", **kw)
    src.engine.submit(req)
    run([src], lambda: len(src.tokens(req.request_id)) >= tokens_before)
    return src, dst


REQ = request("mig", 130, seed=11, max_tokens=14)  # past the first C4 / C128 windows


@pytest.mark.parametrize("case", ["plain", "stop", "held"])
def test_a_committed_migration_continues_the_stream_exactly(model, case):
    """plain: no stop strings; stop: a stop string completes on the target; held: the move
    happens while text that begins a stop string is held back, and the target releases it."""
    req, tokens_before = REQ, 4
    if case != "plain":
        tokens, text = local_run(model, req)
        at = next(i for i in range(len(text) - 2, 0, -1)
                  if FFFD not in text[i:i + 2] and text.find(text[i:i + 2]) == i)
        req = replace(req, stop_strings=(text[at:at + 2] if case == "stop" else text[at] + "\x01",))
        if case == "held":
            tok = ByteTokenizer(model.cfg.vocab_size)
            tokens_before = next(n for n in range(len(tokens)) if len(tok.decode(tokens[:n])) > at)
    want_tokens, want_text = local_run(model, req)
    src, dst = started(model, req, tokens_before)
    if case == "held":
        assert len(src.text(req.request_id)) == at  # decoded, but held: it may begin the stop string
    result = asyncio.run(migrate(src, dst, req.request_id))
    new_id = f"{req.request_id}>m1"
    assert result == {"request_id": req.request_id, "moved": True, "to": "dB", "as": new_id}
    assert src.chunks[req.request_id][-1].moved.request_id == new_id
    run([src, dst], lambda: dst.ended(new_id))
    assert src.tokens(req.request_id) + dst.tokens(new_id) == want_tokens
    assert src.text(req.request_id) + dst.text(new_id) == want_text
    assert dst.chunks[new_id][-1].finish_reason == ("stop" if case == "stop" else "length")
    assert src.outbound.counts["migrations_out"] == 1 and dst.inbound.counts["migrations_in"] == 1
    run([src, dst], lambda: src.idle() and dst.idle())


def resumed_at_source(model, src: DecodeSide, req) -> None:
    """The request decodes on at the source, exactly as if it had never paused."""
    run([src], lambda: src.ended(req.request_id))
    assert (src.tokens(req.request_id), src.text(req.request_id)) == local_run(model, req)
    assert src.outbound.counts["migrations_out_failed"] == 1


def test_a_target_without_room_refuses_and_the_source_resumes(model):
    src, dst = started(model, REQ, max_seqs=1)
    busy = request("busy", 20, seed=12, max_tokens=30)
    dst.engine.submit(busy)  # the target's one request slot is taken
    run([dst], lambda: dst.tokens("busy"))
    result = asyncio.run(migrate(src, dst, REQ.request_id))
    assert not result["moved"] and result["reason"].startswith(PoolExhausted.__name__)
    resumed_at_source(model, src, REQ)
    run([src, dst], lambda: dst.ended("busy") and src.idle() and dst.idle())


def test_a_rejected_transfer_resumes_at_the_source(model):
    src, dst = started(model, REQ)

    def rot(m, offer):  # a byte of the landed pages changes before the target verifies them
        while src.sender.in_flight(m.new_id):
            src.sender.poll()
        kind, ids = next((k, ids) for k, ids in decode_target(offer["target"]).page_ids if ids)
        dst.pools.buffers[kind][ids[0], 3] ^= 0x01

    result = asyncio.run(migrate(src, dst, REQ.request_id, between=rot))
    assert result == {"request_id": REQ.request_id, "moved": False, "reason": "rejected"}
    assert dst.inbound.counts["migrations_in_failed"] == 1
    assert dst.chunks[f"{REQ.request_id}>m1"][-1].error.code is ErrorCode.KV_TRANSFER_FAILED
    resumed_at_source(model, src, REQ)
    run([src, dst], lambda: src.idle() and dst.idle())


@pytest.mark.parametrize("when", ["before_ship", "shipping"])
def test_a_migration_cancelled_by_its_client_frees_every_page(model, when):
    src, dst = started(model, REQ)
    if when == "before_ship":  # the client left while the target was reserving
        async def go():
            rid = REQ.request_id
            r = src.pause(rid)
            m = src.outbound.begin(r, f"{rid}>m1", dst.name, TargetActor(dst))
            # the source never loads the target, so nothing can answer the target's Ack: its
            # reservation is freed at the end of its lease
            offer = migrate_in(dst, src, replace(r.req, request_id=m.new_id), r.seq.num_tokens, 1.0)
            assert src.outbound.cancel(rid)
            with pytest.raises(RuntimeError, match="cancelled"):
                src.outbound.ship(m, offer)
            src.outbound.fail(m, "RuntimeError: cancelled")
            return m.done.result()

        result = asyncio.run(go())
    else:
        def leave(m, offer):  # writes posted, none landed yet
            assert m.shipping and src.sender.in_flight(m.new_id)
            assert src.outbound.cancel(REQ.request_id)

        result = asyncio.run(migrate(src, dst, REQ.request_id, between=leave))
    assert result is not None and not result["moved"]
    assert REQ.request_id not in src.engine.running and not src.outbound
    assert src.outbound.counts["migrations_out_failed"] == 0
    run([src, dst], lambda: src.idle() and dst.idle())
    assert not dst.engine.running
