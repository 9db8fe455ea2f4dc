"""Cross-process transfers over real NIXL (UCX, CPU memory): A and B are separate OS processes.

A is the sender (prefill side), B the receiver (decode side). Every test ends with both sides
back at their idle page count.
"""

import time

import pytest

from kvtransfer import FaultPlan, coalesce, layer_byte_range
from kvtransfer.faults import KILL_EXIT_CODE, SENDER_BEFORE_DONE
from kvt_harness import KINDS, Worker, WorkerError, connect, make_layout, start

COUNTS = {"swa": 2, "c4": 6, "c128": 4, "state_c4": 1}


@pytest.fixture(scope="module")
def pair():
    a, b = start(Worker("prefill-0", seed=1), Worker("decode-0", seed=2))
    connect(a, b)
    yield a, b
    a.close()
    b.close()


def settle_idle(*workers, timeout=10.0):
    for w in workers:
        st = w.call("settle", timeout=timeout)
        assert st["free"] == st["total"], (w.name, st)
        assert not st["held"] and not st["holding"], (w.name, st)


def expect(w, *want, timeout=10.0):
    """Wait for events (side, request id, kind) on worker w; all must arrive. Returns all."""
    evs = w.call("events", list(want), timeout, timeout=timeout + 5)
    got = {e[:3] for e in evs}
    missing = [x for x in want if x not in got]
    assert not missing, (w.name, missing, evs)
    return evs


def faults(w, sender=None, receiver=None):
    w.call("rebuild", sender, receiver)


def transfer(a, b, rid, counts=COUNTS, lease_s=10.0, explicit=None, header=b"hdr"):
    """Prepare sources on A, reserve on B, send everything and finish. Returns target, pages."""
    src = a.call("prepare", rid, counts=None if explicit else counts, explicit=explicit)
    target = b.call("reserve", rid, {k: len(v) for k, v in src.items()}, lease_s)
    posted = a.call("send", target, rid)
    a.call("finish", target, header)
    return target, src, posted


def test_bit_exact_across_pools_with_coalescing(pair):
    a, b = pair
    explicit = {"swa": [0, 1], "c4": [9, 3, 4, 5, 20, 21], "c128": [7, 8, 9, 10],
                "state_c4": [30]}
    src = a.call("prepare", "r1", explicit=explicit)
    want = {k: a.call("digest", k, ids) for k, ids in src.items()}
    target = b.call("reserve", "r1", {k: len(v) for k, v in src.items()}, 10.0)
    descriptors, nbytes = a.call("send", target, "r1")
    a.call("finish", target, b"first-token=42")

    from kvtransfer import decode_target
    dst = decode_target(target).pages()
    expected = sum(len(coalesce(src[k], dst[k], KINDS[k])) for k in src)
    pages = sum(len(v) for v in src.values())
    assert descriptors == expected < pages           # 6 descriptors for 13 pages
    assert nbytes == sum(len(v) * KINDS[k] for k, v in src.items())

    evs = expect(b, ("receiver", "r1", "ready"))
    assert ("receiver", "r1", "ready", b"first-token=42", "") in evs
    assert b.call("claim", "r1") == want             # bit-exact, every pool
    assert ("sender", "r1", "acked") in [e[:3] for e in expect(a, ("sender", "r1", "acked"))]
    settle_idle(a, b)
    m = a.call("metrics")["sender"]
    assert m["bytes"] >= nbytes and m["transfers"] >= 1


def test_streaming_layer_by_layer(pair):
    a, b = pair
    src = a.call("prepare", "r2", counts={"c4": 3, "swa": 1})
    want = {k: a.call("digest", k, ids) for k, ids in src.items()}
    target = b.call("reserve", "r2", {"c4": 3, "swa": 1}, 10.0)
    for layer in range(2):      # two layers per page: ship each half as it "finishes"
        for kind in ("c4", "swa"):
            rng = layer_byte_range(KINDS[kind], 2, layer)
            descriptors, nbytes = a.call("send", target, "r2", rng, [kind])
            assert descriptors == len(src[kind]) and nbytes == len(src[kind]) * rng[1]
    a.call("finish", target, b"h")
    expect(b, ("receiver", "r2", "ready"))
    assert b.call("claim", "r2") == want
    expect(a, ("sender", "r2", "acked"))
    settle_idle(a, b)


def test_missing_layer_is_caught_by_checksum(pair):
    a, b = pair
    a.call("prepare", "r2b", counts={"c4": 2})
    target = b.call("reserve", "r2b", {"c4": 2}, 10.0)
    a.call("send", target, "r2b", layer_byte_range(KINDS["c4"], 2, 0))   # layer 1 never sent
    a.call("finish", target, b"h")
    evs = expect(b, ("receiver", "r2b", "corrupt"))
    assert not [e for e in evs if e[2] == "ready"]
    b.call("release", "r2b")
    expect(a, ("sender", "r2b", "rejected"))
    settle_idle(a, b)


