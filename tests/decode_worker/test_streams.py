"""The decode worker's stream records (decode_worker/streams.py): every transition, the illegal ones
refused, chunk delivery, and the table's invariants after a seeded random walk of events."""

import asyncio
import random

import pytest

from decode_worker.streams import MOVES, IllegalTransition, Phase, Streams
from worker_runtime.wire import ErrorCode, ErrorInfo, TokenChunk

P = Phase
# how to bring a fresh record into each live state
OPEN = {P.STARTING: ("open", []), P.STREAMING: ("open", ["start"]), P.UNATTACHED: ("migrated_in", [])}


def make(streams: Streams, rid: str, state: Phase):
    how, path = OPEN[state]
    s = streams.open(rid) if how == "open" else streams.migrated_in(rid, until=100.0)
    for event in path:
        getattr(streams, event)(s)
    assert s.state is state
    return s


def chunk(rid: str, error: bool = False) -> TokenChunk:
    return TokenChunk(rid, () if error else (5,), error=ErrorInfo(ErrorCode.CANCELLED, "x") if error else None)


def test_generate_then_close():
    streams = Streams()
    s = streams.open("r")
    with pytest.raises(ValueError, match="already in progress"):
        streams.open("r")
    with pytest.raises(ValueError, match="already in progress"):
        streams.migrated_in("r", until=1.0)
    streams.deliver(chunk("r"))  # a chunk before the start (a loop error's) waits in the queue too
    streams.start(s)
    assert s.state is P.STREAMING and s.queue.get_nowait().token_ids == (5,)
    streams.deliver(chunk("r", error=True))  # a reader's stream ends by reading it, not by delivery
    assert streams.get("r") is s and s.queue.qsize() == 1
    streams.close(s)
    assert s.state is P.ENDED and "r" not in streams and len(streams) == 0
    streams.open("r")  # the id is free again


def test_a_caller_gone_before_the_start_cancels():
    streams = Streams()
    s = streams.open("r")
    streams.cancel(s)
    assert s.state is P.ENDED and "r" not in streams


def test_migrated_in_waits_for_attach_and_is_dropped_on_an_error():
    streams = Streams()
    a = streams.migrated_in("a", until=10.0)
    b = streams.migrated_in("b", until=20.0)
    streams.deliver(chunk("a"))  # decoding here already: chunks wait for the router's attach
    assert streams.overdue(10.0) == [] and streams.overdue(10.5) == [a]
    streams.attach(a)
    assert a.state is P.STREAMING and a.queue.qsize() == 1 and streams.overdue(30.0) == [b]
    streams.deliver(chunk("b", error=True))  # a failed migration in: nobody will attach
    assert b.state is P.ENDED and "b" not in streams
    streams.deliver(chunk("b"))  # late chunks of an ended stream go nowhere
    assert list(streams.live()) == [a]


def test_a_reader_reads_to_the_last_chunk_and_one_that_leaves_abandons_the_request():
    streams = Streams()
    abandoned = []

    async def read(rid: str, leave_after: int | None) -> list:
        s = streams.open(rid)
        streams.start(s)
        for c in (chunk(rid), chunk(rid), chunk(rid, error=True), chunk(rid)):
            streams.deliver(c)
        got = []
        reader = streams.read(s, abandoned=abandoned.append)
        async for c in reader:
            got.append(c)
            if len(got) == leave_after:
                break
        await reader.aclose()  # what Ray does with the generator of a caller that went away
        assert s.state is P.ENDED and rid not in streams
        return got

    assert len(asyncio.run(read("whole", None))) == 3  # up to the error: the last chunk
    assert abandoned == []
    assert len(asyncio.run(read("left", 1))) == 1
    assert abandoned == ["left"]


@pytest.mark.parametrize("event", sorted(MOVES))
@pytest.mark.parametrize("start", sorted(OPEN, key=lambda p: p.value))
def test_every_event_from_every_state(event, start):
    """Legal moves land where MOVES says; every other one raises and changes nothing."""
    streams = Streams()
    s = make(streams, "r", start)
    to = MOVES[event].get(start)
    if to is None:
        with pytest.raises(IllegalTransition):
            getattr(streams, event)(s)
        assert s.state is start and streams.get("r") is s
    else:
        getattr(streams, event)(s)
        assert s.state is to and (streams.get("r") is s) == (to is not P.ENDED)


@pytest.mark.parametrize("event", sorted(MOVES))
def test_an_ended_stream_takes_no_event_and_does_not_touch_its_successor(event):
    streams = Streams()
    old = make(streams, "r", P.STREAMING)
    streams.close(old)
    new = streams.open("r")  # the id reused
    with pytest.raises(IllegalTransition):
        getattr(streams, event)(old)
    assert streams.get("r") is new and new.state is P.STARTING


def test_random_walk_keeps_each_request_in_exactly_one_state():
    """Seeded random events: each is legal exactly when MOVES says, and every request id ever
    opened is live in one state or ended, never both, never in two records."""
    rng = random.Random(48)
    streams = Streams()
    records = {}  # rid → every record it had, newest last
    seen = set()
    for step in range(3000):
        kind = rng.choice(["open", "migrated_in", "deliver", "error", *MOVES])
        rid = f"q{rng.randrange(8)}"
        s = records.get(rid, [None])[-1]
        if kind in ("open", "migrated_in"):
            if rid in streams:
                with pytest.raises(ValueError):
                    getattr(streams, kind)(rid, **({} if kind == "open" else {"until": 1.0}))
            else:
                records.setdefault(rid, []).append(
                    streams.open(rid) if kind == "open" else streams.migrated_in(rid, until=1.0))
        elif kind in ("deliver", "error"):
            before = s.state if s is not None else None
            streams.deliver(chunk(rid, error=kind == "error"))
            if before is P.UNATTACHED and kind == "error":
                assert s.state is P.ENDED
                seen.add(("drop", before))
            elif s is not None:
                assert s.state is before
        elif s is not None:
            before, to = s.state, MOVES[kind].get(s.state)
            if to is None:
                with pytest.raises(IllegalTransition):
                    getattr(streams, kind)(s)
                assert s.state is before
            else:
                getattr(streams, kind)(s)
                assert s.state is to
                seen.add((kind, before))
        live = {x.request_id: x for x in streams.live()}
        assert len(live) == len(streams)
        for r, recs in records.items():
            assert all(x.state is P.ENDED for x in recs[:-1]), (step, r)  # one live record per id at most
            assert (recs[-1].state is not P.ENDED) == (r in live), (step, r)
            assert r not in live or live[r] is recs[-1]
    assert seen == {(e, p) for e, moves in MOVES.items() for p in moves}, seen
