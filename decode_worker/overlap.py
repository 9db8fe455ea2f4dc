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

A speculative step drafted on the device (`speculative.queue_chain`) goes ahead the same way
(`launch_speculative`), though the next step's positions depend on how many drafts this one
keeps: the host places it as if every draft was kept (n + N + 1, where the verify left the
request) and the device moves it back by what was not (`speculation.draft_ahead`, the graphs'
`shift`), its first token t_a, ring snapshot and noise keys taken there too. Its pages hold the
positions of either placement (`DecodeEngine.tokens_held`); the host learns the true start with
the step's counts, before it queues the step after. The tokens are those of steps taken one at a
time, as without speculation.
"""

from __future__ import annotations

import dataclasses

import torch

from decode_worker import speculative
from decode_worker.running import Planned, Running
from model import speculation
from model.batch import ForwardBatch, HostCopy, Segment, to_device
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
    copy = HostCopy.queue(ids)
    segments = tuple(Segment(r.seq, r.seq.num_tokens, 1, i) for i, r in enumerate(runs))
    # (a graph reads the positions from its staged inputs, the eager forward from here)
    batch = ForwardBatch(ids, to_device([s.start for s in segments], ids.device, torch.int64), segments)
    ahead_logits = engine._run(batch, None, owners)
    batch.commit()
    engine.ahead = (Planned(batch, owners), ahead_logits)
    return engine._postprocess(owners, logits, copy.wait())


def speculative_eligible(engine, planned: Planned) -> bool:
    """Whether the speculative step after `planned` (drafted on the device) can be queued before
    its counts are known: the plain conditions but speculating, every row drafted in one chain,
    and graphs for the next step's drafts and verify that take its rows where the host places them."""
    owners, pending = planned.owners, planned.pending
    if (engine.verify_draws is None or engine.waiting or len(owners) != len(engine.running)
            or not pending or any(p is None or p.chain is None or not p.binding for p in pending)
            or not speculative.on_device(owners)
            or any(engine.running.get(r.req.request_id) is not r for r, _ in owners)):
        return False
    L, graphs = pending[0].chain.shape[1], engine.graphs
    chain, verify = graphs.chain_for_rows(len(owners)), graphs.for_batch(planned.batch)
    return (chain is not None and chain.chain == L - 1 and verify is not None
            and chain.draws.capturable([r.req.sampling for r, _ in owners])
            and len(owners) * L <= engine.verify_draws.rows
            and all(s.end + L <= verify.max_context for s in planned.batch.segments))


def launch_speculative(engine, planned: Planned, verified: speculative.Verified) -> list[TokenChunk]:
    """For a chain-drafted step queued through its roll-back (`speculative.queue_chain`,
    `speculative_eligible`): queue the same requests' next step from its counts on the device
    (`engine.ahead`), then wait for them and emit its tokens."""
    owners, pending = planned.owners, planned.pending
    L = pending[0].chain.shape[1]
    drafted = speculation.draft_ahead(engine.model, engine.pools, list(pending), verified.accepted,
                                      verified.targets, engine.graphs.chain_for_rows(len(owners)),
                                      [r.req.sampling for r, _ in owners])
    ahead = Planned(ForwardBatch.build([(p.seq, p.tokens) for p in drafted], "cpu"), owners, tuple(drafted))
    ahead_verified = speculative.queue_chain(engine, ahead, (verified.accepted + 1 - L).int(), verified.accepted)
    host = verified.wait()
    out = speculative.emit_chain(engine, planned, verified, host)
    # the step ahead's true start is where this one left each request (n + a + 1); its verify
    # has committed L tokens past it, which its own counts roll back
    starts = [p.start + row[-1] + 1 for p, row in zip(pending, host)]
    for (r, _), start in zip(owners, starts):
        if engine.running.get(r.req.request_id) is r:
            r.seq.num_tokens = start + L
    engine.ahead = (dataclasses.replace(ahead, pending=tuple(dataclasses.replace(p, start=start)
                                                             for p, start in zip(drafted, starts))), ahead_verified)
    return out


def advance(engine) -> list[TokenChunk]:
    """The step after one queued ahead: queue the next one again if nothing else changed, else
    settle it."""
    engine.stats.step_began()
    (planned, queued), engine.ahead = engine.ahead, None
    out = engine.take_failed()
    if isinstance(queued, speculative.Verified):
        out += (launch_speculative(engine, planned, queued) if speculative_eligible(engine, planned)
                else speculative.emit_chain(engine, planned, queued))
    elif eligible(engine, planned.owners):
        out += launch(engine, planned, queued)
    else:
        out += engine._postprocess(planned.owners, queued)
    engine.stats.step_ended()
    return out


def settle(engine) -> None:
    """Finish the step in flight now (its chunks wait in `engine.failed` for the next step's
    output), e.g. before a request leaves the batch."""
    if engine.ahead is not None:
        (planned, queued), engine.ahead = engine.ahead, None
        engine.failed += (speculative.emit_chain(engine, planned, queued) if isinstance(queued, speculative.Verified)
                          else engine._postprocess(planned.owners, queued))
