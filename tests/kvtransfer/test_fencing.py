"""Quarantine of pages a sender may still write (Receiver fence_wait_s, reserve(sender=),
unfenced_senders / sender_gone), with two agents in one process on each transport.

A write posted before a lease ended can be held back by a broken network for longer than any
fixed grace; found by the chaos suite's network cut, where such a write landed in pages already
reused. Pages of a reservation with a known sender are reused only once that sender fences (its
Fenced follows its last byte) or is known gone."""

import time

import pytest

from kvtransfer import Receiver, RequestClosed, Sender
from kvt_harness import PageAllocator, random_pools
from test_inprocess import LAYOUT


@pytest.fixture(scope="module")
def agents(new_agent):
    a = new_agent("fa", random_pools(LAYOUT, 1))
    b = new_agent("fb", random_pools(LAYOUT, 2))
    a.add_peer("fb", b.metadata())
    b.add_peer("fa", a.metadata())
    yield a, b
    a.close()
    b.close()


def make_sides(agents, **receiver_kw):
    a, b = agents
    sender = Sender(a, LAYOUT, post_margin_s=0.02)
    sender.handshake("fb", b.metadata(), LAYOUT)
    alloc = PageAllocator(LAYOUT)
    return sender, Receiver(b, alloc, LAYOUT, **receiver_kw), alloc


def pump(sender, receiver, until, timeout=5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        sender.poll()
        receiver.poll()
        if until():
            return time.time()
        time.sleep(0.001)
    raise AssertionError(f"timed out: receiver holds {receiver.held()}")


def all_free(alloc):
    return all(alloc.num_free(k) == alloc.total[k] for k in alloc.total)


def test_expired_pages_wait_for_the_senders_fenced_not_a_grace(agents):
    sender, receiver, alloc = make_sides(agents, grace_s=0.05, fence_wait_s=30.0)
    a, _ = agents
    t = receiver.reserve("f1", {"c4": 2}, 0.3, sender=a.nixl_name)
    sender.send(t, {"c4": [1, 2]})  # writes, never finishes: the lease runs out
    # past deadline + grace, with the sender not polled (its Fenced not sent yet): still held
    while time.time() < t.lease_deadline + 0.3:
        receiver.poll()
        time.sleep(0.01)
    assert receiver.held() == {"f1": "fencing"} and not all_free(alloc)
    assert receiver.unfenced_senders() == {a.nixl_name}
    freed = pump(sender, receiver, receiver.idle)  # the sender hears Ack(expired) and fences
    assert freed < t.lease_deadline + 5.0 and all_free(alloc)


def test_abort_before_begin_reaches_the_named_sender(agents):
    sender, receiver, alloc = make_sides(agents, grace_s=0.05, fence_wait_s=30.0)
    a, _ = agents
    t = receiver.reserve("f2", {"c4": 1, "swa": 1}, 5.0, sender=a.nixl_name)
    receiver.abort("f2")  # the sender never began: without its name nobody could be told
    freed = pump(sender, receiver, receiver.idle)
    assert freed < t.lease_deadline and all_free(alloc)  # Fenced came back, no lease wait
    with pytest.raises(RequestClosed):  # and the sender promised to write nothing of it
        sender.send(t, {"c4": [3], "swa": [4]})


def test_a_gone_sender_frees_its_pages(agents):
    _, receiver, alloc = make_sides(agents, grace_s=0.05, fence_wait_s=30.0)
    t = receiver.reserve("f3", {"c4": 2}, 0.2, sender="ghost#0000")  # never answers
    while not receiver.unfenced_senders():
        receiver.poll()
        time.sleep(0.01)
    assert receiver.unfenced_senders() == {"ghost#0000"} and receiver.held() == {"f3": "fencing"}
    assert receiver.sender_gone("ghost#0000") == 1
    receiver.poll()
    assert receiver.idle() and all_free(alloc) and time.time() < t.lease_deadline + 5.0


def test_without_fence_wait_the_grace_still_applies(agents):
    _, receiver, alloc = make_sides(agents, grace_s=0.05)
    t = receiver.reserve("f4", {"c4": 2}, 0.2, sender="ghost#0000")
    while not receiver.idle():
        receiver.poll()
        time.sleep(0.01)
    assert all_free(alloc) and time.time() < t.lease_deadline + 1.0


def test_an_ack_the_sender_could_not_answer_is_repeated_until_fenced(new_agent):
    """The decode side gave a reservation up before the prefill worker had loaded its metadata:
    that Ack's Fenced reply had nowhere to go. Once the sender knows the receiver, the repeated Ack
    gets its Fenced, long before the fence wait ends (found by the chaos suite's Redis restart)."""
    a = new_agent("ua", random_pools(LAYOUT, 1))
    b = new_agent("ub", random_pools(LAYOUT, 2))
    try:
        b.add_peer("ua", a.metadata())  # the receiver knows its sender; not the other way yet
        sender = Sender(a, LAYOUT, post_margin_s=0.02)
        alloc = PageAllocator(LAYOUT)
        receiver = Receiver(b, alloc, LAYOUT, grace_s=0.05, fence_wait_s=60.0)
        t = receiver.reserve("u1", {"c4": 2}, 5.0, sender=a.nixl_name)
        receiver.abort("u1")
        for _ in range(50):  # the sender hears the Ack but cannot answer it
            sender.poll()
            receiver.poll()
            time.sleep(0.002)
        assert receiver.held() == {"u1": "fencing"}
        sender.handshake("ub", b.metadata(), LAYOUT)
        freed = pump(sender, receiver, receiver.idle)
        assert freed < t.lease_deadline and all_free(alloc)
        with pytest.raises(RequestClosed):  # its answer was a promise to write nothing of it
            sender.send(t, {"c4": [3, 4]})
    finally:
        a.close()
        b.close()
