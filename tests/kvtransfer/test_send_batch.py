"""The batched send path: several layers' slices in one send() / send_many(), rows built with
numpy for long page lists, and per-peer derived values that never outlive the peer's incarnation.
Two agents in one process, on each transport (NIXL over UCX loopback, and LocalAgents)."""

import random
import time

import numpy as np
import pytest
import torch

from kvtransfer import (Receiver, SendPart, Sender, SpanBatch, StaleTarget,
                        TransferError, coalesce, layer_byte_range)
from kvtransfer.regions import Span, coalesce_rows, slice_rows
from kvt_harness import PageAllocator, make_layout, pump, random_pools

LAYOUT = make_layout(num_pages=40)
LAYERS = dict(LAYOUT.layer_map)          # kind -> layer ids held by its pages


def _layer_ranges(layer):
    return {k: layer_byte_range(LAYOUT.pool(k).page_bytes, len(ids), layer)
            for k, ids in LAYERS.items() if layer < len(ids)}


def _deliver(sender, receiver, rid, src, send):
    """Reserve, write with `send(target)`, finish, wait until verified; the landed pages."""
    target = receiver.reserve(rid, {k: len(v) for k, v in src.items()}, 5.0)
    send(target)
    sender.finish(target, b"h", src_pages=src)
    _, events = pump(sender, receiver, lambda s, r: any(e.request_id == rid for e in r))
    assert [e.kind for e in events if e.request_id == rid] == ["ready"], events
    return receiver.claim(rid)


SRC = {"swa": [7, 3], "c4": list(range(10, 30)) + [2, 5], "c128": [33, 31, 32],
       "state_c4": [0]}
NUM_LAYERS = max(len(v) for v in LAYERS.values())


@pytest.mark.parametrize("shape", ["one_send_many", "one_send_per_layer", "layer_by_pool"])
def test_layer_slices_in_one_write_deliver_the_same_bytes(sides, agents, shape):
    sender, receiver, alloc = sides
    a, b = agents
    parts = [SendPart({k: SRC[k] for k in rs}, rs) for rs in map(_layer_ranges, range(NUM_LAYERS))]

    def send(target):
        if shape == "one_send_many":
            posted = sender.send_many(target, parts)
            # one slice per page and layer (a pool of one layer: whole pages, runs merge)
            dst = target.pages()
            assert posted.descriptors == sum(
                len(SRC[k]) * len(LAYERS[k]) if len(LAYERS[k]) > 1
                else len(coalesce(SRC[k], dst[k], LAYOUT.pool(k).page_bytes)) for k in SRC)
            assert posted.nbytes == sum(len(SRC[k]) * LAYOUT.pool(k).page_bytes for k in SRC)
            assert a.writes_by_path[a.transport("pb")] == writes_before + 1   # one write
        elif shape == "one_send_per_layer":
            for p in parts:
                sender.send(target, p.src_pages, page_byte_range=p.page_byte_range)
        else:
            for p in parts:
                for k, r in p.page_byte_range.items():
                    sender.send(target, {k: SRC[k]}, page_byte_range=r)

    writes_before = a.writes_by_path[a.transport("pb")]
    got = _deliver(sender, receiver, f"bl-{shape}", SRC, send)
    for kind, ids in SRC.items():
        assert torch.equal(b.pools[kind][list(got[kind])], a.pools[kind][ids]), kind
        alloc.free(kind, list(got[kind]))


def test_send_many_mixes_whole_pages_slices_and_runs(sides, agents):
    """Whole pages for some pools, layer slices for others, and a run streamed with first_page:
    together they cover every byte once; the receiver verifies the request as one."""
    sender, receiver, alloc = sides
    a, b = agents
    src = {"c4": [4, 9, 10, 11], "state_c4": [6], "swa": [1]}
    pb = LAYOUT.pool("c4").page_bytes
    halves = [layer_byte_range(pb, 2, i) for i in range(2)]

    def send(target):
        sender.send_many(target, [
            SendPart({"c4": src["c4"][:2]}, {"c4": halves[0]}, first_page={"c4": 0}),
            SendPart({"c4": src["c4"][:2]}, {"c4": halves[1]}, first_page={"c4": 0}),
            SendPart({"c4": src["c4"][2:]}, None, first_page={"c4": 2}),
            SendPart({"state_c4": src["state_c4"], "swa": src["swa"]},
                     {"state_c4": None, "swa": (0, LAYOUT.pool("swa").page_bytes)}),
        ])

    got = _deliver(sender, receiver, "mixed", src, send)
    for kind, ids in src.items():
        assert torch.equal(b.pools[kind][list(got[kind])], a.pools[kind][ids]), kind
        alloc.free(kind, list(got[kind]))


def test_a_bad_part_posts_nothing(sides, agents):
    sender, receiver, _ = sides
    a, _ = agents
    target = receiver.reserve("bad", {"c4": 2, "swa": 1}, 1.0)  # freed soon after teardown
    writes = dict(a.writes_by_path)
    good = SendPart({"c4": [1, 2]}, {"c4": (0, 8)})
    for bad, match in [
        (SendPart({"c4": [1, 2], "swa": [0]}, {"c4": (0, 8)}), "no range for pool 'swa'"),
        (SendPart({"c4": [1, 40]}), "out of range"),
        (SendPart({"swa": [-1]}), "out of range"),
        (SendPart({"c4": [1, 2]}, (0, LAYOUT.pool("c4").page_bytes + 1)), "outside page"),
        (SendPart({"c128": [1]}), "no pool"),
    ]:
        with pytest.raises(ValueError, match=match):
            sender.send_many(target, [good, bad])
    assert a.writes_by_path == writes and sender.in_flight("bad") == 0
    assert "bad" not in sender.holding()       # nothing began: no Begin, nothing held


