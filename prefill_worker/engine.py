"""The prefill engine: chunked prefill of several requests per step within a token budget.

    step():  admit → schedule → run → postprocess     (= plan() then run())

* admit: queued requests get their prompt pages (FIFO; a request that does not fit waits); with a
  prefix store, the longest cached resumable prefix is reused and only the rest is computed.
* schedule: prompt chunks of admitted requests, oldest first, up to `token_budget` tokens; a
  chunk ends at each snapshot point so the compress state there can be copied for the cache.
* run: one `ForwardBatch` through the model; the LM head runs on each segment's last token, and on
  every token of a request asking for prompt logprobs (`model/logprobs.py`), which such a request
  collects chunk by chunk. It bypasses the prefix cache: cached positions have no logits.
* postprocess: a request whose prompt is complete samples its first token (position = prompt
  length, the same pure sampling as everywhere) and is returned as `Prefilled`; its pages stay
  held until the owner has shipped them and calls `release`.

`plan` and `run` are the two halves of a step, for an expert-parallel group: its ranks plan, agree
whether any of them has work, then each runs its batch or joins the exchanges idle.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model.batch import ForwardBatch
from model.ep import idle_step
from model.grammar import Grammars
from model.kv_pool import KVPools, PoolExhausted, SeqKV
from model.logprobs import TokenLogprobs, logit_rows, prompt_logprobs, token_logprobs
from model.penalties import History
from model.sampling import sample_rows
from model.transformer import Transformer
from prefill_worker.prefix_store import PrefixStore, Reuse
from worker_runtime.engine_metrics import EngineStats
from worker_runtime.wire import GenerateRequest, RequestState, StepShape, WorkerLoad


@dataclass(frozen=True)
class PrefillConfig:
    token_budget: int = 1024  # prompt tokens per step, over all requests
    max_running: int = 16


@dataclass
class Job:
    req: GenerateRequest
    state: RequestState = RequestState.WAITING
    seq: SeqKV | None = None
    done: int = 0  # prompt tokens in the pools
    reuse: Reuse | None = None  # what the prefix cache gave (None without a cache)
    prompt_lps: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.. so far (when asked)

    def chunk_limit(self) -> int:
        """Tokens until the prompt's end or the next snapshot point, whichever comes first."""
        end = len(self.req.prompt_ids)
        points = [p for p in (self.reuse.snapshot_points if self.reuse else ()) if p > self.done]
        return min([end] + points) - self.done


@dataclass(frozen=True)
class Prefilled:
    request_id: str
    seq: SeqKV  # its pages hold the whole prompt's KV; release with `release`
    first_token: int
    computed_tokens: int  # prompt tokens this worker actually ran through the model
    job: Job
    first_logprobs: TokenLogprobs | None = None  # the first token's, when the request asked
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # prompt tokens 1.., when the request asked


@dataclass(frozen=True)
class Planned:
    """One step's work: the batch and, row-segment by row-segment, the job each belongs to."""

    batch: ForwardBatch
    owners: list[Job]


