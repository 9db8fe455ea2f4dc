"""Token sampling as a pure function of (logits, seed, position) — invariant 1.

(With a grammar, also of the request's output so far: its token mask, `model/grammar.py`.)

No hidden RNG state: the noise for token t of a request at position p is a hash of
(seed, p, t) alone, so the same request samples the same tokens whatever batch, worker,
migration or retry produced its logits. Sampling uses the Gumbel-max trick over the
temperature-scaled, top-k / top-p filtered logits; temperature 0 is greedy (argmax).

Everything runs on the logits' device, a whole batch at once, and only the chosen ids come back
to the host: a decode step at batch 256 copies 2 KB instead of its 132 MB of fp32 logits. The
noise is exact 32-bit integer hashing (`model/kernels/common/gumbel.py`, which also holds the draw's
kernel), so it gives the same bits on every device; each row is filtered and drawn on its own,
so its token does not depend on the other rows of the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from model.batch import host_to_device, to_device
from model.kernels.common import gumbel
from model.kernels.common.gumbel import gumbel_argmax, kept
from model.penalties import MAX_LOGIT_BIAS, History, adjust

_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment: decorrelates consecutive positions
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int = 0
    # logit adjustments (model/penalties.py); neutral by default
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct
    min_tokens: int = 0
    min_p: float = 0.0  # keep tokens of probability >= min_p x the top token's (after temperature); 0 = off

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, each in [-100, 100]")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token twice")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def unadjusted(self) -> SamplingParams:
        """The same draw without the logit adjustments (what a speculative draft proposes with)."""
        return replace(self, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=(),
                       min_tokens=0)

    @property
    def adjusts(self) -> bool:
        """Whether its logits are adjusted before sampling (penalties, logit_bias, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)


def _row_key(seed: int, position: int) -> tuple[int, int, int]:
    """Three 32-bit words keying one (seed, position)'s noise; splitmix64 on the host, exact."""
    z = (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & 0xFFFFFFFF, z >> 32, (z & 0xFFFFFFFF) ^ 0x9E3779B9


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                impl: str | None = None, histories: list[History | None] | None = None,
                masks: torch.Tensor | None = None) -> list[int]:
    """Next token of each row: logits [R, V] (any float dtype, any device) → R token ids; row i
    uses (params[i], positions[i]) and, when its params adjust the logits, histories[i] (its
    prompt and output so far: `model/penalties.py`). `masks`: the tokens each row may take, as
    bits [R, ceil(V/32)] int32 (a grammar's, `model/grammar.py`); applied after the adjustments.
    One copy to the host, of the R ids. `impl` picks the draw's kernel ("torch" reference or
    "triton"); by default Triton on a GPU, torch elsewhere."""
    return draw_rows(logits, params, positions, impl, histories, masks).tolist()


def draw_rows(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
              impl: str | None = None, histories: list[History | None] | None = None,
              masks: torch.Tensor | None = None) -> torch.Tensor:
    """`sample_rows` without the copy to the host: the ids [R] int64 on the logits' device, queued
    behind the logits without waiting for them (the per-row parameters go over asynchronously),
    so a step fed with them can be queued before they are known on the host."""
    impl = impl or ("triton" if logits.is_cuda else "torch")
    rows = len(params)
    assert logits.dim() == 2 and logits.shape[0] == rows == len(positions), (logits.shape, rows)
    logits = adjust(logits, params, histories if histories is not None else [None] * rows)
    if masks is not None:
        logits = apply_bitmask(logits, masks)
    if all(p.top_p == 1 and not 0 < p.top_k < logits.shape[-1] for p in params):
        return _draw_unfiltered(logits, params, positions, impl)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if len(drawn) == rows:
        return _draw(logits, params, positions, impl)
    tokens = logits.argmax(-1)  # first maximum on every device: the greedy rows' answer
    if drawn:
        tokens[to_device(drawn, tokens.device)] = _draw(logits[drawn], [params[i] for i in drawn],
                                                  [positions[i] for i in drawn], impl)
    return tokens


