"""The prefill worker's delivery records (prefill_worker/delivery.py): every transition, the illegal
ones refused, and the table's invariants after a seeded random walk of events."""

import asyncio
import itertools
import random

import pytest

from kvtransfer.protocol import TransferTarget
from model.kv_pool import SeqKV
from prefill_worker.delivery import (
    LOST,
    MOVES,
    Asker,
    Deliveries,
    Destination,
    IllegalTransition,
    State,
    TransferFailed,
)
from prefill_worker.engine import Job, Prefilled
from worker_runtime.wire import GenerateRequest

S = State
ENDED = (S.ACKED, S.RELEASED, S.ABORTED, S.EXPIRED)
REASONS = ("acked", *LOST, "rejected", "aborted", "expired")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def caller():
    """→ a function making the future a prefill() / repull() caller waits on; what the test left
    unread is read at the end, so no failure is reported as never retrieved."""
    loop, made = asyncio.new_event_loop(), []

    def new():
        made.append(loop.create_future())
        return made[-1]

    yield new
    for f in made:
        if f.done():
            f.exception()
    loop.close()


def dest(request_id: str, worker: str = "decode-0") -> Destination:
    return Destination(TransferTarget(request_id, worker, "e1", "layout", (("c4", (1, 2)),), 0.0), b"md", b"lay")


def computed(req: GenerateRequest) -> Prefilled:
    return Prefilled(req.request_id, SeqKV(), first_token=7, computed_tokens=3, job=Job(req))


def failure(fut) -> str:
    assert fut.done()
    e = fut.exception()
    assert isinstance(e, TransferFailed), e
    return str(e)


_REPULLS = itertools.count()

ASKER = Asker("decode-0", b"md", b"lay")

# how to bring a fresh record into each live state (QUEUED and ASKING: opened without a target)
PATHS = {S.QUEUED: [], S.ASKING: ["ask"], S.COMPUTING: [], S.DETACHED: ["detach"], S.SHIPPING: ["computed"],
         S.ABORTING: ["computed", "abort"], S.PARKED: ["detach", "computed"]}


def fresh(table: Deliveries, start: State, caller, rid: str = "r"):
    """A record of request `rid` brought into `start`."""
    untargeted = start in (S.QUEUED, S.ASKING)
    d = table.open(GenerateRequest(rid, (1,), 2), ASKER if untargeted else dest(rid), caller())
    for step in PATHS[start]:
        apply(table, d, step, caller)
    assert d.state is start
    return d


def apply(table: Deliveries, d, event: str, caller) -> None:
    """Drive one event of MOVES on `d` the way the worker does."""
    if event == "ask":
        table.ask(d)
    elif event == "targeted":
        table.targeted(d, dest(d.request_id))
    elif event == "no_room":
        table.no_room(d, 0.5)
    elif event == "detach":
        table.detach(d, TransferFailed("write refused"))
    elif event == "computed":
        table.computed(d, computed(d.req))
    elif event == "acked":
        table.settle(d, "acked")
    elif event == "lost":
        table.settle(d, "lease_expired")
    elif event == "gave_up":
        table.settle(d, "rejected")
    elif event == "abort":
        table.abort(d, TransferFailed("aborted"))
    elif event == "repull":
        table.repull(d, dest(f"{d.request_id}~{next(_REPULLS)}", "decode-1"), caller())
    else:
        raise AssertionError(event)


def test_acked_delivery_answers_the_caller_and_leaves_the_table(caller):
    table = Deliveries(hold_s=30.0)
    req = GenerateRequest("r", (1, 2, 3), 4)
    fut = caller()
    d = table.open(req, dest("r"), fut)
    assert d.state is S.COMPUTING and table.find("r") is d
    with pytest.raises(ValueError, match="already being prefilled"):
        table.open(req, dest("r"), caller())  # ids key all state
    table.computed(d, computed(req))
    assert d.state is S.SHIPPING and not fut.done()
    table.settle(d, "acked")
    assert d.state is S.ACKED and fut.result() == {"first_token": 7}
    assert table.find("r") is None and len(table) == 0
    table.check()


@pytest.mark.parametrize("reason", LOST)
def test_a_lost_decode_worker_parks_the_kv_for_one_lease(caller, reason):
    clock = Clock()
    table = Deliveries(hold_s=30.0, clock=clock)
    req = GenerateRequest("r", (1, 2, 3), 4)
    fut = caller()
    d = table.open(req, dest("r"), fut)
    table.computed(d, computed(req))
    table.settle(d, reason)
    assert d.state is S.PARKED and d.dest is None and d.held_until == clock.now + 30.0
    assert failure(fut) == reason
    clock.now += 30.0
    assert table.expire() == []  # held through the lease
    clock.now += 0.001
    assert table.expire() == [d] and d.state is S.EXPIRED and len(table) == 0
    table.check()