def test_restarted_peer_gets_fresh_derived_values_and_never_old_writes(new_agent):
    """Per-peer values cached for the hot path (pool regions, a request's target pages) belong to
    one incarnation: after a restart the old target is refused and the new one is written
    through the new registration only."""
    a = new_agent("ra2", random_pools(LAYOUT, 1))
    old = new_agent("rb2", random_pools(LAYOUT, 2))
    new = None
    try:
        sender = Sender(a, LAYOUT, post_margin_s=0.02)
        sender.handshake("rb2", old.metadata(), LAYOUT)
        old.add_peer("ra2", a.metadata())
        t_old = Receiver(old, PageAllocator(LAYOUT), LAYOUT).reserve("r", {"c4": 2}, 5.0)
        sender.send(t_old, {"c4": [3, 4]}, page_byte_range=(0, 16))
        regions_old = a.peer("rb2").regions
        assert regions_old["c4"][0] == old.pools["c4"].data_ptr()
        new = new_agent("rb2", random_pools(LAYOUT, 3))          # restarted
        sender.handshake("rb2", new.metadata(), LAYOUT)
        new.add_peer("ra2", a.metadata())
        assert a.peer("rb2").regions["c4"][0] == new.pools["c4"].data_ptr()
        with pytest.raises(StaleTarget):
            sender.send(t_old, {"c4": [3, 4]})
        with pytest.raises(TransferError):      # the agent refuses the old incarnation too
            a.write("rb2", SpanBatch.from_pairs([("c4", Span(0, 0, 16))]), epoch=old.epoch)
        before_old = old.pools["c4"].clone()
        alloc = PageAllocator(LAYOUT)
        receiver = Receiver(new, alloc, LAYOUT)
        t_new = receiver.reserve("r", {"c4": 2}, 5.0)
        sender.send(t_new, {"c4": [3, 4]})
        sender.finish(t_new, b"")
        events = []
        deadline = time.time() + 5
        while not any(e.kind == "ready" for e in events) and time.time() < deadline:
            sender.poll()
            events += receiver.poll()
        assert [e.kind for e in events] == ["ready"]
        pages = receiver.claim("r")["c4"]
        assert torch.equal(new.pools["c4"][list(pages)], a.pools["c4"][[3, 4]])
        assert torch.equal(old.pools["c4"], before_old)
    finally:
        for ag in (a, old, new):
            if ag is not None:
                ag.close()


def test_agent_refuses_out_of_pool_spans_on_both_descriptor_paths(agents):
    a, b = agents
    n = b.pools["c4"].numel()
    for count in (1, 100):          # Python path for a few spans, numpy for many
        rows = [("c4", Span(i * 16, i * 16, 16)) for i in range(count - 1)]
        with pytest.raises(ValueError, match="outside"):
            a.write("pb", SpanBatch.from_pairs(rows + [("c4", Span(0, n - 8, 16))]))
        with pytest.raises(ValueError, match="outside"):
            a.write("pb", SpanBatch.from_pairs(rows + [("c4", Span(-16, 0, 16))]))


# --------------------------------------------------------------------------- rows

def _naive(src, dst, page_bytes, byte_range):
    off, n = byte_range or (0, page_bytes)
    return [(s * page_bytes + off + i, d * page_bytes + off + i)
            for s, d in zip(src, dst) for i in range(0, n, 4)]


def _expand(rows):
    rows = rows.tolist() if isinstance(rows, np.ndarray) else rows
    return [(s + i, d + i) for s, d, n in rows for i in range(0, n, 4)]


def test_rows_match_the_naive_mapping_on_python_and_numpy_paths():
    rng = random.Random(3)
    for _ in range(300):
        n = rng.choice([1, 2, 5, 16, 17, 40])
        src = rng.sample(range(100), n) if rng.random() < 0.5 else list(range(7, 7 + n))
        dst = sorted(rng.sample(range(100), n)) if rng.random() < 0.5 else list(range(n))
        byte_range = rng.choice([None, (0, 64), (8, 16), (48, 16)])
        rows = coalesce_rows(src, dst, 64, byte_range)
        assert _expand(rows) == _naive(src, dst, 64, byte_range)
        assert [Span(*r) for r in (rows.tolist() if isinstance(rows, np.ndarray) else rows)] \
            == coalesce(src, dst, 64, byte_range)


def test_slice_rows_many_ranges_and_batch_roundtrip():
    rows = slice_rows([3, 9], [0, 1], 100, [(0, 10), (50, 20)])
    assert rows.tolist() == [[300, 0, 10], [900, 100, 10], [350, 50, 20], [950, 150, 20]]
    with pytest.raises(ValueError):
        slice_rows([1], [1], 100, [(90, 20)])
    batch = SpanBatch.build([("c4", rows), ("swa", [(0, 8, 4)]), ("c4", [(1, 2, 3)])])
    assert batch.kinds == ("c4", "swa") and batch.count == 6 and batch.nbytes == 67
    pairs = batch.pairs()
    assert sorted(pairs, key=repr) == sorted(
        [("c4", Span(*r)) for r in rows.tolist()] + [("swa", Span(0, 8, 4)), ("c4", Span(1, 2, 3))],
        key=repr)
    assert SpanBatch.from_pairs(pairs).pairs() == pairs
    half = batch.prefix(0.5)
    assert half.nbytes == 33 and half.pairs()[0] == pairs[0]