def apply_bitmask(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with every token whose bit is 0 in masks [R, ceil(V/32)] int32 set to -inf
    (a new tensor, on the logits' device; a fixed number of ops, whatever the rows)."""
    rows, vocab = logits.shape
    if masks.shape != (rows, (vocab + 31) // 32) or masks.dtype != torch.int32:
        raise ValueError(f"a token mask for logits {tuple(logits.shape)} is int32 [{rows}, {(vocab + 31) // 32}], "
                         f"got {masks.dtype} {tuple(masks.shape)}")
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((masks.to(logits.device)[:, :, None] >> shifts) & 1).view(rows, -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def sample(logits: torch.Tensor, params: SamplingParams, position: int, impl: str | None = None,
           history: History | None = None) -> int:
    """Next token for one request: logits [V] (any device) → token id."""
    return sample_rows(logits[None], [params], [position], impl, [history])[0]


def _support(logits: torch.Tensor, params: list[SamplingParams]):
    """Each row's logits [R, V] temperature-scaled (fp32), and its min-p / top-k / top-p support
    as a threshold in the ranking by (value descending, id ascending): (scaled, thr_value [R] fp32,
    thr_id [R] int64); see `gumbel.kept`. As vLLM: min_p first (a token stays if its scaled
    logit is at least the row's largest + log(min_p), i.e. its probability at least min_p × the
    top one's), then top-k, then top-p over what is left. Rows without any keep everything: when
    no row has top-k or top-p, nothing is sorted."""
    dev, (rows, vocab) = logits.device, logits.shape
    temperature = to_device([p.temperature for p in params], dev, torch.float32)
    scaled = logits.float() / temperature[:, None]
    # min_p's threshold on the scaled logits (-inf: off); log(min_p) is rounded once, on the host
    floor = scaled.amax(-1) + to_device([math.log(p.min_p) if p.min_p > 0 else float("-inf") for p in params],
                                        dev, torch.float32)
    if all(p.top_p == 1 and not 0 < p.top_k < vocab for p in params):
        return scaled, floor, torch.full((rows,), vocab, device=dev)
    # A stable descending sort ranks ties by token id, so "the k best" names the same k tokens
    # in every batch, and the support is a prefix of the ranking in every row.
    ranked, order = scaled.sort(dim=-1, descending=True, stable=True)
    k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dev, torch.int64)
    keep = (torch.arange(vocab, device=dev) < k[:, None]) & (ranked >= floor[:, None])
    if any(p.top_p < 1 for p in params):
        top_p = to_device([p.top_p for p in params], dev, torch.float32)
        # The smallest prefix whose mass reaches top_p, the token crossing it included. In fp64:
        # an fp32 cumsum over 129K tokens rounds differently on a GPU (a parallel scan) and a CPU,
        # enough to move the cut by a token; fp64 leaves only ulp-level ties to chance.
        probs = ranked.double().masked_fill(~keep, float("-inf")).softmax(-1)
        beyond = (probs.cumsum(-1) - probs) >= top_p[:, None]
        keep &= ~(beyond & (top_p < 1)[:, None])  # rounding must not cut a top_p = 1 row
    last = keep.sum(-1, keepdim=True) - 1  # the support is a prefix: its last rank
    return scaled, ranked.gather(-1, last).squeeze(-1), order.gather(-1, last).squeeze(-1)


def _draw(logits: torch.Tensor, params: list[SamplingParams], positions: list[int], impl: str) -> torch.Tensor:
    """Gumbel-max over each row's support: logits [R, V] → ids [R] (int64)."""
    scaled, thr_value, thr_id = _support(logits, params)
    keys = to_device([_row_key(p.seed, pos) for p, pos in zip(params, positions)], logits.device, torch.int64)
    return gumbel_argmax(scaled, keys, thr_value, thr_id, impl)


def _draw_unfiltered(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                     impl: str) -> torch.Tensor:
    """Rows without top-k or top-p, greedy or not, in one `gumbel.draw`, their inputs in one copy."""
    parts = _input_parts(len(params), 1)
    host = torch.empty(_nbytes(parts), dtype=torch.uint8)
    _fill(_split(host, parts), params, [[pos] for pos in positions], 0)
    keys, temperature, log_min_p, greedy = _split(host_to_device(host, logits.device), parts)
    return gumbel.draw(logits, temperature, log_min_p, greedy, keys[:, 0], impl)


def _input_parts(rows: int, span: int) -> tuple[tuple[torch.dtype, tuple[int, ...]], ...]:
    """The per-row draw inputs in one byte buffer, so that loading them is one copy: the noise keys
    of `span` positions (int64 [rows, span, 3]), temperature and log(min_p) (fp32 [rows] each),
    greedy (bool [rows]); each part aligned for its dtype."""
    return ((torch.int64, (rows, span, 3)), (torch.float32, (rows,)), (torch.float32, (rows,)),
            (torch.bool, (rows,)))


def _nbytes(parts) -> int:
    return sum(dtype.itemsize * math.prod(shape) for dtype, shape in parts)


def _split(buffer: torch.Tensor, parts) -> list[torch.Tensor]:
    """Typed views of `buffer` (uint8) laid out as `parts`."""
    out, at = [], 0
    for dtype, shape in parts:
        n = dtype.itemsize * math.prod(shape)
        out.append(buffer[at:at + n].view(dtype).view(shape))
        at += n
    return out


def _fill(views: list[torch.Tensor], params: list[SamplingParams], positions: list[list[int]], pad: int) -> None:
    """Host `views` (`_split` of `_input_parts`) for rows drawing with params[r] at positions[r],
    then `pad` greedy padding rows (temperature 1, min_p off). A greedy row's temperature is 1, so
    the draw's scaled logits are its logits."""
    keys, temperature, log_min_p, greedy = views
    if params:
        keys[: len(params), : len(positions[0])] = torch.tensor(
            [[_row_key(p.seed, pos) for pos in row] for p, row in zip(params, positions)])
    temperature[:] = torch.tensor([1.0 if p.greedy else p.temperature for p in params] + [1.0] * pad)
    log_min_p[:] = torch.tensor([math.log(p.min_p) if p.min_p > 0 else float("-inf") for p in params]
                                + [float("-inf")] * pad)
    greedy[:] = torch.tensor([p.greedy for p in params] + [True] * pad)


def support(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Bool [R, V]: the tokens `sample_rows` may draw from logits [R, V] (a greedy row: its argmax)."""
    greedy = torch.arange(logits.shape[-1], device=logits.device) == logits.argmax(-1, keepdim=True)
    drawn = torch.tensor([not p.greedy for p in params], device=logits.device)[:, None]
    keep = kept(*_support(logits, [p if not p.greedy else SamplingParams(1.0) for p in params]))
    return torch.where(drawn, keep, greedy)


class DrawInputs:
    """`draw_rows` of up to `rows` rows from device tensors a CUDA graph was captured on: it
    draws `steps` tokens a row in one replay (the drafts of a speculative step,
    `model.cuda_graph.DecodeGraph` with `chain`), each row's parameters and noise keys loaded
    before the replay in one copy. The math is `draw_rows`' (temperature, min_p, Gumbel-max
    keyed by seed and position; greedy rows take the argmax), so a row draws the same token here
    as there. Only rows `capturable` can be loaded: top-k and top-p need a sort whose use depends
    on the batch, and logit adjustments need the host.

    `span` > `steps`: a row's positions may be known on the device only (a speculative step
    queued before the host knows how many drafts the one before kept): `load` then takes `span`
    candidate positions a row and, on the device, the offset of the first one each row draws at."""

    def __init__(self, rows: int, steps: int, vocab: int, device: torch.device, span: int | None = None):
        self.rows, self.steps, self.vocab = rows, steps, vocab
        self.span = span = steps if span is None else span
        if span < steps:
            raise ValueError(f"a draw of {steps} steps a row needs at least {steps} candidate positions, got {span}")
        # every per-row input in one buffer (`_input_parts`, keys of the candidate positions), so a
        # load is one copy; the same layout in page-locked host memory, which the copy reads
        # asynchronously
        parts = _input_parts(rows, span)
        pinned = torch.device(device).type == "cuda"
        self._host = torch.empty(_nbytes(parts), dtype=torch.uint8, pin_memory=pinned)
        self._device = torch.empty(_nbytes(parts), dtype=torch.uint8, device=device)
        self._host_views = _split(self._host, parts)
        self.candidates, self.temperature, self.log_min_p, self.greedy = _split(self._device, parts)
        # the keys the draws read: the first `steps` candidates, or those from a row's offset on
        self.keys = self.candidates if span == steps else torch.zeros(rows, steps, 3, dtype=torch.int64, device=device)
        self._steps = torch.arange(steps, device=device)
        self._copied = torch.cuda.Event() if pinned else None  # the last copy out of the host buffer
        if self._copied is not None:
            self._copied.record()
        self.load([], [])  # padding rows everywhere: greedy, temperature 1, min_p off

    def capturable(self, params: list[SamplingParams]) -> bool:
        return len(params) <= self.rows and all(
            not p.adjusts and p.top_p == 1 and not 0 < p.top_k < self.vocab for p in params)

    def load(self, params: list[SamplingParams], positions: list[list[int]], offsets: torch.Tensor | None = None
             ) -> None:
        """Row r draws its step k with params[r] at positions[r][k] (padding rows: greedy). With
        `offsets` [len(params)] (int64, on the device): positions[r] holds `span` candidates and
        step k draws at positions[r][offsets[r] + k] (offsets[r] + steps <= span)."""
        width = self.steps if offsets is None else self.span
        if not self.capturable(params) or any(len(p) != width for p in positions):
            raise ValueError(f"DrawInputs of {self.rows} rows × {self.steps} steps take rows without top-k, "
                             f"top-p or logit adjustments, {width} positions each")
        if offsets is not None and self.span == self.steps:
            raise ValueError("DrawInputs built without a span past its steps take no offsets")
        pad = self.rows - len(params)
        if self._copied is not None:  # the last copy has read the host buffer: it may be rewritten
            self._copied.synchronize()
        _fill(self._host_views, params, positions, pad)
        self._device.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if self.keys is self.candidates:
            return
        if offsets is None:
            self.keys.copy_(self.candidates[:, : self.steps])
            return
        at = torch.zeros(self.rows, dtype=torch.int64, device=self.keys.device)
        at[: len(params)] = offsets
        index = (at[:, None] + self._steps)[:, :, None].expand(-1, -1, 3)
        torch.gather(self.candidates, 1, index, out=self.keys)

    def draw(self, logits: torch.Tensor, step: int, impl: str) -> torch.Tensor:
        """Step `step`'s tokens [n] int64 from logits [n, V], n <= rows: the first n rows loaded
        (captured: no host work)."""
        n = logits.shape[0]
        return gumbel.draw(logits, self.temperature[:n], self.log_min_p[:n], self.greedy[:n], self.keys[:n, step],
                           impl)
