"""Token sampling as a pure function of (logits, seed, position) — invariant 1.

No hidden RNG state: the noise for a request's token at position p is drawn from a generator
seeded with (seed, p) alone, so the same request samples the same tokens whatever batch,
worker, migration or retry produced its logits. Sampling uses the Gumbel-max trick over the
temperature-scaled, top-k / top-p filtered logits; temperature 0 is greedy (argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment: decorrelates consecutive positions
_MASK64 = (1 << 63) - 1


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


def _generator(seed: int, position: int) -> torch.Generator:
    key = (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    return torch.Generator().manual_seed(key)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [V] with everything outside top-k / top-p set to -inf."""
    scaled = logits.float() / params.temperature
    if params.top_k and params.top_k < scaled.numel():
        kth = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        scaled = scaled.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    return scaled


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Next token for one request: logits [V] (any device) → token id."""
    if params.greedy:
        return int(logits.argmax())
    scaled = filter_logits(logits.detach().cpu(), params)
    u = torch.rand(scaled.shape, generator=_generator(params.seed, position), dtype=torch.float64)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
    return int((scaled.double() + gumbel).argmax())


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """logits [B, V] → B tokens; row i uses (params[i], positions[i])."""
    return [sample(logits[i], p, pos) for i, (p, pos) in enumerate(zip(params, positions))]
