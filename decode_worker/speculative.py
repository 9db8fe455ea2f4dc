"""The decode engine's speculative steps (`DecodeConfig.speculative_tokens` N > 0; the method in
`model/speculation.py`).

* `draft`: at schedule time, every decoding request drafts N tokens with the MTP block, also
  near its max_tokens (its pages hold N positions past it: `DecodeEngine.tokens_held`; the rows
  past max_tokens are dropped), and its segment becomes the verify segment [last token,
  drafts...]. A batch of decoding requests then always has the verify graphs' shape, where
  shorter segments at the ends of requests would send whole steps to the eager path.
* `verify`: the step's forward, with logits at every row of a verify segment and at the last row
  of the others: a CUDA graph of the batch's size when every segment verifies N drafts and the
  worker captured graphs of N+1 tokens a row (`DecodeGraphs.tokens_per_row`, the MTP extension
  inside), else eagerly; the drafts replay the worker's draft graphs; one batched sampling draws
  the target's token at every such row;
  each verify segment keeps its agreeing prefix plus the target's next token and rolls the pools
  back past it. Tokens are emitted one by one through the engine's stop checks: a stop or
  max_tokens inside an accepted run ends the request there, as it would without speculation.

A step drafted on the device is queued through its roll-back (`queue_chain`) and its tokens are
emitted once its targets and counts reach the host (`emit_chain`); in between, the same requests'
next step may be queued from those counts on the device (`decode_worker/overlap.py`).

A request with a grammar (`model/grammar.py`) accepts no drafts: its mask depends on the tokens
before it, so a draft row would need the grammar advanced over unverified drafts and rolled back.
Its segment still has N+1 rows (the MTP's drafts as placeholders, `Pending.binding` False), so a
batch with it keeps the verify graphs' shape: the first row is masked by its grammar and gives
its one token, the others are sampled unmasked and dropped, and the roll-back undoes their KV.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from model import speculation
from model.batch import ForwardBatch, HostCopy
from model.logprobs import token_logprobs
from model.sampling import DrawInputs, draw_rows, sample_rows
from worker_runtime.wire import ErrorCode, RequestState, TokenChunk


def check(model, pools, spec: int, max_batch: int, graphs) -> None:
    """What an engine of `spec` speculative tokens a step, up to `max_batch` decoding requests,
    needs of its model, pools and decode graphs (`worker_runtime.model_loader.DecodeGraphs`)."""
    if spec:
        speculation.check_model(model, pools)
    if graphs is not None and graphs.tokens_per_row != 1 + spec:
        raise ValueError(f"decode graphs of {graphs.tokens_per_row} token(s) a request cannot run the steps of "
                         f"{spec} speculative token(s) ({1 + spec} a request)")
    if graphs is not None and spec and any((g.L > 1) != (g.B <= max_batch) for g in graphs.graphs):
        raise ValueError(f"the decode graphs capture verify steps up to {graphs.verify_max_rows} requests, the "
                         f"engine speculates up to {max_batch}: give both the same limit")


def ahead_draws(model, pools, spec: int, graphs) -> DrawInputs | None:
    """The target draws of verify steps queued ahead (`overlap.launch_speculative`): one row per
    verify row of the largest verify graph, N+1 candidate positions each; None where no step can
    go ahead (no speculation, or no graphs)."""
    if not spec or graphs is None:
        return None
    return DrawInputs(graphs.verify_max_rows * (1 + spec), 1, model.cfg.vocab_size, torch.device(pools.device),
                      span=1 + spec)


def on_device(owners: list) -> bool:
    """Whether a step of `owners` runs on the device from its drafts to its roll-back
    (`model/speculation.py`): every row is a decoding request whose sampling needs nothing from
    the host (no grammar, penalties or logprobs)."""
    return all(yields and r.state is RequestState.DECODING and r.grammar is None and r.req.logprobs is None
               and not r.req.sampling.adjusts for r, yields in owners)


def speculated(engine, r, proposed: int, accepted: int) -> None:
    """Count a verified step's drafts: the engine's totals, its worker's metrics and the request's
    usage."""
    engine.spec_proposed += proposed
    engine.spec_accepted += accepted
    engine.stats.speculated(proposed, accepted)
    r.spec_proposed += proposed
    r.spec_accepted += accepted


def draft(engine, owners: list, items: list) -> tuple:
    """Draft for the decoding requests among `owners`, rewrite their `items` into verify segments;
    → pending[i] per segment (None for a prefill chunk)."""
    spec = engine.config.speculative_tokens
    decoding = [i for i, (r, _) in enumerate(owners) if r.state is RequestState.DECODING]
    if not decoding:
        return (None,) * len(owners)
    runs = [owners[i][0] for i in decoding]
    graphs = engine.graphs
    drafted = speculation.draft(engine.model, engine.pools, [(r.seq, r.tokens[-1], spec, r.req.sampling) for r in runs],
                                graphs.draft_for_rows if graphs is not None else None, on_device=on_device(owners),
                                chain_for=graphs.chain_for_rows if graphs is not None else None)
    # a grammar's row verifies N placeholder rows, never accepted (see the module docstring)
    drafted = [dataclasses.replace(p, binding=False) if r.grammar is not None else p for r, p in zip(runs, drafted)]
    pending: list = [None] * len(owners)
    for i, p in zip(decoding, drafted):
        pending[i] = p
        items[i] = (p.seq, p.tokens)
    return tuple(pending)


def verify(engine, planned) -> list[TokenChunk]:
    """Run → postprocess a step with verify segments (see the module docstring)."""
    if planned.pending[0] is not None and planned.pending[0].chain is not None:
        return verify_chain(engine, planned)
    batch, owners, pending = planned.batch, planned.owners, planned.pending
    # every row of a verify segment, and of a prompt chunk asking for prompt logprobs; else the last
    rows = [list(range(s.offset, s.offset + s.length)) if p is not None or r.wants_prompt_rows
            else [s.offset + s.length - 1] for s, p, (r, _) in zip(batch.segments, pending, owners)]
    flat = [i for seg_rows in rows for i in seg_rows]
    graphs = engine.graphs
    graph = graphs.for_batch(batch) if graphs is not None and all(p is not None for p in pending) else None
    if graph is not None:  # every row a verify segment of the graph's length: flat is every row, in order
        logits = graph.run(batch)  # the MTP extension included
        streams = graph.streams[: len(flat)]
        graphs.replays += 1
    else:
        logits, streams = engine.model(batch, engine.pools, return_streams=True,
                                       logit_rows=torch.tensor(flat, device=batch.input_ids.device))
    batch.commit()
    out, picked, params, positions, histories, grammars, at = [], [], [], [], [], [], 0
    for i, (r, yields) in enumerate(owners):
        first, n = at, len(rows[i])
        at += n
        if pending[i] is None:
            engine.pools.trim_window(r.seq)
            if r.wants_prompt_rows:
                r.add_prompt_logprobs(logits[first:first + n], batch.segments[i].start)
            first, n = first + n - 1, 1  # a prompt chunk samples at its last row only
        if not yields or r.req.request_id not in engine.running:
            continue
        if r.req.deadline is not None and time.time() > r.req.deadline:
            out.append(engine._fail(r, ErrorCode.DEADLINE_EXCEEDED, "request deadline exceeded"))
            continue
        picked.append((i, r, first, n))
        params += [r.req.sampling] * n
        grammars += [r.grammar] + [None] * (n - 1)  # a grammar's rows past the first are dropped
        # verify row j samples as if the drafts before it were accepted (it is used only then)
        drafts = pending[i].drafts if pending[i] is not None else ()
        histories += [r.history(engine.eos_id, tuple(drafts[:j])) for j in range(n)]
        # row j of the segment feeds position num_tokens - n + j; its token sits one further
        positions += list(range(r.seq.num_tokens - n + 1, r.seq.num_tokens + 1))
    if not picked:
        return out
    index = [first + j for _, _, first, n in picked for j in range(n)]
    logits = logits[index] if len(index) < len(flat) else logits
    tokens = sample_rows(logits, params, positions, histories=histories,
                         masks=engine.grammars.bitmask(grammars, logits.device))
    # a row's logprobs belong to the target's token there: settle keeps a prefix of the rows' tokens
    lps = token_logprobs(logits, tokens, [r.req.logprobs for _, r, _, n in picked for _ in range(n)])
    split, k = [], 0
    for _, _, _, n in picked:
        split.append((tokens[k:k + n], lps[k:k + n]))
        k += n
    spec = [(j, pending[i]) for j, (i, _, _, _) in enumerate(picked) if pending[i] is not None]
    kept = speculation.settle(engine.pools, [p for _, p in spec], [split[j][0] for j, _ in spec], streams,
                              [batch.segments[picked[j][0]].offset for j, _ in spec])
    for (j, p), targets in zip(spec, kept):
        split[j] = (targets, split[j][1])
        engine.pools.trim_window(picked[j][1].seq)
        if p.binding:
            speculated(engine, picked[j][1], len(p.drafts), len(targets) - 1)
    for (_, r, _, _), (targets, row_lps) in zip(picked, split):
        r.state = RequestState.DECODING
        for token, lp in zip(targets, row_lps):
            out.append(engine._emit(r, token, lp))
            if r.req.request_id not in engine.running:
                break
    return out


@dataclasses.dataclass(frozen=True)
class Verified:
    """A step drafted on the device, queued through its roll-back (`queue_chain`): its targets
    [R, N+1] and accepted counts [R] on the device, and their copy to the host, queued."""

    targets: torch.Tensor
    accepted: torch.Tensor
    copy: HostCopy  # [R, N+2]: the targets, then the count

    def wait(self) -> list[list[int]]:
        return self.copy.wait()


def verify_chain(engine, planned) -> list[TokenChunk]:
    """`verify` for a step drafted on the device (`on_device`): the verify reads the chain's ids,
    the targets are drawn there and `speculation.settle_chain` rolls back there; the host waits
    once, for the targets and the accepted counts, then emits."""
    return emit_chain(engine, planned, queue_chain(engine, planned))


def queue_chain(engine, planned, shift: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> Verified:
    """Queue a chain-drafted step's verify, target draws and roll-back, and the copy of the
    targets and counts to the host, without waiting for anything. `shift`, `offsets`: a step
    queued ahead (`overlap.launch_speculative`): each segment's true start is `shift` [R] (<= 0)
    from the batch's, and its row j's target is drawn at the `offsets`-th of N+1 candidate
    positions by `engine.verify_draws`."""
    batch, owners, pending = planned.batch, planned.owners, planned.pending
    L = pending[0].chain.shape[1]  # N+1 tokens a segment
    batch = ForwardBatch(pending[0].chain.view(-1), batch.positions, batch.segments)  # the ids on the device
    graphs = engine.graphs
    graph = graphs.for_batch(batch) if graphs is not None else None
    if graph is not None:
        logits, streams = graph.run(batch, shift), graph.streams
        graphs.replays += 1
    elif shift is None:
        logits, streams = engine.model(batch, engine.pools, return_streams=True, all_logits=True)
    else:
        raise ValueError("a speculative step queued ahead needs a verify graph of its batch")
    batch.commit()
    params = [r.req.sampling for r, _ in owners for _ in range(L)]
    logits = logits[: len(owners) * L]
    if shift is None:  # row j of a segment samples the token at position n + 1 + j, as in `verify`
        targets = draw_rows(logits, params, [p.start + 1 + j for p in pending for j in range(L)])
    else:
        # the batch's start H is n + N + 1 (every draft of the step before kept); the true one is
        # H + shift, shift = offset - N: row j's position H + 1 + j + shift, the offset-th candidate
        # from H + 1 + j - N
        engine.verify_draws.load(params, [[p.start + 2 - L + j + i for i in range(L)] for p in pending
                                          for j in range(L)], offsets.repeat_interleave(L))
        targets = engine.verify_draws.draw(logits, 0, engine.model.impl)
    targets = targets.view(len(owners), L)
    accepted = speculation.settle_chain(engine.pools, list(pending), targets, streams)
    return Verified(targets, accepted, HostCopy.queue(torch.cat([targets, accepted[:, None]], dim=1)))


def emit_chain(engine, planned, verified: Verified, host: list[list[int]] | None = None) -> list[TokenChunk]:
    """The host's part of a chain-drafted step once its targets and counts arrive (`host`: already
    waited for): each request keeps n + a + 1 tokens and emits t_0..t_a. A request that left the
    batch since the step was queued (ended, aborted: a step queued ahead) is skipped."""
    out = []
    L = planned.pending[0].chain.shape[1]
    for (r, _), p, (*tokens, a) in zip(planned.owners, planned.pending, host or verified.wait()):
        if engine.running.get(r.req.request_id) is not r or r.state is not RequestState.DECODING:
            continue
        r.seq.num_tokens = p.start + a + 1
        engine.pools.trim_window(r.seq)
        speculated(engine, r, L - 1, a)
        if r.req.deadline is not None and time.time() > r.req.deadline:
            out.append(engine._fail(r, ErrorCode.DEADLINE_EXCEEDED, "request deadline exceeded"))
            continue
        for token in tokens[: a + 1]:
            out.append(engine._emit(r, token))
            if r.req.request_id not in engine.running:
                break
    return out