def test_layout_mismatch_refused_naming_the_field(pair):
    a, b = pair
    (c,) = start(Worker("decode-odd", make_layout(page_bytes={"c4": 1168}), seed=3))
    try:
        with pytest.raises(WorkerError) as e:
            a.call("handshake", c.name, c.metadata, c.layout.to_bytes())
        assert e.value.kind == "LayoutMismatch"
        assert "pool 'c4' page_bytes 2336 != 1168" in e.value.msg
        fp32 = make_layout(storage_format="fp32")
        with pytest.raises(WorkerError, match="storage_format 'fp8_pack' != 'fp32'"):
            a.call("handshake", b.name, b.metadata, fp32.to_bytes())
        # no handshake with C, so its targets are refused before any byte moves
        a.call("prepare", "r3", counts={"c4": 1})
        target = c.call("reserve", "r3", {"c4": 1}, 0.3)
        with pytest.raises(WorkerError) as e:
            a.call("send", target, "r3")
        assert e.value.kind == "NotConnected"
        a.call("drop_source", "r3")
        c.call("abort", "r3")
        settle_idle(c)
    finally:
        c.close()
    settle_idle(a, b)


def test_corrupted_byte_detected_never_ready(pair):
    a, b = pair
    faults(b, receiver=FaultPlan(corrupt_after_write=True))
    try:
        transfer(a, b, "r4")
        evs = expect(b, ("receiver", "r4", "corrupt"))
        assert [e[2] for e in evs if e[1] == "r4"] == ["corrupt"]
        assert "checksum mismatch" in [e for e in evs if e[1] == "r4"][0][4]
        with pytest.raises(WorkerError):
            b.call("claim", "r4")                    # corrupt data is never handed out
        b.call("release", "r4")
        expect(a, ("sender", "r4", "rejected"))
        settle_idle(a, b)
        assert b.call("metrics")["receiver"]["failures"]["checksum"] >= 1
    finally:
        faults(b)


def test_truncated_write_detected(pair):
    a, b = pair
    faults(a, sender=FaultPlan(truncate_write=0.5))
    try:
        transfer(a, b, "r5")
        evs = expect(b, ("receiver", "r5", "corrupt"))
        assert "ready" not in [e[2] for e in evs]
        b.call("release", "r5")
        expect(a, ("sender", "r5", "rejected"))
        settle_idle(a, b)
    finally:
        faults(a)


def test_reservation_expires_and_frees(pair):
    a, b = pair
    b.call("reserve", "r6", COUNTS, 0.3)
    st = b.call("state")
    assert st["free"]["c4"] == st["total"]["c4"] - COUNTS["c4"]
    expect(b, ("receiver", "r6", "expired"))
    settle_idle(b)


def test_sender_releases_on_lease_expiry_when_ack_lost(pair):
    a, b = pair
    faults(b, receiver=FaultPlan(drop=frozenset({"Ack"})))
    try:
        t0 = time.time()
        transfer(a, b, "r7", lease_s=1.0)
        expect(b, ("receiver", "r7", "ready"))
        b.call("claim", "r7")
        evs = expect(a, ("sender", "r7", "lease_expired"))
        assert ("sender", "r7", "lease_expired") in [e[:3] for e in evs]
        assert time.time() - t0 >= 0.9               # held until the lease, not before
        settle_idle(a, b)
    finally:
        faults(b)


def test_abort_mid_transfer_frees_everything_fast(pair):
    a, b = pair
    src = a.call("prepare", "r8", counts=COUNTS)
    target = b.call("reserve", "r8", {k: len(v) for k, v in src.items()}, 30.0)
    a.call("send", target, "r8", None, ["c4"])       # partial: no finish
    t0 = time.time()
    b.call("abort", "r8")
    expect(a, ("sender", "r8", "aborted"))  # receiver told the sender to stop
    settle_idle(a, b, timeout=5.0)
    assert time.time() - t0 < 5.0                    # fenced: no wait for the 30 s lease


def test_abort_before_sender_known_waits_for_lease(pair):
    a, b = pair
    b.call("reserve", "r9", COUNTS, 0.3)
    b.call("abort", "r9")
    st = b.call("state")
    assert st["held"] == {"r9": "fencing"}           # a write could still be on its way
    settle_idle(b)


def test_sender_abort_releases_and_receiver_fails_fast(pair):
    a, b = pair
    src = a.call("prepare", "r10", counts=COUNTS)
    target = b.call("reserve", "r10", {k: len(v) for k, v in src.items()}, 30.0)
    a.call("send", target, "r10")
    assert a.call("sender_abort", "r10")
    expect(a, ("sender", "r10", "cancelled"))
    evs = expect(b, ("receiver", "r10", "expired"))
    assert any(e[4] == "sender gave up" for e in evs)
    settle_idle(a, b, timeout=5.0)


