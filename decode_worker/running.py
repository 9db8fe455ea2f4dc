"""A request's record on the decode worker (`Running`: its state, pages, tokens, and the chunk each
kept token becomes) and one planned step (`Planned`), shared by the engine
(`decode_worker/engine.py`), its speculative steps and the migration out."""

from __future__ import annotations

from dataclasses import dataclass, field

from model import speculation
from model.batch import ForwardBatch
from model.detokenizer import Detokenizer
from model.grammar import GrammarState
from model.kv_pool import SeqKV
from model.logprobs import TokenLogprobs, prompt_logprobs
from model.penalties import History
from worker_runtime.wire import GenerateRequest, MigrationHeader, RequestState, TokenChunk, Usage


@dataclass
class Running:
    req: GenerateRequest
    state: RequestState
    detok: Detokenizer
    seq: SeqKV | None = None
    prefilled: int = 0  # prompt tokens in the pools (local prefill progress)
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    grammar: GrammarState | None = None  # its grammar's state after `tokens` (req.grammar set)
    prompt_lps: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.. (prompt logprobs asked)
    spec_proposed: int = 0  # drafts its verify steps checked (here and on the workers it migrated from)
    spec_accepted: int = 0  # of which equal to the target's own token

    @property
    def wants_prompt_rows(self) -> bool:
        """Whether its prompt chunk in this step needs the logits at every row (prompt logprobs)."""
        return self.state is RequestState.PREFILLING and self.req.prompt_logprobs is not None

    def add_prompt_logprobs(self, logits, start: int) -> None:
        """The logprobs of the prompt tokens that a prompt chunk's logits [n, V] at positions
        start.. predict."""
        self.prompt_lps += prompt_logprobs(logits, self.req.prompt_ids, start, self.req.prompt_logprobs)

    def history(self, eos_id: int, drafts: tuple[int, ...] = ()) -> History | None:
        """What its logit adjustments read (None when its sampling has none): its prompt, its output
        so far (and the drafts before a verify row), and the ids min_tokens masks."""
        req = self.req
        if not req.sampling.adjusts:
            return None
        stops = req.stop_token_ids + (() if req.ignore_eos else (eos_id,))
        return History(req.prompt_ids, tuple(self.tokens) + drafts, stops)

    def keep(self, token: int, lp: TokenLogprobs | None, eos_id: int) -> TokenChunk:
        """Append a sampled token → its chunk, with a finish reason when it ends the request: a stop
        id, EOS (unless ignored), a stop string, a complete grammar (which allows nothing more) or
        max_tokens. Raises GrammarError for a token its grammar refuses (never sampled so)."""
        req = self.req
        prompt_lps = tuple(self.prompt_lps) if req.prompt_logprobs is not None and not self.tokens else None
        if self.grammar is not None:
            self.grammar.advance(token)
        self.tokens.append(token)
        text, lps = self.detok.push(token), (lp,) if lp is not None else None
        finish = None
        if (token in req.stop_token_ids or (token == eos_id and not req.ignore_eos) or self.detok.stopped
                or (self.grammar is not None and self.grammar.done)):
            finish = "stop"
        elif len(self.tokens) >= req.max_tokens:
            finish = "length"
        if finish is None:
            return TokenChunk(req.request_id, (token,), text, logprobs=lps, prompt_logprobs=prompt_lps)
        return TokenChunk(req.request_id, (token,), text + self.detok.flush(), finish_reason=finish,
                          usage=Usage(len(req.prompt_ids), len(self.tokens), self.cached_tokens,
                                      self.spec_proposed, self.spec_accepted),
                          logprobs=lps, prompt_logprobs=prompt_lps)

    def migration_header(self) -> MigrationHeader:
        """What another decode worker needs besides its pages to continue it (`MigrationHeader`)."""
        return MigrationHeader(self.seq.num_tokens, tuple(self.tokens), self.detok.emitted, self.cached_tokens,
                               self.req.sampling, self.spec_proposed, self.spec_accepted)

    def scored(self) -> TokenChunk:
        """The one chunk of a request of max_tokens 0: its prompt scored (echo), nothing generated."""
        req = self.req
        return TokenChunk(req.request_id, (), "", finish_reason="length",
                          prompt_logprobs=tuple(self.prompt_lps) if req.prompt_logprobs is not None else None,
                          usage=Usage(len(req.prompt_ids), 0, self.cached_tokens),
                          logprobs=None if req.logprobs is None else ())


@dataclass(frozen=True)
class Planned:
    """One step's forward: the batch, owners[i] = (request, whether segment i yields a token), and
    pending[i] its speculative step (None: a plain segment; empty without speculation)."""

    batch: ForwardBatch
    owners: list[tuple[Running, bool]]
    pending: tuple[speculation.Pending | None, ...] = ()
