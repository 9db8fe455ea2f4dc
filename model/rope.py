"""Partial, interleaved rotary embedding of DeepSeek-V4.

RoPE rotates only the trailing `qk_rope_head_dim` (r) channels of a head, pairing consecutive
channels (2i, 2i+1). Two tables exist: `main` (theta = rope_theta, no scaling) for
sliding-window-only layers and `compress` (theta = compress_rope_theta, YaRN when configured) for
compressed layers, their compressors and the indexer. YaRN's magnitude correction is not applied
(the reference multiplies cos/sin by 1), only the frequency ramp.
"""

from __future__ import annotations

import math

import torch

from model.config import ModelConfig, YarnScaling


def inv_freq(dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """[dim/2] float32 inverse frequencies, YaRN-interpolated when `yarn` is given."""
    # on the CPU explicitly: a model built under `torch.device("meta")` still needs real tables
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    if yarn is None:
        return freqs

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return freqs / yarn.factor * (1 - extrapolation) + freqs * extrapolation


class Rope:
    """cos/sin lookup for one table; `apply` rotates the trailing r channels of x [..., H?, d]."""

    def __init__(self, dim: int, theta: float, yarn: YarnScaling | None):
        self.dim = dim
        self.inv_freq = inv_freq(dim, theta, yarn)
        self._on_device = {self.inv_freq.device: self.inv_freq}  # copies made once per device

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """[r/2] float32 on `device` (cached: no host→device copy per call, graph-capturable)."""
        device = torch.device(device)
        if device not in self._on_device:
            self._on_device[device] = self.inv_freq.to(device)
        return self._on_device[device]

    @classmethod
    def for_layer(cls, cfg: ModelConfig, compressed: bool) -> "Rope":
        if compressed:
            return cls(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)
        return cls(cfg.qk_rope_head_dim, cfg.rope_theta, None)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] → cos, sin [T, r/2] float32."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq_on(positions.device)
        return freqs.cos(), freqs.sin()

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate x [T, ..., d] at `positions` [T]; `inverse` rotates by -position (de-rotation)."""
        cos, sin = self.cos_sin(positions)
        if inverse:
            sin = -sin
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (self.dim // 2,)
        cos, sin = cos.view(shape), sin.view(shape)
        nope, rope = x[..., : -self.dim], x[..., -self.dim:].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