def test_dropped_notification_expires_cleanly(pair):
    a, b = pair
    faults(a, sender=FaultPlan(drop=frozenset({"TransferDone"})))
    try:
        transfer(a, b, "r11", lease_s=0.5)
        evs = expect(b, ("receiver", "r11", "expired"))
        assert "ready" not in [e[2] for e in evs]
        settle_idle(a, b)
        # the receiver's Ack("expired") and the sender's own lease clock race; either frees
        reasons = [e[2] for e in a.call("events") if e[1] == "r11"]
        assert reasons in (["expired"], ["lease_expired"]), reasons
    finally:
        faults(a)


def test_duplicated_notifications_are_harmless(pair):
    a, b = pair
    faults(a, sender=FaultPlan(duplicate=frozenset({"Begin", "TransferDone"})))
    faults(b, receiver=FaultPlan(duplicate=frozenset({"Ack"})))
    try:
        before = b.call("metrics")["receiver"]["transfers"]
        transfer(a, b, "r12")
        expect(b, ("receiver", "r12", "ready"))
        b.call("claim", "r12")
        expect(a, ("sender", "r12", "acked"))
        time.sleep(0.1)                              # let the duplicates arrive
        evs = b.call("events") + a.call("events")
        assert evs == []                             # no second ready, no second release
        settle_idle(a, b)
        assert b.call("metrics")["receiver"]["transfers"] == before + 1
    finally:
        faults(a)
        faults(b)


def test_delayed_notification(pair):
    a, b = pair
    faults(a, sender=FaultPlan(delay=frozenset({"TransferDone"}), delay_s=0.2))
    try:
        transfer(a, b, "r13", lease_s=10.0)          # late but within the lease: fine
        expect(b, ("receiver", "r13", "ready"))
        b.call("claim", "r13")
        transfer(a, b, "r14", lease_s=0.15)          # arrives after the lease: expired
        evs = expect(b, ("receiver", "r14", "expired"))
        assert "ready" not in [e[2] for e in evs if e[1] == "r14"]
        settle_idle(a, b)
    finally:
        faults(a)


def test_stall_past_lease_refused_before_writing(pair):
    a, b = pair
    faults(a, sender=FaultPlan(stall_before_write_s=0.4))
    try:
        a.call("prepare", "r15", counts=COUNTS)
        target = b.call("reserve", "r15", COUNTS, 0.3)
        with pytest.raises(WorkerError) as e:
            a.call("send", target, "r15")
        assert e.value.kind == "LeaseExpired"
        a.call("drop_source", "r15")
        expect(b, ("receiver", "r15", "expired"))
        settle_idle(a, b)
    finally:
        faults(a)


def test_sender_killed_mid_transfer(pair):
    _, b = pair
    (d,) = start(Worker("prefill-doomed", seed=4,
                        sender_faults=FaultPlan(kill_at=SENDER_BEFORE_DONE)))
    try:
        connect(d, b)
        d.call("prepare", "r16", counts=COUNTS)
        target = b.call("reserve", "r16", COUNTS, 0.5)
        d.call("send", target, "r16")
        d.conn.send(("finish", (target, b"h"), {}))  # dies before TransferDone
        d.proc.join(10)
        assert d.proc.exitcode == KILL_EXIT_CODE
        expect(b, ("receiver", "r16", "expired"))
        settle_idle(b)
    finally:
        d.close()


def test_restarted_receiver_is_a_new_peer(pair):
    a, _ = pair
    # These two run NIXL's progress thread (the production default) for coverage.
    (r1,) = start(Worker("decode-r", seed=5, progress_thread=True))
    connect(a, r1)
    old_target = r1.call("reserve", "r17", {"c4": 2}, 10.0)
    old_epoch = r1.call("epoch")
    r1.close()                                       # the peer restarts under the same name
    (r2,) = start(Worker("decode-r", seed=6, progress_thread=True))
    try:
        assert r2.call("epoch") != old_epoch
        src = a.call("prepare", "r17", counts={"c4": 2})
        want = a.call("digest", "c4", src["c4"])
        new_target = r2.call("reserve", "r17", {"c4": 2}, 10.0)
        with pytest.raises(WorkerError) as e:        # A still knows only the old incarnation
            a.call("send", new_target, "r17")
        assert e.value.kind == "StaleTarget"
        connect(a, r2)                               # new handshake
        with pytest.raises(WorkerError) as e:        # never a write into a stale registration
            a.call("send", old_target, "r17")
        assert e.value.kind == "StaleTarget"
        a.call("send", new_target, "r17")
        a.call("finish", new_target, b"h")
        expect(r2, ("receiver", "r17", "ready"))
        assert r2.call("claim", "r17") == {"c4": want}
        expect(a, ("sender", "r17", "acked"))
        settle_idle(a, r2)
    finally:
        r2.close()
