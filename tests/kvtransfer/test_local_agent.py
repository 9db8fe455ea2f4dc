"""LocalAgent itself: writes are posted then land while polled, real bytes move, a gone peer fails
writes like NIXL does, and identity (epochs, metadata, directory) is as strict as the NIXL agent's.
The protocol's state machines run over it in test_inprocess.py / test_fencing.py /
test_send_batch.py (parametrised over both transports)."""

import json

import pytest
import torch

from kvtransfer import (AgentDirectory, LocalAgent, Receiver, Sender, Span, SpanBatch,
                        TransferError)
from kvt_harness import PageAllocator, make_layout, pump, random_pools

LAYOUT = make_layout(num_pages=8)
PB = LAYOUT.pool("c4").page_bytes


def pair(land_after_polls=1):
    d = AgentDirectory()
    a = LocalAgent("la", random_pools(LAYOUT, 1), d, land_after_polls=land_after_polls)
    b = LocalAgent("lb", random_pools(LAYOUT, 2), d, land_after_polls=land_after_polls)
    a.add_peer("lb", b.metadata())
    b.add_peer("la", a.metadata())
    return d, a, b


def page_spans(src, dst):
    return SpanBatch.from_pairs([("c4", Span(s * PB, d * PB, PB)) for s, d in zip(src, dst)])


@pytest.mark.parametrize("polls", [0, 1, 3])
def test_a_write_lands_on_the_poll_that_answers_done(polls):
    _, a, b = pair(polls)
    before = b.pools["c4"].clone()
    h = a.write("lb", page_spans([1, 2], [5, 0]))
    assert a.writes_by_path == {"local": 1} and a.transport("lb") == "local"
    for _ in range(polls):
        assert a.state(h) == "PROC"
        assert torch.equal(b.pools["c4"], before)          # nothing landed yet
    assert a.state(h) == "DONE" and a.state(h) == "DONE"
    assert torch.equal(b.pools["c4"][[5, 0]], a.pools["c4"][[1, 2]])
    assert torch.equal(b.pools["c4"][1:5], before[1:5]) and torch.equal(b.pools["c4"][6:], before[6:])
    assert all(torch.equal(b.pools[k], t) for k, t in b.pools.items() if k != "c4")
    a.release(h)


def test_byte_ranges_and_empty_writes():
    _, a, b = pair(0)
    assert a.write("lb", []) is None
    h = a.write("lb", [("swa", Span(10, 4000, 96)), ("state_c4", Span(0, 1024 * 7 + 1, 1023))])
    assert a.state(h) == "DONE"
    assert torch.equal(b.pools["swa"].view(-1)[4000:4096], a.pools["swa"].view(-1)[10:106])
    assert torch.equal(b.pools["state_c4"].view(-1)[7169:], a.pools["state_c4"].view(-1)[:1023])


def test_refusals_before_anything_is_posted():
    _, a, b = pair()
    with pytest.raises(KeyError):
        a.write("nobody", page_spans([0], [0]))
    with pytest.raises(KeyError):
        a.write("lb", [("c999", Span(0, 0, 8))])
    for span in (Span(0, 8 * PB - 4, 8), Span(-8, 0, 8), Span(8 * PB - 4, 0, 8)):
        with pytest.raises(ValueError, match="outside"):
            a.write("lb", [("c4", span)])
    with pytest.raises(TransferError):
        a.write("lb", page_spans([0], [0]), epoch="0" * 16)
    assert a.writes_by_path["local"] == 0


def test_a_gone_peer_fails_writes_on_post_and_in_flight():
    d, a, b = pair()
    c = LocalAgent("lc", random_pools(LAYOUT, 3), d)
    a.add_peer("lc", c.metadata())
    before_b, before_c = b.pools["c4"].clone(), c.pools["c4"].clone()
    in_flight_b = a.write("lb", page_spans([1], [1]))
    in_flight_c = a.write("lc", page_spans([1], [1]))
    assert a.state(in_flight_b) == a.state(in_flight_c) == "PROC"
    b.close()                    # an orderly shutdown
    d.kill(c.nixl_name)          # a crash: no cleanup at all
    assert a.state(in_flight_b) == a.state(in_flight_c) == "ERR"
    assert torch.equal(b.pools["c4"], before_b) and torch.equal(c.pools["c4"], before_c)
    for name in ("lb", "lc"):
        with pytest.raises(TransferError, match="gone"):
            a.write(name, page_spans([1], [1]))
        assert not a.notify(a.peer(name).nixl_name, b"Dx")
    assert c.recv(b"D") == [] and not c.notify(a.nixl_name, b"Ax")   # the dead do nothing


