"""Protocol edge cases with two agents in one process, on each transport (conftest `agents`:
two NIXL agents over real UCX loopback, and two LocalAgents; no spawn).

The cross-process suite covers the scenarios end to end; these pin down the state machines.
"""

import time

import pytest
import torch

from kvtransfer import (FaultPlan, LeaseExpired, OutOfPages, Receiver, RequestClosed,
                        Sender, StaleTarget)
from kvtransfer.protocol import Ack
from kvt_harness import PageAllocator, make_layout, pump, random_pools

LAYOUT = make_layout(num_pages=16)


def has(events, rid, kind):
    return any(e.request_id == rid and getattr(e, "kind", getattr(e, "reason", None)) == kind
               for e in events)


def test_resend_after_mismatch_then_ready(sides, agents):
    sender, receiver, _ = sides
    a, b = agents
    t = receiver.reserve("x1", {"c4": 3}, 5.0)
    src = {"c4": [4, 5, 6]}
    sender.send(t, src)
    sender.finish(t, b"h1")
    dst = t.pages()["c4"]
    # let the writes land and TransferDone go out (b.recv of an unused tag progresses B's
    # UCX worker without consuming B's messages; a no-op for a LocalAgent), then damage the
    # landed bytes
    key = ("x1", "pb", b.epoch)
    while not sender._out[key].done_sent:
        sender.poll()
        b.recv(b"\0")
    b.pools["c4"][dst[1], 100] ^= 0x01
    _, r = pump(sender, receiver, lambda s, r: has(r, "x1", "corrupt"))
    assert not has(r, "x1", "ready")
    with pytest.raises(KeyError):
        receiver.claim("x1")
    # caller keeps the reservation and asks for a resend: attempt 2 verifies
    sender.send(t, src)
    sender.finish(t, b"h2")
    s, r = pump(sender, receiver, lambda s, r: has(r, "x1", "ready") and has(s, "x1", "acked"))
    assert [e.header for e in r if e.kind == "ready"] == [b"h2"]
    pages = receiver.claim("x1")
    assert torch.equal(b.pools["c4"][list(pages["c4"])], a.pools["c4"][src["c4"]])
    receiver.allocator.free("c4", list(pages["c4"]))
    with pytest.raises(RequestClosed):
        sender.send(t, src)


def test_reserve_is_all_or_nothing(sides):
    _, receiver, alloc = sides
    with pytest.raises(OutOfPages):
        receiver.reserve("x2", {"c4": 3, "swa": 17}, 1.0)
    assert alloc.num_free("c4") == 16 and alloc.num_free("swa") == 16
    receiver.reserve("x2", {"c4": 3, "c128": 0}, 0.2)
    with pytest.raises(ValueError):
        receiver.reserve("x2", {"c4": 1}, 1.0)
    assert receiver.held() == {"x2": "waiting"}
    assert receiver.abort("x2") and not receiver.release("nope") and not receiver.abort("nope")


def test_send_validates_before_any_byte_moves(sides, agents):
    sender, receiver, _ = sides
    _, b = agents
    t = receiver.reserve("x3", {"c4": 2, "swa": 1}, 5.0)
    with pytest.raises(ValueError, match="2 target pages"):
        sender.send(t, {"c4": [1]})
    with pytest.raises(ValueError, match="no pool"):
        sender.send(t, {"c128": [1, 2]})
    with pytest.raises(ValueError, match="out of range"):
        sender.send(t, {"c4": [1, 99]})
    sender.send(t, {"c4": [1, 2]})
    with pytest.raises(ValueError, match="swa"):
        sender.finish(t, b"")                        # swa pages never given
    from dataclasses import replace
    with pytest.raises(StaleTarget):
        sender.send(replace(t, agent_epoch="0" * 16), {"c4": [1, 2]})
    late = receiver.reserve("x3b", {"c4": 1}, 0.01)
    with pytest.raises(LeaseExpired):
        sender.send(late, {"c4": [3]})
    sender.send(t, {"swa": [7]})                     # pools may be sent in any order
    sender.finish(t, b"")
    pump(sender, receiver, lambda s, r: has(r, "x3", "ready"))
    receiver.release("x3")