@pytest.mark.parametrize("reason", ["rejected", "aborted", "expired"])
def test_a_decode_side_that_gave_up_releases_the_kv(caller, reason):
    table = Deliveries(hold_s=30.0)
    req = GenerateRequest("r", (1,), 2)
    fut = caller()
    d = table.open(req, dest("r"), fut)
    table.computed(d, computed(req))
    table.settle(d, reason)
    assert d.state is S.RELEASED and failure(fut) == reason and len(table) == 0


def test_a_failed_stream_detaches_and_the_computed_kv_is_parked(caller):
    clock = Clock()
    table = Deliveries(hold_s=5.0, clock=clock)
    req = GenerateRequest("r", (1, 2), 2)
    fut = caller()
    d = table.open(req, dest("r"), fut)
    d.streamed["c4"] = 2
    table.detach(d, TransferFailed("peer gone"))
    assert d.state is S.DETACHED and d.dest is None and failure(fut) == "peer gone"
    table.computed(d, computed(req))
    assert d.state is S.PARKED and d.held_until == clock.now + 5.0
    table.check()


def test_abort_while_writes_are_in_flight_waits_for_the_senders_answer(caller):
    table = Deliveries(hold_s=30.0)
    req = GenerateRequest("r", (1,), 2)
    fut = caller()
    d = table.open(req, dest("r"), fut)
    table.computed(d, computed(req))
    table.abort(d, TransferFailed("aborted"))
    assert d.state is S.ABORTING and failure(fut) == "aborted" and table.find("r") is d
    table.abort(d, TransferFailed("aborted"))  # a second abort: still waiting for the same answer
    assert d.state is S.ABORTING
    with pytest.raises(IllegalTransition):
        table.repull(d, dest("r~1"), caller())
    table.settle(d, "lease_expired")  # even a lost peer's answer frees it: nobody wants it any more
    assert d.state is S.ABORTED and len(table) == 0


@pytest.mark.parametrize("start", [S.COMPUTING, S.DETACHED, S.SHIPPING, S.PARKED])
def test_repull_retargets_under_an_alias_and_answers_the_previous_caller(caller, start):
    table = Deliveries(hold_s=30.0)
    req = GenerateRequest("r", (1, 2, 3), 4)
    first = caller()
    d = table.open(req, dest("r"), first)
    for event in PATHS[start]:
        apply(table, d, event, caller)
    d.streamed["c4"] = 1
    second = caller()
    table.repull(d, dest("r~1", "decode-1"), second)
    want = S.COMPUTING if start in (S.COMPUTING, S.DETACHED) else S.SHIPPING
    assert d.state is want and d.dest.request_id == "r~1" and d.streamed == {}
    assert table.find("r~1") is d and table.find("r") is d
    if start in (S.COMPUTING, S.SHIPPING):  # its caller was still waiting
        assert failure(first) == "re-pulled by another decode worker"
    assert not second.done()
    if want is S.COMPUTING:
        table.computed(d, computed(req))
    table.settle(d, "acked")
    assert second.result() == {"first_token": 7}
    assert table.find("r~1") is None and table.find("r") is None
    table.check()


def test_a_request_without_a_target_waits_holding_nothing_until_its_target_comes(caller):
    clock = Clock()
    table = Deliveries(hold_s=30.0, clock=clock)
    req = GenerateRequest("r", (1, 2, 3), 4)
    fut = caller()
    d = table.open(req, ASKER, fut)
    assert d.state is S.QUEUED and d.dest is None and d.asker == ASKER and table.due() == [d]
    clock.now += 3600.0  # no lease runs while it waits here: nothing expires
    assert table.expire() == [] and d.state is S.QUEUED and not fut.done()
    assert table.ask(d) == 1 and d.state is S.ASKING and table.due() == []
    table.no_room(d, 0.5)  # the decode worker has no pages now: asked again later
    assert d.state is S.QUEUED and table.due() == []
    clock.now += 0.5
    assert table.due() == [d]
    assert table.ask(d) == 2  # a later ask: an answer to the first one is stale
    table.targeted(d, dest("r"))
    assert d.state is S.COMPUTING and d.dest.request_id == "r" and d.asker is None and not fut.done()
    table.computed(d, computed(req))
    table.settle(d, "acked")
    assert fut.result() == {"first_token": 7} and len(table) == 0
    table.check()


