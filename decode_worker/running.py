"""A request's record on the decode worker (`Running`) and one planned step (`Planned`), shared by
the engine (`decode_worker/engine.py`), its speculative steps and the migration out."""

from __future__ import annotations

from dataclasses import dataclass, field

from model import speculation
from model.batch import ForwardBatch
from model.detokenizer import Detokenizer
from model.grammar import GrammarState
from model.kv_pool import SeqKV
from model.logprobs import TokenLogprobs
from worker_runtime.wire import GenerateRequest, RequestState


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

    @property
    def wants_prompt_rows(self) -> bool:
        """Whether its prompt chunk in this step needs the logits at every row (prompt logprobs)."""
        return self.state is RequestState.PREFILLING and self.req.prompt_logprobs is not None


@dataclass(frozen=True)
class Planned:
    """One step's forward: the batch, owners[i] = (request, whether segment i yields a token), and
    pending[i] its speculative step (None: a plain segment; empty without speculation)."""

    batch: ForwardBatch
    owners: list[tuple[Running, bool]]
    pending: tuple[speculation.Pending | None, ...] = ()