def test_a_write_to_a_peer_this_agent_dropped_never_lands():
    _, a, b = pair()
    before = b.pools["c4"].clone()
    h = a.write("lb", page_spans([3], [3]))
    a.remove_peer("lb")
    assert a.state(h) == "ERR" and torch.equal(b.pools["c4"], before)


def test_identity_epochs_and_metadata():
    d, a, b = pair()
    md = json.loads(a.metadata())
    assert md["name"] == "la" and a.nixl_name == f"la#{md['epoch']}" and len(md["epoch"]) == 16
    assert b.add_peer("la", a.metadata()) is b.peer("la")           # same epoch: no-op
    with pytest.raises(ValueError, match="not 'lx'"):
        b.add_peer("lx", a.metadata())
    nixl_like = json.dumps({"name": "la", "epoch": md["epoch"], "md": ""}).encode()
    with pytest.raises(ValueError, match="in-process"):
        b.add_peer("la", nixl_like)
    with pytest.raises(ValueError):
        LocalAgent("bad#name", {}, d)
    # a restart under the same name is a new incarnation: loading it replaces the old one
    a2 = LocalAgent("la", random_pools(LAYOUT, 4), d)
    assert a2.epoch != a.epoch and b.add_peer("la", a2.metadata()).nixl_name == a2.nixl_name
    h = b.write("la", page_spans([0], [0]), epoch=a2.epoch)
    assert b.state(h) == "PROC" and b.state(h) == "DONE"
    assert torch.equal(a2.pools["c4"][0], b.pools["c4"][0])
    assert not torch.equal(a.pools["c4"][0], b.pools["c4"][0])      # the old one got nothing


def test_agents_reach_only_their_own_directory():
    _, a, _ = pair()
    stranger = LocalAgent("ls", random_pools(LAYOUT, 5), AgentDirectory())
    a.add_peer("ls", stranger.metadata())
    with pytest.raises(TransferError, match="gone"):
        a.write("ls", page_spans([0], [0]))
    assert not a.notify(stranger.nixl_name, b"Bx")


def test_notifications_by_tag_from_loaded_and_unloaded_senders():
    d, a, b = pair()
    c = LocalAgent("lc", random_pools(LAYOUT, 3), d)
    c.add_peer("lb", b.metadata())              # b has not loaded c: it still hears from it
    assert a.notify(b.nixl_name, b"B1") and c.notify(b.nixl_name, b"D2") and a.notify(b.nixl_name, b"B3")
    assert not b.notify(c.nixl_name, b"A4")     # but answers only peers it loaded
    assert b.recv(b"B") == [(a.nixl_name, b"B1"), (a.nixl_name, b"B3")]
    assert b.recv(b"B") == [] and b.recv(b"D") == [(c.nixl_name, b"D2")]


def test_sender_releases_its_pages_when_the_receiver_dies_mid_write():
    d, a, b = pair()
    sender = Sender(a, LAYOUT, post_margin_s=0.02)
    sender.handshake("lb", b.metadata(), LAYOUT)
    receiver = Receiver(b, PageAllocator(LAYOUT), LAYOUT)
    t = receiver.reserve("dies", {"c4": 2}, 5.0)
    sender.send(t, {"c4": [4, 5]})
    assert sender.in_flight("dies") == 1
    d.kill(b.nixl_name)
    events = []
    while not events:
        events = sender.poll()
    assert [(e.request_id, e.reason, e.src_pages) for e in events] == [
        ("dies", "xfer_error", (("c4", (4, 5)),))]
    assert sender.metrics.failures["xfer_error"] >= 1 and not sender.holding()


def test_a_transfer_over_local_agents_verifies_and_frees_everything():
    _, a, b = pair(2)
    sender = Sender(a, LAYOUT, post_margin_s=0.02)
    sender.handshake("lb", b.metadata(), LAYOUT)
    alloc = PageAllocator(LAYOUT)
    receiver = Receiver(b, alloc, LAYOUT)
    src = {"c4": [7, 2, 3], "swa": [6], "state_c4": [0]}
    t = receiver.reserve("ok", {k: len(v) for k, v in src.items()}, 5.0)
    sender.send(t, src)
    sender.finish(t, b"header")
    s, r = pump(sender, receiver, lambda s, r: s and r)
    assert [(e.kind, e.header) for e in r] == [("ready", b"header")] and [e.reason for e in s] == ["acked"]
    got = receiver.claim("ok")
    for kind, ids in src.items():
        assert torch.equal(b.pools[kind][list(got[kind])], a.pools[kind][ids])
        alloc.free(kind, list(got[kind]))
    assert all(alloc.num_free(k) == alloc.total[k] for k in alloc.total) and receiver.idle()
