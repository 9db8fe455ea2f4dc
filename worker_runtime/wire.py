"""Wire types shared by the router and the workers (plain frozen dataclasses).

A request travels router → decode worker (→ prefill worker) as a `GenerateRequest`; tokens come
back as a stream of `TokenChunk`s, the last one carrying `finish_reason` (or `error`).
Every request has an explicit `RequestState`; every failure a client can see has a reason code.
"""

from __future__ import annotations

import enum
import hashlib
import json
import struct
from dataclasses import asdict, dataclass, field

from model.logprobs import TokenLogprobs
from model.sampling import SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"  # admitted, waiting for pages or a prefill slot
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"  # KV on its way from the prefill worker
    DECODING = "decoding"
    MIGRATING = "migrating"  # paused at a token boundary while its KV ships to another decode worker
    MIGRATED = "migrated"  # the other worker verified the KV and runs it now; nothing left here
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


class ErrorCode(enum.Enum):
    """Reason codes a client may see: (HTTP status, gRPC status name)."""

    INVALID_REQUEST = (400, "INVALID_ARGUMENT")
    UNAUTHENTICATED = (401, "UNAUTHENTICATED")
    MODEL_NOT_FOUND = (404, "NOT_FOUND")
    TOO_LARGE = (413, "INVALID_ARGUMENT")
    OVERLOADED = (429, "RESOURCE_EXHAUSTED")
    CANCELLED = (499, "CANCELLED")
    INTERNAL = (500, "INTERNAL")
    NO_WORKER = (503, "UNAVAILABLE")
    KV_TRANSFER_FAILED = (503, "UNAVAILABLE")
    DEADLINE_EXCEEDED = (504, "DEADLINE_EXCEEDED")

    @property
    def http_status(self) -> int:
        return self.value[0]

    @property
    def grpc_status(self) -> str:
        return self.value[1]


@dataclass(frozen=True)
class ErrorInfo:
    code: ErrorCode
    message: str


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    deadline: float | None = None  # unix seconds; None = no deadline
    router: str = ""  # id of the router streaming it, whose registry lease keeps it alive; "" = none
    logprobs: int | None = None  # None: none; k: each token's logprob and its top k (model/logprobs.py)
    # the grammar the output must match (llguidance's input: model/grammar.py); None: unconstrained
    grammar: str | None = None
    # output tokens generated before this attempt (a retry that recomputes them: they end its prompt),
    # replayed into its grammar state before its own output
    grammar_replay: tuple[int, ...] = ()
    # None: none; k: each prompt token's logprob (from the second on) and its top k, computed where the
    # prompt is prefilled (bypassing the prefix cache: cached positions have no logits)
    prompt_logprobs: int | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from a prefix cache
    # speculative decoding (`--speculative-tokens`): drafts its verify steps checked, and of them the
    # ones equal to the target's own token; carried across migrations
    spec_proposed: int = 0
    spec_accepted: int = 0


@dataclass(frozen=True)
class TransferStats:
    """How a request's KV reached its decode worker (on its first chunk; for the router's metrics)."""

    nbytes: int  # bytes received (0 when the transfer failed)
    seconds: float  # reservation → verified (or → failure)
    failure: str | None = None  # why the KV was recomputed locally instead: "corrupt", "expired", ...
    source: str = "prefill"  # "prefill" | "repull" (held KV of a lost decode worker) | "migration"
    # the transfer proper: the sender's first write posted (its Begin notice) → verified; `seconds`
    # also holds the wait for the prefill (0.0 when unknown)
    wire_seconds: float = 0.0


@dataclass(frozen=True)
class TargetReply:
    """A decode worker's answer to its prefill worker asking, as it is about to start a request
    that came without a target, where to write the KV: the decode worker reserves only then."""

    target: bytes | None  # the TransferTarget (kvtransfer/protocol.py) when it reserved
    refusal: str | None = None  # else "no_room" (ask again later) or "gone" (it no longer wants it)

    def __post_init__(self):
        if (self.target is None) == (self.refusal is None) or self.refusal not in (None, "no_room", "gone"):
            raise ValueError(f"a TargetReply carries a target or a refusal ('no_room' | 'gone'), got "
                             f"{self.target!r} / {self.refusal!r}")


@dataclass(frozen=True)
class Moved:
    """The request now runs on another decode worker: stream the rest from `worker_id` with
    `attach(request_id)`. Every token before this marker came from the old worker, every token
    after it comes from the new one, so the client's stream has no gap and no repeat."""

    worker_id: str
    request_id: str  # its id on that worker