def test_unknown_ack_fences_and_blocks_later_writes(sides, agents):
    sender, receiver, _ = sides
    a, b = agents
    t = receiver.reserve("x4", {"c4": 1}, 5.0)
    # the receiver aborts before the sender ever started: its Ack reaches a sender that does
    # not know the request yet, which must promise (Fenced) never to write it
    b.notify(a.nixl_name, Ack("x4", b.epoch, "aborted", t.lease_deadline).to_bytes())
    receiver.abort("x4")
    t0 = time.time()
    pump(sender, receiver, lambda s, r: receiver.idle())
    assert time.time() - t0 < 1.0                    # freed on Fenced, not at the lease (5 s)
    with pytest.raises(RequestClosed):
        sender.send(t, {"c4": [2]})


def test_peer_restart_releases_sender_hold(sides, agents):
    sender, receiver, _ = sides
    t = receiver.reserve("x5", {"c4": 1}, 5.0)
    sender.send(t, {"c4": [3]})
    sender._peers["pb"] = ("another-epoch", LAYOUT)    # as if a new handshake replaced it
    s, _ = pump(sender, receiver, lambda s, r: has(s, "x5", "peer_restarted"))
    assert s[0].src_pages == (("c4", (3,)),)
    sender._peers["pb"] = (agents[1].epoch, LAYOUT)
    receiver.abort("x5")


def test_metrics_and_no_fault_overhead_path(sides):
    sender, receiver, _ = sides
    t = receiver.reserve("x6", {"c4": 2}, 5.0)
    sender.send(t, {"c4": [8, 9]})
    sender.finish(t, b"")
    pump(sender, receiver, lambda s, r: has(s, "x6", "acked"))
    receiver.release("x6")
    snap = sender.metrics.snapshot()
    assert snap["bytes"] == 2 * LAYOUT.pool("c4").page_bytes and snap["transfers"] == 1
    assert snap["duration_count"] == 1 and snap["duration_s_sum"] > 0
    rsnap = receiver.metrics.snapshot()
    assert rsnap["transfers"] == 1 and rsnap["failures"] == {}


def test_kill_point_exits(tmp_path):
    import subprocess
    import sys
    code = ("from kvtransfer.faults import FaultPlan, kill_point;"
            "kill_point(None, 'sender.before_done');"
            "kill_point(FaultPlan(kill_at='sender.after_post'), 'sender.before_done');"
            "kill_point(FaultPlan(kill_at='sender.before_done'), 'sender.before_done');"
            "print('not reached')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert out.returncode == 86 and "not reached" not in out.stdout


def test_fault_plan_is_inert_when_absent(agents):
    a, _ = agents
    sender = Sender(a, LAYOUT, faults=None)
    assert sender._faults is None and sender._notifier._plan is None
    FaultPlan()   # the empty plan is valid too


def test_pages_streamed_in_pieces_verify_as_one_transfer(sides, agents):
    """Pages sent in runs as they become final (first_page offsets), then finish() with the full
    lists: the receiver verifies the whole request and every byte matches."""
    sender, receiver, _ = sides
    a, b = agents
    target = receiver.reserve("pieces", {"c4": 5}, lease_s=5)
    src = [9, 3, 4, 10, 2]
    sender.send(target, {"c4": src[:2]}, first_page={"c4": 0})
    sender.send(target, {"c4": src[2:3]}, first_page={"c4": 2})
    with pytest.raises(ValueError, match="first page 4"):
        sender.send(target, {"c4": src[3:]}, first_page={"c4": 4})  # runs past the target
    sender.send(target, {"c4": src[3:]}, first_page={"c4": 3})
    sender.finish(target, b"h", src_pages={"c4": src})
    _, r_ev = pump(sender, receiver, lambda s, r: has(r, "pieces", "ready"))
    dst = receiver.claim("pieces")["c4"]
    assert torch.equal(b.pools["c4"][list(dst)], a.pools["c4"][src])
    for page in dst:
        receiver.allocator.free("c4", [page])
    pump(sender, receiver, lambda s, r: not sender.holding())


def test_ready_event_times_the_transfer_without_the_wait_for_the_prefill(sides):
    sender, receiver, _ = sides
    waited_before = receiver.metrics.duration_s_sum
    t = receiver.reserve("wire", {"c4": 2}, 5.0)
    time.sleep(0.3)  # the decode side reserved, the prefill is still running
    sender.send(t, {"c4": [1, 2]})
    sender.finish(t, b"")
    _, r = pump(sender, receiver, lambda s, r: has(r, "wire", "ready"))
    ready = [e for e in r if e.request_id == "wire" and e.kind == "ready"][0]
    assert 0 < ready.wire_s < 0.3  # Begin → verified
    waited = receiver.metrics.duration_s_sum - waited_before  # this transfer's reserve → verified
    assert waited >= 0.3 + ready.wire_s - 0.05  # holds the wait
    receiver.release("wire")
