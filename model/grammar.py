"""Grammar-constrained decoding: a request's output held to a grammar, token by token (llguidance).

A request carries its grammar as llguidance's input text (`GenerateRequest.grammar`): a Lark
grammar, which may embed JSON schemas as `%json{...}`, or the JSON form `grammar_from_json_schema`
returns. The router builds it (`router/response_format.py`) and checks it with `check`; each worker
compiles it against its vocabulary:

    grammars = Grammars(tokenizer, cfg.vocab_size, eos_id)   # once per worker
    grammars.prepare(text)                           # compile into the cache (in a thread: slow-ish)
    state = grammars.state(text, output_so_far)      # a request's matcher, replaying its output
    masks = grammars.bitmask([state, None, ...])     # [R, ceil(V/32)] int32, rows without: all ones
    tokens = sample_rows(logits, ..., masks=masks)   # model/sampling.py applies it on the device
    state.advance(token)

The grammar state is a function of the request's output tokens alone, so sampling stays a pure
function of (logits, seed, position, output so far): a worker that receives a request after a KV
hand-off or a migration rebuilds the state by replaying the output (`state(text, tokens)`).

EOS is allowed exactly where the grammar may end; once the grammar is complete (`done`) only EOS
is, and the request ends there ("stop"). Compiling is lazy in llguidance (about 2 ms for a typical
schema at V4's 129K vocabulary, `benchmarks/research/grammar_backend_probe.py`); the vocabulary's
index is built once per worker on first use (about 1 s at 129K). Compiled grammars are cached by
their text; each request's state is a copy of the cached matcher.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.torch as llt
import torch

# compact JSON: what a JSON schema's grammar lets through between tokens (no free whitespace,
# which a random or weak model would otherwise fill without end)
JSON_OPTIONS = {"whitespace_flexible": False}
CACHE_SIZE = 64


class GrammarError(ValueError):
    """A grammar that does not compile, or an output token the grammar does not allow."""


def from_json_schema(schema: dict) -> str:
    """llguidance's grammar text for output that is JSON valid against `schema`."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def from_lark(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


def check(grammar: str) -> None:
    """Raises GrammarError naming the problem when `grammar` does not compile (no vocabulary needed)."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise GrammarError(error.strip())


class CheckedGrammars:
    """`check` with its verdicts remembered by grammar text (the last `size`): clients send the same
    schema or tools with every request, and checking one costs milliseconds."""

    def __init__(self, size: int = CACHE_SIZE):
        self.size = size
        self._verdicts: OrderedDict[str, str] = OrderedDict()  # grammar → "" (fine) or why not
        self._lock = threading.Lock()

    def check(self, grammar: str) -> None:
        with self._lock:
            verdict = self._verdicts.get(grammar)
            if verdict is not None:
                self._verdicts.move_to_end(grammar)
        if verdict is None:
            try:
                check(grammar)
                verdict = ""
            except GrammarError as e:
                verdict = str(e)
            with self._lock:
                self._verdicts[grammar] = verdict
                while len(self._verdicts) > self.size:
                    self._verdicts.popitem(last=False)
        if verdict:
            raise GrammarError(verdict)


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} is not allowed by the request's grammar: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete (its EOS consumed, or nothing more may follow)."""
        return self.matcher.is_stopped()


class Grammars:
    """A worker's grammar compiler: its vocabulary as llguidance indexes it, and compiled grammars
    by text. `prepare` may run in a thread while the worker's loop calls `state` and `bitmask`."""

    def __init__(self, tokenizer, vocab_size: int, eos_id: int | None, cache_size: int = CACHE_SIZE):
        """`tokenizer`: a `model/tokenizer.py` tokenizer, or its `tokenizer.json` text; read on first
        use. `vocab_size`: the model's (its logits' width)."""
        self.vocab_size, self.cache_size = vocab_size, cache_size
        self._tokenizer, self._eos = tokenizer, eos_id
        self._vocab: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def _index(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._vocab is None:
                text = self._tokenizer if isinstance(self._tokenizer, str) else self._tokenizer.to_json()
                self._vocab = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self._eos)
                self._executor = llguidance.LLExecutor()
            return self._vocab

    def prepare(self, grammar: str) -> llguidance.LLMatcher:
        """The compiled grammar (its start state), compiled now unless cached. Raises GrammarError."""
        with self._lock:
            m = self._compiled.get(grammar)
            if m is not None:
                self._compiled.move_to_end(grammar)
                return m
        m = llguidance.LLMatcher(self._index(), grammar, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error().strip())
        with self._lock:
            self._compiled[grammar] = m
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return m

    def state(self, grammar: str, output: Sequence[int] = ()) -> GrammarState:
        """A request's grammar state after `output` (its tokens so far, replayed)."""
        s = GrammarState(self.prepare(grammar).deep_copy())
        for token in output:
            s.advance(token)
        return s

    def bitmask(self, states: Sequence[GrammarState | None], device: torch.device | str = "cpu"
                ) -> torch.Tensor | None:
        """Each row's allowed tokens as bits, [R, ceil(V/32)] int32 on `device` (a row without a
        grammar allows every token); None when no row has a grammar."""
        rows = [(s.matcher, i) for i, s in enumerate(states) if s is not None]
        if not rows:
            return None
        self._index()
        mask = torch.full(llt.get_bitmask_shape(len(states), self.vocab_size), -1, dtype=torch.int32)
        llt.fill_next_token_bitmask_par(self._executor, rows, mask)
        return mask.to(device, non_blocking=True)
