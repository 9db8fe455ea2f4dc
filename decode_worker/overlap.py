"""Overlapped decode steps (`DecodeConfig.overlap`): the next step is queued on the device before
this step's tokens reach the host, so the host's work between two steps (the ids' copy, stop
checks, detokenising, streaming the chunks, scheduling) runs while the device computes, instead
of leaving it idle.

    run step k → draw its ids on the device, queue their copy to the host → queue step k+1 fed
    with them → wait for the copy (not for k+1) → emit k
    next call: draw k+1's ids → queue k+2 → ... → emit k+1

A step goes ahead only when nothing but the ids changes between the two steps (`eligible`): every
request in the step is decoding and every running request is in it, none waits for admission,
the step would not speculate (`DecodeEngine.speculates`),
and no row needs the host between the forward and the draw (penalties and min_tokens read the
output so far, a grammar its state, logprobs copy the logits' row). Otherwise the step in flight
is settled the ordinary way (`DecodeEngine._postprocess`) and the next one is planned.

The step ahead is an ordinary step of the same requests one position on: the same graphs (whose
inputs `HostStaging` staged one position on already; the ids are copied in on the device), the
same sampling at the same positions, so the tokens are those of steps taken one by one. A
request that ends at step k (a stop token, max_tokens, its deadline, an abort) has fed one more
position at k+1: its pages hold one position past its max_tokens (`DecodeEngine.tokens_held`),
the row's token is dropped, and its pages, released at k, are reused only by work queued after
k+1. A request paused for migration while a step is ahead first has that step settled
(`settle`), so its chunks leave before its pages do.
"""

from __future__ import annotations

import torch

from decode_worker.running import Planned, Running
from model.batch import ForwardBatch, Segment, to_device
from model.sampling import draw_rows
from worker_runtime.wire import RequestState, TokenChunk


def eligible(engine, owners: list[tuple[Running, bool]]) -> bool:
    """Whether the step after the one of `owners` can be queued before its tokens are known."""
    return (engine.config.overlap and not engine.waiting and len(owners) == len(engine.running)
            and not engine.speculates(len(owners))
            and all(yields and engine.running.get(r.req.request_id) is r and r.state is RequestState.DECODING
                    and r.grammar is None and r.req.logprobs is None and not r.req.sampling.adjusts
                    for r, yields in owners))


def launch(engine, planned: Planned, logits: torch.Tensor) -> list[TokenChunk]:
    """For a step just run (committed, `eligible`): draw its ids on the device, queue the same
    requests' next step fed with them (`engine.ahead`), then emit the ids."""
    owners = planned.owners
    runs = [r for r, _ in owners]
    ids = draw_rows(logits, [r.req.sampling for r in runs], [r.seq.num_tokens for r in runs])
    # the ids' copy to the host is queued now, before the next step: a copy queued after it would
    # wait for it
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=ids.is_cuda)
    host.copy_(ids, non_blocking=True)
    copied = torch.cuda.Event() if ids.is_cuda else None
    if copied is not None:
        copied.record()
    segments = tuple(Segment(r.seq, r.seq.num_tokens, 1, i) for i, r in enumerate(runs))
    # (a graph reads the positions from its staged inputs, the eager forward from here)
    batch = ForwardBatch(ids, to_device([s.start for s in segments], ids.device, torch.int64), segments)
    ahead_logits = engine._run(batch, None, owners)
    batch.commit()
    engine.ahead = (Planned(batch, owners), ahead_logits)
    if copied is not None:
        copied.synchronize()
    return engine._postprocess(owners, logits, host.tolist())


def advance(engine) -> list[TokenChunk]:
    """The step after one queued ahead: queue the next one again if nothing else changed, else
    settle it."""
    engine.stats.step_began()
    (planned, logits), engine.ahead = engine.ahead, None
    out = engine.take_failed()
    if eligible(engine, planned.owners):
        out += launch(engine, planned, logits)
    else:
        out += engine._postprocess(planned.owners, logits)
    engine.stats.step_ended()
    return out


def settle(engine) -> None:
    """Finish the step in flight now (its chunks wait in `engine.failed` for the next step's
    output), e.g. before a request leaves the batch."""
    if engine.ahead is not None:
        (planned, logits), engine.ahead = engine.ahead, None
        engine.failed += engine._postprocess(planned.owners, logits)