@pytest.mark.parametrize("start", [S.QUEUED, S.ASKING])
def test_a_request_that_never_started_is_aborted_or_re_pulled_with_nothing_to_free(caller, start):
    table = Deliveries(hold_s=30.0)
    d = fresh(table, start, caller)
    first = d.caller
    table.abort(d, TransferFailed("aborted"))
    assert d.state is S.ABORTED and failure(first) == "aborted" and len(table) == 0
    d = fresh(table, start, caller)
    first, second = d.caller, caller()
    table.repull(d, dest("r~1", "decode-1"), second)  # its decode worker was lost before it started
    assert d.state is S.COMPUTING and d.dest.request_id == "r~1" and d.asker is None
    assert failure(first) == "re-pulled by another decode worker" and not second.done()
    table.check()


@pytest.mark.parametrize("event", sorted(MOVES.keys() - {"expire"}))
@pytest.mark.parametrize("start", sorted(PATHS, key=lambda s: s.value))
def test_every_event_from_every_live_state(caller, event, start):
    """Legal moves land where MOVES says; every other one raises and changes nothing."""
    table = Deliveries(hold_s=30.0)
    d = fresh(table, start, caller)
    to = MOVES[event].get(start)
    if to is None:
        with pytest.raises(IllegalTransition):
            apply(table, d, event, caller)
        assert d.state is start and table.find("r") is d
    else:
        apply(table, d, event, caller)
        assert d.state is to
        assert (table.find("r") is d) == (to not in ENDED)
    table.check()


@pytest.mark.parametrize("event", sorted(MOVES.keys() - {"expire"}))
def test_an_ended_delivery_takes_no_event(caller, event):
    table = Deliveries(hold_s=30.0)
    d = table.open(GenerateRequest("r", (1,), 2), dest("r"), caller())
    table.computed(d, computed(d.req))
    table.settle(d, "acked")
    with pytest.raises(IllegalTransition):
        apply(table, d, event, caller)
    assert d.state is S.ACKED


def test_random_walk_keeps_each_request_in_exactly_one_state(caller):
    """Seeded random events on a few requests: each step is legal exactly when MOVES says, each
    request is live in one state or ended, callers are answered once their request leaves them."""
    rng = random.Random(48)
    clock = Clock()
    table = Deliveries(hold_s=10.0, clock=clock)
    records, futures, ended = {}, {}, set()  # request id → record / every caller it had
    seen = set()  # (event, from) pairs that moved
    for step in range(4000):
        kind = rng.choice(["open", "ask", "targeted", "no_room", "detach", "computed", "settle", "abort", "repull",
                           "expire"])
        live_ids = sorted(set(records) - ended)
        if kind == "open" or not live_ids:
            if len(live_ids) < 6:  # a handful at a time, so each one sees many events
                rid = f"q{len(records)}"
                futures[rid] = [caller()]
                records[rid] = table.open(GenerateRequest(rid, (1, 2), 3), ASKER if rng.random() < 0.5 else dest(rid),
                                          futures[rid][0])
            continue
        if kind == "expire":
            clock.now += rng.choice([0.5, 1.0, 2.0])
            parked = {d.request_id for d in table.in_state(S.PARKED) if clock.now > d.held_until}
            assert {d.request_id for d in table.expire()} == parked
            assert all(records[rid].state is S.EXPIRED for rid in parked)
            ended |= parked
        else:
            rid = rng.choice(live_ids if rng.random() < 0.9 else sorted(records))
            d = records[rid]
            before = d.state
            if kind == "settle":
                reason = rng.choice(REASONS)
                event = "acked" if reason == "acked" else "lost" if reason in LOST else "gave_up"
            else:
                event = kind
            to = MOVES[event].get(before) if rid not in ended else None
            try:
                if kind == "settle":
                    table.settle(d, reason)
                elif kind == "repull":
                    fut = caller()
                    table.repull(d, dest(f"{rid}~{step}", "decode-1"), fut)
                    futures[rid].append(fut)
                else:
                    apply(table, d, kind, caller)
            except IllegalTransition:
                assert to is None, (step, rid, before, event)
                assert d.state is before
                continue
            assert to is not None and d.state is to, (step, rid, before, event, d.state)
            seen.add((event, before))
            if to in ENDED:
                ended.add(rid)
        table.check()
        live = {d.request_id: d.state for d in table.in_state(*PATHS)}
        assert len(live) == len(table) and set(live) | ended == set(records) and not set(live) & ended
        for rid, futs in futures.items():
            waiting = [f for f in futs if not f.done()]
            # only a live QUEUED / ASKING / COMPUTING / SHIPPING record has a caller waiting: the latest one
            assert waiting in ([], futs[-1:]), (rid, live.get(rid))
            assert not waiting or live.get(rid) in (S.QUEUED, S.ASKING, S.COMPUTING, S.SHIPPING)
    # the walk took every move there is
    assert seen == {(e, s) for e, moves in MOVES.items() if e != "expire" for s in moves}, seen