@dataclass(frozen=True)
class TokenChunk:
    """New tokens of one request; `text` is their detokenised text (stop strings removed)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | None while streaming
    usage: Usage | None = None  # on the last chunk
    error: ErrorInfo | None = None  # terminal failure; finish_reason stays None
    transfer: TransferStats | None = None  # on the first chunk of a request that used remote prefill
    moved: Moved | None = None  # last chunk of a worker's stream when the request migrated away
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per token id, when the request asked
    # on the first chunk, when the request asked: prompt tokens 1.. (the first has no context)
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class WorkerLoad:
    """What a worker reports to the registry (the placement and autoscaling signals)."""

    worker_id: str
    role: str  # "prefill" | "decode"
    waiting: int = 0  # requests admitted but not yet running
    running: int = 0  # requests in the running batch
    queued_prefill_tokens: int = 0
    free_pages: int = 0
    total_pages: int = 0
    draining: bool = False


@dataclass(frozen=True)
class KVEvent:
    """Prefix-cache change on a prefill worker, by page hash (see `page_hashes`)."""

    worker_id: str
    kind: str  # "stored" | "evicted" | "cleared"
    page_hashes: tuple[int, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class StepShape:
    """What one rank of an expert-parallel group (`worker_runtime.ep_group`) needs of a step, and (taken
    as the maximum over the ranks) what every rank of the group runs: a step at all; the most
    decode rows of any rank; whether any rank needs the eager exact-split exchange (a prefill, a
    prompt chunk, or more rows than the largest CUDA graph). A step with `eager` 0 replays, on
    every rank, the decode graph of the smallest bucket that holds `rows` — captured with that
    fixed exchange capacity on every rank alike."""

    busy: int
    rows: int = 0
    eager: int = 1

    def as_list(self) -> list[int]:
        return [self.busy, self.rows, self.eager]


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str  # "prefill" | "decode"
    actor: str  # Ray actor name
    agent: str  # NIXL agent name
    epoch: str  # fresh per process start: a restarted worker is a new peer
    layout: str  # kvtransfer layout descriptor (json)
    metadata: bytes  # NIXL agent metadata
    load: WorkerLoad


@dataclass(frozen=True)
class TransferHeader:
    """Travels with the pages: what the receiver needs to resume the request."""

    num_tokens: int  # tokens whose KV the pages hold (the prompt)
    first_token: int  # sampled by the sender at position num_tokens
    computed_tokens: int  # prompt tokens the sender ran through its model (the rest were cached)
    first_logprobs: TokenLogprobs | None = None  # the first token's, when the request asked
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # prompt tokens 1.., when the request asked

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "TransferHeader":
        d = json.loads(data)

        def lp(x):
            return TokenLogprobs(x["token"], x["logprob"], tuple((int(t), float(v)) for t, v in x["top"]))
        first, prompt = d.pop("first_logprobs", None), d.pop("prompt_logprobs", None)
        return cls(**d, first_logprobs=None if first is None else lp(first),
                   prompt_logprobs=None if prompt is None else tuple(lp(x) for x in prompt))


@dataclass(frozen=True)
class MigrationHeader:
    """Travels with a migrated request's pages (in TransferDone): all the state it needs besides
    them. Sampling is a pure function of (logits, seed, position), so the sampling parameters and
    the token count are its whole sampling state: no RNG state moves."""

    num_tokens: int  # tokens whose KV the pages hold: prompt + generated - 1
    tokens: tuple[int, ...]  # generated so far; the last one is fed next
    emitted_chars: int  # characters of their text already released to the client
    cached_tokens: int  # prompt tokens served from a prefix cache (for usage)
    sampling: SamplingParams
    spec_proposed: int = 0  # its speculative drafts so far (for usage)
    spec_accepted: int = 0

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "MigrationHeader":
        d = json.loads(data)
        return cls(d["num_tokens"], tuple(d["tokens"]), d["emitted_chars"], d["cached_tokens"],
                   SamplingParams(**d["sampling"]), d.get("spec_proposed", 0), d.get("spec_accepted", 0))


def page_hashes(token_ids: list[int] | tuple[int, ...], page_size: int) -> list[int]:
    """Chained 63-bit hash of each *full* page of tokens: hash_i covers tokens [0, (i+1)·P).

    A prefix match at page i therefore implies the whole prefix matches. Router and prefill
    workers compute it identically, so cache hits can be predicted from KV events alone.
    """
    out, prev = [], b""
    for i in range(len(token_ids) // page_size):
        page = token_ids[i * page_size:(i + 1) * page_size]
        digest = hashlib.blake2b(prev + struct.pack(f"<{len(page)}i", *page), digest_size=8).digest()
        out.append(int.from_bytes(digest, "little") >> 1)
        prev = digest
    return out
