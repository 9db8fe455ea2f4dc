"""The decode engine: continuous batching of every admitted request over one model replica.

    step():  admit → schedule → run → postprocess      (= plan() then run(planned))

* admit: waiting requests (FIFO) get all their pages up front (prompt + max_tokens), so a
  running request never runs out mid-decode; a request that does not fit waits.
* schedule: one token for every decoding request, plus prompt chunks of requests this worker
  prefills itself (conditional disaggregation), within a per-step prefill token budget.
* run: one `ForwardBatch` through the model (a decode-only batch on a GPU replays the CUDA graph
  of the smallest bucket that fits it, when the worker captured graphs).
* postprocess: sample (a pure function of logits, seed, position), detokenise, check stop
  conditions, emit `TokenChunk`s, release the pages of finished requests.

With speculation (`DecodeConfig.speculative_tokens` > 0) schedule drafts with the MTP block and a
decoding request's segment verifies them; postprocess keeps the tokens the target agrees with
(`decode_worker/speculative.py`). The tokens are those of decoding without it.

Overlapped (`DecodeConfig.overlap`): a decode-only step queues the same requests' next step, fed
with its ids on the device, before those ids reach the host (`decode_worker/overlap.py`); so does
a speculative step drafted on the device, placed there by its accepted counts; the next `step()`
continues from it. The tokens are those of steps taken one at a time.

Migration: `pause` takes a decoding request out of the batch at a token boundary (its pages stay
put while they ship), then either `hand_off` (the target verified them: release here) or
`resume` (the migration failed: it decodes here again). `admit_migrated` is the other side.

It is a plain object driven by its owner's loop (the Ray actor); it never blocks or sleeps.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from decode_worker import overlap, speculative
from decode_worker.running import Planned, Running
from model import speculation
from model.batch import ForwardBatch
from model.detokenizer import Detokenizer
from model.ep import idle_step
from model.grammar import GrammarError, Grammars, GrammarState
from model.kv_pool import KVPools, PoolExhausted, SeqKV
from model.logprobs import TokenLogprobs, logit_rows, token_logprobs
from model.sampling import sample_rows
from model.transformer import Transformer
from worker_runtime.engine_metrics import EngineStats
from worker_runtime.model_loader import DecodeGraphs
from worker_runtime.wire import (
    ErrorCode,
    ErrorInfo,
    GenerateRequest,
    MigrationHeader,
    RequestState,
    StepShape,
    TokenChunk,
    WorkerLoad,
)


@dataclass(frozen=True)
class DecodeConfig:
    prefill_token_budget: int = 512  # prompt tokens prefilled locally per step
    max_running: int = 64
    speculative_tokens: int = 0  # drafts per request and step through the MTP block (0: off)
    # speculate while at most this many requests decode; above, plain steps: a large batch keeps the
    # GPU busy already, and a verify step of N+1 tokens a request costs more than it saves there
    speculative_max_batch: int = 16
    overlap: bool = True  # queue the next decode step before this one's tokens reach the host (overlap.py)

    def __post_init__(self):
        speculation.check_depth(self.speculative_tokens)
        if self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")


class DecodeEngine:
    def __init__(self, model: Transformer, pools: KVPools, tokenizer, worker_id: str,
                 config: DecodeConfig = DecodeConfig(), graphs: DecodeGraphs | None = None):
        self.model, self.pools, self.tokenizer, self.worker_id, self.config = model, pools, tokenizer, worker_id, config
        # a step carries the running requests' tokens and up to the budget of local prefill
        spec = config.speculative_tokens
        model.check_step_tokens(config.max_running * (1 + spec) + config.prefill_token_budget,
                                "max_running × (1 + speculative tokens) + the prefill token budget")
        speculative.check(model, pools, spec, config.speculative_max_batch, graphs)
        self.graphs = graphs
        # positions a request's pages hold past its max_tokens: what a verify step or a step queued
        # ahead feeds there (`tokens_held`); a verify step queued ahead of one that kept every
        # draft, N + 1 more
        self.lookahead = 2 * spec + 1 if spec and config.overlap else max(spec, int(config.overlap))
        self.verify_draws = speculative.ahead_draws(model, pools, spec, graphs) if config.overlap else None
        self.spec_proposed = 0  # drafts verified, over the engine's life
        self.spec_accepted = 0  # of which equal to the target's own token
        self.eos_id = model.cfg.eos_token_id
        self.grammars = Grammars(tokenizer, model.cfg.vocab_size, self.eos_id)
        self.waiting: deque[Running] = deque()
        self.running: dict[str, Running] = {}
        self.failed: list[TokenChunk] = []  # admission failures (and a settled step's chunks) not returned yet
        # a step queued before the last one's ids were known: its logits, or a speculative step's
        # targets and counts on their way to the host
        self.ahead: tuple[Planned, torch.Tensor | speculative.Verified] | None = None
        self.stats = EngineStats()  # the worker's engine metrics (worker_runtime/engine_metrics.py)

    # --- admission ------------------------------------------------------------------------
    def submit(self, req: GenerateRequest) -> None:
        """Queue a request this worker prefills itself."""
        self.waiting.append(Running(req, RequestState.WAITING, Detokenizer(self.tokenizer, req.stop_strings),
                                    grammar=self._grammar(req)))
        self.stats.queued(req.request_id)

    def admit_transferred(self, req: GenerateRequest, seq: SeqKV, first_token: int,
                          cached_tokens: int = 0, first_logprobs: TokenLogprobs | None = None,
                          prompt_logprobs: tuple[TokenLogprobs, ...] | None = None) -> list[TokenChunk]:
        """Start decoding a request whose prompt KV arrived from a prefill worker; `first_token`
        (and its logprobs, and the prompt's, when the request asked) was sampled there. Raises
        PoolExhausted if its decode pages cannot be reserved."""
        if req.logprobs is not None and first_logprobs is None:
            raise ValueError(f"{req.request_id}: asks for logprobs, its first token came without them")
        if req.prompt_logprobs is not None and prompt_logprobs is None:
            raise ValueError(f"{req.request_id}: asks for prompt logprobs, its KV came without them")
        r = Running(req, RequestState.DECODING, Detokenizer(self.tokenizer, req.stop_strings), seq=seq,
                    prefilled=len(req.prompt_ids), cached_tokens=cached_tokens, prompt_lps=list(prompt_logprobs or ()))
        r.grammar = self._grammar(req)
        self.pools.reserve(seq, self.tokens_held(r.req))
        self.running[req.request_id] = r
        return [self._emit(r, first_token, first_logprobs)]

    def admit_migrated(self, req: GenerateRequest, seq: SeqKV, header: MigrationHeader, extra: SeqKV) -> None:
        """Continue a request another decode worker paused (`Running.migration_header`): `seq`
        holds the KV of its prompt and every generated token but the last, `header.tokens[-1]` is
        fed next; `extra` holds the decode pages reserved for the rest (taken over here). Emits
        nothing: the client has every token in `header.tokens` already."""
        tokens = list(header.tokens)
        if seq.num_tokens != len(req.prompt_ids) + len(tokens) - 1:
            raise ValueError(f"{req.request_id}: {seq.num_tokens} cached tokens for "
                             f"{len(req.prompt_ids)} prompt + {len(tokens)} generated")
        for kind, pages in extra.pages.items():
            seq.pages[kind].extend(pages)
        r = Running(req, RequestState.DECODING, Detokenizer.resume(self.tokenizer, req.stop_strings, tokens,
                                                                   header.emitted_chars),
                    seq=seq, prefilled=len(req.prompt_ids), tokens=tokens, cached_tokens=header.cached_tokens,
                    grammar=self._grammar(req, tokens), spec_proposed=header.spec_proposed,
                    spec_accepted=header.spec_accepted)
        self.running[req.request_id] = r

    def _grammar(self, req: GenerateRequest, output: list[int] = ()) -> GrammarState | None:
        """The request's grammar state after `output` (the grammar compiled here unless the actor
        prepared it off the loop: `Grammars.prepare`). Raises GrammarError."""
        return None if req.grammar is None else self.grammars.state(req.grammar, req.grammar_replay + tuple(output))

    def pause(self, request_id: str) -> Running | None:
        """Take a decoding request out of the batch (between steps); None unless it is decoding."""
        overlap.settle(self)  # its chunks leave before its pages (`take_failed`)
        r = self.running.get(request_id)
        if r is None or r.state is not RequestState.DECODING:
            return None
        r.state = RequestState.MIGRATING
        return r

    def resume(self, request_id: str) -> None:
        """Its migration failed: back into the batch, exactly where it paused."""
        r = self.running.get(request_id)
        if r is not None and r.state is RequestState.MIGRATING:
            r.state = RequestState.DECODING

    def hand_off(self, request_id: str) -> None:
        """Its migration committed: the other worker runs it now; free its pages here."""
        r = self.running.get(request_id)
        if r is not None and r.state is RequestState.MIGRATING:
            self._finish(r, RequestState.MIGRATED)

    def decoding(self) -> list[str]:
        """Ids of the requests in the batch that could migrate now."""
        return [rid for rid, r in self.running.items() if r.state is RequestState.DECODING]

    def abort(self, request_id: str) -> bool:
        for r in list(self.waiting):
            if r.req.request_id == request_id:
                self.waiting.remove(r)
                self.stats.ended(request_id)
                return True
        if request_id not in self.running:  # ended already (a stream's cleanup): nothing to settle
            return False
        overlap.settle(self)
        self.failed = [c for c in self.failed if c.request_id != request_id]
        r = self.running.pop(request_id, None)
        if r is None:  # the settled step ended it
            return False
        r.state = RequestState.ABORTED
        self.pools.release(r.seq)
        self.stats.ended(request_id)
        return True

    def has_work(self) -> bool:
        """Anything a step would do (a paused request waits for its migration, not for a step),
        chunks to return among it: a step settled outside `step` (`overlap.settle`) may have
        ended the last request."""
        return (bool(self.waiting) or self.ahead is not None or bool(self.failed)
                or any(r.state is not RequestState.MIGRATING for r in self.running.values()))

    def idle(self) -> bool:
        return not self.waiting and not self.running and self.ahead is None and not self.failed

    def tokens_left(self) -> int:
        """Tokens the decoding requests may still generate (an upper bound: stops end them early)."""
        return sum(r.req.max_tokens - len(r.tokens) for r in self.running.values()
                   if r.state is RequestState.DECODING)

    def idle_free(self) -> dict[str, int]:
        """Free pages per kind once every request has ended (the graphs' scratch stays held)."""
        held = self.graphs.held_pages() if self.graphs else {}
        return {k: n - held.get(k, 0) for k, n in self.pools.idle_free().items()}

    def load(self) -> WorkerLoad:
        free = self.pools.num_free()
        return WorkerLoad(self.worker_id, "decode", waiting=len(self.waiting), running=len(self.running),
                          queued_prefill_tokens=sum(len(r.req.prompt_ids) - r.prefilled for r in self.waiting),
                          free_pages=free["swa"], total_pages=self.pools.specs["swa"].num_pages)

    def _admit(self) -> list[TokenChunk]:
        out = []
        while self.waiting and len(self.running) < self.config.max_running:
            r = self.waiting[0]
            if r.req.deadline is not None and time.time() > r.req.deadline:
                self.waiting.popleft()
                out.append(self._fail(r, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while waiting"))
                continue
            seq = SeqKV()
            try:
                self.pools.reserve(seq, self.tokens_held(r.req))
            except PoolExhausted:
                break  # FIFO: later requests wait behind the head
            self.waiting.popleft()
            r.seq, r.state = seq, RequestState.PREFILLING
            self.running[r.req.request_id] = r
            self.stats.scheduled(r.req.request_id)
        return out

    # --- the loop -------------------------------------------------------------------------
    def step(self) -> list[TokenChunk]:
        if self.ahead is not None:
            return overlap.advance(self)
        planned = self.plan()
        return self.run(planned) if planned is not None else self.take_failed()

    def plan(self) -> Planned | None:
        """Admit, then this step's batch (None: no forward to run). Admission failures wait in
        `failed` for the next `run` or `take_failed`. With `run`: the steps of an
        expert-parallel group (worker_runtime/ep_group.py), which must agree before running."""
        self.stats.step_began()
        self.failed += self._admit()
        batch, owners, pending = self._schedule()
        if batch is None:
            self.stats.step_ended()
        return None if batch is None else Planned(batch, owners, pending)

    def run(self, planned: Planned, agreed: StepShape | None = None) -> list[TokenChunk]:
        """run → postprocess; `agreed`: the step an expert-parallel group settled on (its graph
        bucket, or eager), else the graph is this engine's own choice."""
        if any(planned.pending):
            if agreed is None and overlap.speculative_eligible(self, planned):  # the next step goes ahead
                queued = speculative.queue_chain(self, planned)
                out = self.take_failed() + overlap.launch_speculative(self, planned, queued)
            else:
                out = self.take_failed() + speculative.verify(self, planned)
            self.stats.step_ended()
            return out
        logits = self._run(planned.batch, agreed, planned.owners)
        planned.batch.commit()
        if agreed is None and overlap.eligible(self, planned.owners):
            out = self.take_failed() + overlap.launch(self, planned, logits)
        else:
            out = self.take_failed() + self._postprocess(planned.owners, logits)
        self.stats.step_ended()
        return out

    # --- a rank of an expert-parallel group (worker_runtime/ep_group.py) ---------------------------
    def shape(self, planned: Planned | None) -> StepShape:
        if planned is None:
            return StepShape(busy=0, rows=0, eager=0)
        graphable = self.graphs is not None and self.graphs.for_batch(planned.batch) is not None
        return StepShape(busy=1, rows=len(planned.batch.segments), eager=int(not graphable))

    def join_idle(self, agreed: StepShape) -> None:
        """Join the group's step with no rows: its graph on padding rows, or the eager exchanges."""
        if agreed.eager:
            idle_step(self.model)
        else:
            self.graphs.for_rows(agreed.rows).run_padding()
            self.graphs.replays += 1

    def speculates(self, decoding: int) -> bool:
        """Whether a step of `decoding` decoding requests drafts (`DecodeConfig.speculative_max_batch`)."""
        return 0 < decoding <= self.config.speculative_max_batch and self.config.speculative_tokens > 0

    def take_failed(self) -> list[TokenChunk]:
        out, self.failed = self.failed, []
        return out

    def _schedule(self) -> tuple[ForwardBatch | None, list[tuple[Running, bool]], tuple]:
        """Items for one forward; owners[i] = (request, whether segment i yields a new token); the
        decoding requests' speculative steps (drafted here, with speculation)."""
        items, owners = [], []
        budget = self.config.prefill_token_budget
        for r in self.running.values():
            if r.state is RequestState.DECODING:
                items.append((r.seq, [r.tokens[-1]]))
                owners.append((r, True))
            elif r.state is RequestState.PREFILLING and budget > 0:
                prompt = r.req.prompt_ids
                n = min(budget, len(prompt) - r.prefilled)
                items.append((r.seq, list(prompt[r.prefilled:r.prefilled + n])))
                r.prefilled += n
                self.stats.computed(prompt_tokens=n)
                budget -= n
                owners.append((r, r.prefilled == len(prompt)))
        if not items:
            return None, [], ()
        decoding = sum(1 for r, _ in owners if r.state is RequestState.DECODING)
        pending = speculative.draft(self, owners, items) if self.speculates(decoding) else ()
        return ForwardBatch.build(items, device=self.pools.device), owners, pending

    def _run(self, batch: ForwardBatch, agreed: StepShape | None = None, owners=()):
        """Logits [rows, vocab] of each segment's last token on the model's device (sampling runs
        there too). A prompt chunk asking for prompt logprobs (never in a graph: it is a prefill)
        has the head run on all its rows; their logprobs go to its request."""
        wide, last = logit_rows(batch.segments, [r.wants_prompt_rows for r, _ in owners])
        if wide is not None:
            logits = self.model(batch, self.pools, logit_rows=torch.tensor(wide, device=batch.input_ids.device))
            for i, ((r, _), seg) in enumerate(zip(owners, batch.segments)):
                if r.wants_prompt_rows:
                    r.add_prompt_logprobs(logits[last[i] - seg.length + 1:last[i] + 1], seg.start)
            return logits[last]
        if agreed is None:
            graph = self.graphs.for_batch(batch) if self.graphs else None
        elif not agreed.eager:  # every rank of the group replays the same bucket
            graph = self.graphs.for_rows(agreed.rows)
        else:
            graph = None
        if graph is None:
            logits = self.model(batch, self.pools)
        else:
            logits = graph.run(batch)
            self.graphs.replays += 1
        return logits

    def _postprocess(self, owners: list[tuple[Running, bool]], logits, drawn: list[int] | None = None
                     ) -> list[TokenChunk]:
        """Sample every row that yields a token in one batch on the device (only the ids reach
        the host), then emit them in row order. `drawn`: every row's id, drawn already (an
        overlapped step's, without logprobs). A row whose request left the batch since the step
        was queued (ended, aborted, paused: `overlap.py`) is skipped."""
        out, rows, sampled = [], [], []
        for i, (r, yields) in enumerate(owners):
            if self.running.get(r.req.request_id) is not r or r.state is RequestState.MIGRATING:
                continue
            self.pools.trim_window(r.seq)
            if not yields:
                continue
            if r.req.deadline is not None and time.time() > r.req.deadline:
                out.append(self._fail(r, ErrorCode.DEADLINE_EXCEEDED, "request deadline exceeded"))
                continue
            rows.append(i)
            sampled.append(r)
        if not rows:
            return out
        if drawn is not None:
            tokens, lps = [drawn[i] for i in rows], [None] * len(rows)
        else:
            logits = logits[rows] if len(rows) < len(owners) else logits
            tokens = sample_rows(logits, [r.req.sampling for r in sampled], [r.seq.num_tokens for r in sampled],
                                 histories=[r.history(self.eos_id) for r in sampled],
                                 masks=self.grammars.bitmask([r.grammar for r in sampled], logits.device))
            lps = token_logprobs(logits, tokens, [r.req.logprobs for r in sampled])
        for r, token, lp in zip(sampled, tokens, lps):
            r.state = RequestState.DECODING
            out.append(self._emit(r, token, lp))
        return out

    def tokens_held(self, req: GenerateRequest) -> int:
        """Tokens a request's decode pages hold: its prompt and every output token but the last
        (never fed; a request of max_tokens 0 still holds its prompt), and `lookahead` more for
        what a full-length verify step (speculative.py) or a step queued ahead (overlap.py)
        feeds past its end."""
        return len(req.prompt_ids) + max(req.max_tokens, 1) - 1 + self.lookahead

    # --- output ---------------------------------------------------------------------------
    def _emit(self, r: Running, token: int, lp: TokenLogprobs | None = None) -> TokenChunk:
        if r.req.max_tokens == 0:  # the token sampled after an echoed prompt is dropped
            self.stats.first_token(r.req.request_id)
            self._finish(r, RequestState.FINISHED)
            return r.scored()
        try:
            chunk = r.keep(token, lp, self.eos_id)
        except GrammarError as e:
            return self._fail(r, ErrorCode.INTERNAL, str(e))
        self.stats.computed(generated=1)
        if len(r.tokens) == 1:
            self.stats.first_token(r.req.request_id)
        if chunk.finish_reason is not None:
            self._finish(r, RequestState.FINISHED)
        return chunk

    def _fail(self, r: Running, code: ErrorCode, message: str) -> TokenChunk:
        self._finish(r, RequestState.FAILED)
        return TokenChunk(r.req.request_id, (), error=ErrorInfo(code, message))

    def _finish(self, r: Running, state: RequestState) -> None:
        r.state = state
        self.running.pop(r.req.request_id, None)
        self.stats.ended(r.req.request_id, len(r.tokens), state is RequestState.FINISHED)
        if r.seq is not None:
            self.pools.release(r.seq)