class PrefillEngine:
    def __init__(self, model: Transformer, pools: KVPools, worker_id: str, config: PrefillConfig = PrefillConfig(),
                 store: PrefixStore | None = None, tokenizer=None):
        """`tokenizer`: the model's (model/tokenizer.py), for requests with a grammar (their first
        token is sampled under it); without one, such requests are refused."""
        self.model, self.pools, self.worker_id, self.config, self.store = model, pools, worker_id, config, store
        self.grammars = (Grammars(tokenizer, model.cfg.vocab_size, model.cfg.eos_token_id)
                         if tokenizer is not None else None)
        model.check_step_tokens(config.token_budget, "the prefill token budget")
        self.waiting: deque[Job] = deque()
        self.running: dict[str, Job] = {}
        self.computed_tokens = 0  # lifetime counter: prompt tokens run through the model
        self.stats = EngineStats()  # the worker's engine metrics (worker_runtime/engine_metrics.py)

    def submit(self, req: GenerateRequest) -> None:
        if req.grammar is not None and self.grammars is None:
            raise ValueError(f"{req.request_id}: a request with a grammar needs a prefill engine with a tokenizer")
        self.waiting.append(Job(req))
        self.stats.queued(req.request_id)

    def abort(self, request_id: str) -> bool:
        for job in list(self.waiting):
            if job.req.request_id == request_id:
                self.waiting.remove(job)
                self.stats.ended(request_id)
                return True
        job = self.running.pop(request_id, None)
        if job is None:
            return False
        self._release(job)
        self.stats.ended(request_id)
        return True

    def job(self, request_id: str) -> Job | None:
        """The queued or running job of `request_id`, if any."""
        if request_id in self.running:
            return self.running[request_id]
        return next((j for j in self.waiting if j.req.request_id == request_id), None)

    def release(self, done: Prefilled) -> None:
        """Give back a finished request's pages once the decode side has them (or gave up): into
        the prefix cache when there is one, else to the pools."""
        self._release(done.job)

    def _release(self, job: Job) -> None:
        if self.store is not None and job.reuse is not None:
            self.store.finish(job.req.prompt_ids, job.seq, job.reuse)
        else:
            self.pools.release(job.seq)

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def load(self) -> WorkerLoad:
        queued = sum(len(j.req.prompt_ids) - j.done for j in list(self.waiting) + list(self.running.values()))
        return WorkerLoad(self.worker_id, "prefill", waiting=len(self.waiting), running=len(self.running),
                          queued_prefill_tokens=queued, free_pages=self.pools.num_free()["swa"],
                          total_pages=self.pools.specs["swa"].num_pages)

    # --- the loop -------------------------------------------------------------------------
    def step(self) -> list[Prefilled]:
        planned = self.plan()
        return [] if planned is None else self.run(planned)

    def plan(self) -> Planned | None:
        """admit → schedule: this step's batch, or None when there is nothing to run now."""
        self.stats.step_began()
        self._admit()
        batch, owners = self._schedule()
        if batch is None:
            self.stats.step_ended()
        return None if batch is None else Planned(batch, owners)

    # --- a rank of an expert-parallel group (worker_runtime/ep_group.py) ---------------------------
    def shape(self, planned: Planned | None) -> StepShape:
        """Prefill steps always run eagerly."""
        return StepShape(busy=int(planned is not None))

    def join_idle(self, agreed: StepShape) -> None:
        idle_step(self.model)

    def run(self, planned: Planned, agreed: StepShape | None = None,
            layer_done: Callable[[int], None] | None = None) -> list[Prefilled]:
        """run → postprocess a planned step (the forward; with expert parallelism, a collective).
        `layer_done(i)` is called after each model layer i of the forward (per-layer streaming)."""
        batch, owners = planned.batch, planned.owners
        hooks = [] if layer_done is None else [
            layer.register_forward_hook(lambda *_, i=i: layer_done(i)) for i, layer in enumerate(self.model.layers)]
        # the head runs on every prompt row only for the requests asking for prompt logprobs
        wide, last = logit_rows(batch.segments, [j.req.prompt_logprobs is not None for j in owners])
        try:
            logits = self.model(batch, self.pools) if wide is None else self.model(
                batch, self.pools, logit_rows=torch.tensor(wide, device=batch.input_ids.device))
        finally:
            for h in hooks:
                h.remove()
        batch.commit()
        if wide is not None:
            for i, (job, seg) in enumerate(zip(owners, batch.segments)):
                if job.req.prompt_logprobs is not None:
                    job.prompt_lps += prompt_logprobs(logits[last[i] - seg.length + 1:last[i] + 1],
                                                      job.req.prompt_ids, seg.start, job.req.prompt_logprobs)
            logits = logits[last]
        rows, done = [], []
        for i, job in enumerate(owners):
            if job.reuse is not None:
                if job.done in job.reuse.snapshot_points:
                    self.store.snapshot(job.seq, job.reuse)
                self.pools.trim_window(job.seq, pinned=self.store.pinned(job.reuse))
            else:
                self.pools.trim_window(job.seq)
            if job.done == len(job.req.prompt_ids):
                del self.running[job.req.request_id]
                job.state = RequestState.TRANSFERRING
                rows.append(i)
                done.append(job)
        self.stats.step_ended()
        if not done:
            return []
        # every finished prompt's first token in one batch on the device; only the ids come back
        logits = logits[rows]
        firsts = sample_rows(logits, [j.req.sampling for j in done], [j.seq.num_tokens for j in done],
                             histories=[self._history(j.req) for j in done],
                             masks=self._grammar_masks(done, logits.device))
        lps = token_logprobs(logits, firsts, [j.req.logprobs for j in done])
        for job in done:  # its first token: the prefill's part of the request is over
            self.stats.first_token(job.req.request_id)
            self.stats.ended(job.req.request_id)
        return [Prefilled(job.req.request_id, job.seq, first,
                          len(job.req.prompt_ids) - (job.reuse.cached_tokens if job.reuse else 0), job, lp,
                          None if job.req.prompt_logprobs is None else tuple(job.prompt_lps))
                for job, first, lp in zip(done, firsts, lps)]

    def _grammar_masks(self, done: list[Job], device):
        """The first token's mask of each job with a grammar (model/grammar.py); None when none has one."""
        if self.grammars is None:
            return None
        return self.grammars.bitmask([self.grammars.state(j.req.grammar, j.req.grammar_replay) if j.req.grammar
                                      else None for j in done], device)

    def _history(self, req: GenerateRequest) -> History | None:
        """What the first token's logit adjustments read: the prompt, no output, min_tokens' ids."""
        if not req.sampling.adjusts:
            return None
        eos = () if req.ignore_eos else (self.model.cfg.eos_token_id,)
        return History(req.prompt_ids, (), req.stop_token_ids + eos)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_running:
            job = self.waiting[0]
            try:
                if self.store is not None:
                    # prompt logprobs need every position's logits, which the cache does not keep
                    seq, job.reuse = self.store.admit(job.req.prompt_ids, match=job.req.prompt_logprobs is None)
                    job.done = job.reuse.cached_tokens
                else:
                    seq = SeqKV()
                    self.pools.reserve(seq, len(job.req.prompt_ids))
            except PoolExhausted:
                break
            self.waiting.popleft()
            job.seq, job.state = seq, RequestState.PREFILLING
            self.running[job.req.request_id] = job
            self.stats.scheduled(job.req.request_id)
            if self.store is not None:
                self.stats.prefix_lookup(len(job.req.prompt_ids), job.reuse.cached_tokens)

    def _schedule(self) -> tuple[ForwardBatch | None, list[Job]]:
        items, owners, budget = [], [], self.config.token_budget
        for job in self.running.values():
            if budget <= 0:
                break
            prompt = job.req.prompt_ids
            n = min(budget, job.chunk_limit())
            items.append((job.seq, list(prompt[job.done:job.done + n])))
            owners.append(job)
            job.done += n
            budget -= n
            self.computed_tokens += n
            self.stats.computed(prompt_tokens=n)
        if not items:
            return None, []
        return ForwardBatch.build(items, device=self.pools.device), owners
