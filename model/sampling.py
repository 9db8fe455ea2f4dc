"""Token sampling as a pure function of (logits, seed, position) — invariant 1.

No hidden RNG state: the noise for token t of a request at position p is a hash of
(seed, p, t) alone, so the same request samples the same tokens whatever batch, worker,
migration or retry produced its logits. Sampling uses the Gumbel-max trick over the
temperature-scaled, top-k / top-p filtered logits; temperature 0 is greedy (argmax).

Everything runs on the logits' device, a whole batch at once, and only the chosen ids come back
to the host: a decode step at batch 256 copies 2 KB instead of its 132 MB of fp32 logits. The
hash is integer arithmetic that never overflows int64, so it gives the same bits on every
device; each row is filtered and drawn on its own, so its token does not depend on the other
rows of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment: decorrelates consecutive positions
_MASK64 = (1 << 64) - 1
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _row_key(seed: int, position: int) -> tuple[int, int, int]:
    """Three 32-bit words keying one (seed, position)'s noise; splitmix64 on the host, exact."""
    z = (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & _MASK32, z >> 32, (z & _MASK32) ^ 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x · c) mod 2³² for 0 ≤ x < 2³², in 16-bit halves so no int64 product overflows."""
    return (((((x >> 16) * c) & 0xFFFF) << 16) + (x & 0xFFFF) * c) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons): a 32-bit integer finaliser with good avalanche, on int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """U(0, 1) float64 [R, N] for token ids `tokens` [R, N] of rows keyed by `keys` [R, 3] (int64
    words of `_row_key`); 53 random bits, never 0 or 1."""
    k0, k1, k2 = (keys[:, i, None] for i in range(3))
    a = _hash32(_hash32(tokens ^ k0) ^ k1)
    b = _hash32(a ^ k2)
    return ((a >> 5) * 67108864 + (b >> 6)).double().add_(0.5).mul_(2.0 ** -53)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """Next token of each row: logits [R, V] (any float dtype, any device) → R token ids; row i
    uses (params[i], positions[i]). One copy to the host, of the R ids."""
    rows = len(params)
    assert logits.dim() == 2 and logits.shape[0] == rows == len(positions), (logits.shape, rows)
    tokens = logits.argmax(-1)  # first maximum on every device: the greedy rows' answer
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        tokens[drawn] = _draw(logits[drawn], [params[i] for i in drawn], [positions[i] for i in drawn])
    return tokens.tolist()


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Next token for one request: logits [V] (any device) → token id."""
    return sample_rows(logits[None], [params], [position])[0]


def _ranked_support(logits: torch.Tensor, params: list[SamplingParams]):
    """Each row's logits [R, V] temperature-scaled and ranked, with its top-k / top-p support:
    (ranked [R, V] fp32, order [R, V] token ids, keep [R, V] bool). Rows without top-k or
    top-p need no ranking: when no row has either, `order` is the identity and nothing is sorted."""
    dev, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=dev)
    scaled = logits.float() / temperature[:, None]
    if all(p.top_p == 1 and not 0 < p.top_k < vocab for p in params):
        everything = torch.ones_like(scaled, dtype=torch.bool)
        return scaled, torch.arange(vocab, device=dev).expand_as(scaled), everything
    # A stable descending sort ranks ties by token id, so "the k best" names the same k tokens
    # in every batch, and the support is a prefix of the ranking in every row.
    ranked, order = scaled.sort(dim=-1, descending=True, stable=True)
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
    keep = torch.arange(vocab, device=dev) < k[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    if any(p.top_p < 1 for p in params):
        probs = ranked.masked_fill(~keep, float("-inf")).softmax(-1)
        # the smallest prefix whose mass reaches top_p, the token crossing it included
        beyond = (probs.cumsum(-1) - probs) >= top_p[:, None]
        keep &= ~(beyond & (top_p < 1)[:, None])  # rounding must not cut a top_p = 1 row
    return ranked, order, keep


def _draw(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    """Gumbel-max over each row's support: logits [R, V] → ids [R] (int64). The noise is drawn
    for token ids, not ranks, so a token's noise does not depend on the ranking."""
    ranked, order, keep = _ranked_support(logits, params)
    keys = torch.tensor([_row_key(p.seed, pos) for p, pos in zip(params, positions)], device=logits.device)
    gumbel = -torch.log(-torch.log(uniform_noise(keys, order)))
    pick = (ranked.double() + gumbel).masked_fill_(~keep, float("-inf")).argmax(-1)
    return order.gather(-1, pick[:, None]).squeeze(-1)


def support(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Bool [R, V]: the tokens `sample_rows` may draw from logits [R, V] (a greedy row: its argmax)."""
    greedy = torch.arange(logits.shape[-1], device=logits.device) == logits.argmax(-1, keepdim=True)
    _, order, keep = _ranked_support(logits, [p if not p.greedy else SamplingParams(1.0) for p in params])
    drawn = torch.tensor([not p.greedy for p in params], device=logits.device)[:, None]
    return torch.where(drawn, torch.zeros_like(keep).scatter(-1, order, keep), greedy)
