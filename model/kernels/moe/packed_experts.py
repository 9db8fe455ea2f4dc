"""The packed expert layout: E SwiGLU experts stacked and quantised as the MoE kernels read them.

`PackedExperts` owns the layout (FP4 K-blocked with shuffled words, or FP8 128×128 blocks) and its
conversions: from float experts, random codes for benchmarks, back to float, and a rank's slice.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model import low_precision
from model.kernels.common.fp4 import FP4_GROUP, FP8_BLOCK, fp4_k_block, shuffle_fp4_words
from model.kernels.gemm import fp8_gemm

FORMATS = ("fp4", "fp8")
MAX_SCALE_BYTE = {"fp4": 128, "fp8": 134}  # UE8M0 bytes the kernels dequantise exactly


class PackedExperts(nn.Module):
    """E experts stacked and quantised; w13 = [w1; w3] (gate rows, then up rows), D = dim, I = inter.

    fmt "fp4", K-blocked: a matrix of R rows × K (codes [R, K/2]: e2m1 pairs, low nibble first;
               scales [R, K/32]: UE8M0 per 32 along K) is stored K block by K block,
               codes [K/2/kb, R, kb] and scales [K/32/sb, R, sb], kb = `fp4_k_block(K/2)` (64 bytes,
               128 K, at V4 shapes), sb = kb/16: element [b, r, j] is byte b·kb + j of row r, the
               codes with the bits of each 4-byte group (rows r, r+8 of a 16-row block × bytes
               2p, 2p+1) permuted as the kernels read them (kernels/common/fp4.py's `shuffle_fp4_words`).
               w13 uint8 [E, D/2/kb13, 2I, kb13], w13_scale uint8 [E, D/32/sb13, 2I, sb13];
               w2 uint8 [E, I/2/kb2, D, kb2], w2_scale uint8 [E, I/32/sb2, D, sb2].
               Why: a kernel's K step over BN rows is then one contiguous read (BN·64 bytes) instead
               of BN reads of 64 bytes a row apart, which HBM serves well below copy bandwidth
               (benchmarks/research/fp4_layout_bench.py).
    fmt "fp8": w13 e4m3 [E, 2I, D], w13_scale uint8 [E, 2⌈I/128⌉, ⌈D/128⌉] (w1's blocks, then w3's);
               w2 e4m3 [E, D, I], w2_scale uint8 [E, ⌈D/128⌉, ⌈I/128⌉]
    Scales are UE8M0 bytes (scale = 2^(byte - 127)), as the official checkpoint stores them.
    """

    def __init__(self, fmt: str, n_experts: int, dim: int, inter: int, device: torch.device | str | None = None):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"packed expert format must be one of {FORMATS}, got {fmt!r}")
        if fmt == "fp4" and (dim % FP4_GROUP or inter % FP4_GROUP):
            raise ValueError(f"FP4 experts need hidden ({dim}) and intermediate ({inter}) sizes divisible by 32")
        self.fmt, self.n_experts, self.dim, self.inter = fmt, n_experts, dim, inter
        E, D, I = n_experts, dim, inter
        # code bytes per row in one K block of w13 and w2 (FP4)
        self.kb13, self.kb2 = (fp4_k_block(D // 2), fp4_k_block(I // 2)) if fmt == "fp4" else (0, 0)
        if fmt == "fp4":
            kb13, kb2 = self.kb13, self.kb2
            shapes = [(E, D // 2 // kb13, 2 * I, kb13), (E, D // 2 // kb13, 2 * I, kb13 // 16),
                      (E, I // 2 // kb2, D, kb2), (E, I // 2 // kb2, D, kb2 // 16)]
            dtypes = [torch.uint8] * 4
        else:
            ib, db = math.ceil(I / FP8_BLOCK), math.ceil(D / FP8_BLOCK)
            shapes = [(E, 2 * I, D), (E, 2 * ib, db), (E, D, I), (E, db, ib)]
            dtypes = [torch.float8_e4m3fn, torch.uint8] * 2
        for name, shape, dtype in zip(("w13", "w13_scale", "w2", "w2_scale"), shapes, dtypes):
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
        if fmt == "fp8" and n_experts == 1:  # a shared expert: split-K counters of its dense decode
            # products (kernels/moe/moe_shared.py), left zeroed by every product
            self.register_buffer("arrivals", fp8_gemm.arrival_counters(max(2 * I, D), device), persistent=False)
        # kernels/moe/moe_grouped.py's `_operand_checked` verdicts, per kernel configuration
        self.operand_checks: dict[tuple, bool] = {}

    @classmethod
    @torch.no_grad()
    def from_float(cls, experts: list[nn.Module], fmt: str) -> "PackedExperts":
        """Quantise float experts (`nn.Linear` w1, w2, w3 each) with the checkpoint's codecs (w1 and w3
        quantised separately)."""
        w = experts[0].w1.weight
        packed = cls(fmt, len(experts), w.shape[1], w.shape[0], w.device)
        for e, ex in enumerate(experts):
            q1, s1 = _quantize(ex.w1.weight, fmt)
            q3, s3 = _quantize(ex.w3.weight, fmt)
            q2, s2 = _quantize(ex.w2.weight, fmt)
            q13, s13 = torch.cat([q1, q3]), torch.cat([s1, s3])
            if fmt == "fp4":
                (q13, s13), (q2, s2) = _k_blocked(q13, s13, packed.kb13), _k_blocked(q2, s2, packed.kb2)
            packed.w13[e], packed.w13_scale[e] = q13, s13
            packed.w2[e], packed.w2_scale[e] = q2, s2
        # the kernels' bf16 dequantisation is exact up to these scales (kernels/common/fp4.py)
        top, limit = int(max(packed.w13_scale.max(), packed.w2_scale.max())), MAX_SCALE_BYTE[fmt]
        if top > limit:
            raise ValueError(f"{fmt} expert weights need a scale of 2^{top - 127}; the kernels support up to "
                             f"2^{limit - 127} (weights beyond ±{low_precision.FP4_MAX if fmt == 'fp4' else low_precision.FP8_MAX:g}"
                             f"·2^{limit - 127})")
        return packed

    @classmethod
    def random(cls, fmt: str, n_experts: int, dim: int, inter: int, device: torch.device | str,
               generator: torch.Generator | None) -> "PackedExperts":
        """Uniformly random codes with scales giving the weights an rms of about 1/sqrt(K) (unit-scale
        outputs for unit-scale inputs), made on `device` directly: no float copy of the experts exists."""
        p = cls(fmt, n_experts, dim, inter, device)
        for w, s, k in ((p.w13, p.w13_scale, dim), (p.w2, p.w2_scale, inter)):
            byte = w.view(torch.uint8)
            byte.random_(0, 256, generator=generator)
            if fmt == "fp8":  # keep sign and mantissa, exponent field 4..10: values ±2^-3..2^3·1.x, never NaN
                byte.copy_((byte & 0x87) | (((byte >> 3) % 7 + 4) << 3))
            exp = math.floor(math.log2(1 / (_code_rms(fmt) * math.sqrt(k))))
            s.random_(127 + exp, 127 + exp + 2, generator=generator)
        return p

    def dequantize(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e → float32 (w1 [I, D], w3 [I, D], w2 [D, I])."""
        I = self.inter
        if self.fmt == "fp4":
            w13 = low_precision.fp4_dequantize_weight(*_k_unblocked(self.w13[e], self.w13_scale[e]), FP4_GROUP)
            w2 = low_precision.fp4_dequantize_weight(*_k_unblocked(self.w2[e], self.w2_scale[e]), FP4_GROUP)
            return w13[:I], w13[I:], w2
        ib = math.ceil(I / FP8_BLOCK)
        w1 = low_precision.fp8_dequantize_weight(self.w13[e, :I], self.w13_scale[e, :ib], FP8_BLOCK)
        w3 = low_precision.fp8_dequantize_weight(self.w13[e, I:], self.w13_scale[e, ib:], FP8_BLOCK)
        return w1, w3, low_precision.fp8_dequantize_weight(self.w2[e], self.w2_scale[e], FP8_BLOCK)

    def narrow(self, start: int, length: int) -> "PackedExperts":
        """Experts [start, start + length) as views (an expert-parallel rank's slice)."""
        out = PackedExperts(self.fmt, length, self.dim, self.inter, device="meta")
        for name, buf in self.named_buffers():
            setattr(out, name, buf.narrow(0, start, length))
        return out

    def extra_repr(self) -> str:
        return f"fmt={self.fmt}, n_experts={self.n_experts}, dim={self.dim}, inter={self.inter}"


def _code_rms(fmt: str) -> float:
    """Rms of the values `PackedExperts.random` draws codes from (before scaling)."""
    if fmt == "fp4":
        return math.sqrt(sum(v * v for v in low_precision.E2M1_VALUES) / 16)
    byte = torch.arange(256, dtype=torch.uint8)
    values = ((byte & 0x87) | (((byte >> 3) % 7 + 4) << 3)).view(torch.float8_e4m3fn).float()
    return float(values.square().mean().sqrt())


def _k_blocked(codes: torch.Tensor, scales: torch.Tensor, kb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 codes [R, K/2] and scales [R, K/32] → `PackedExperts`' K-blocked [K/2/kb, R, kb] (words
    shuffled) and [K/32/sb, R, sb] (sb = kb/16), contiguous."""
    return (shuffle_fp4_words(codes.unflatten(-1, (-1, kb)).transpose(0, 1)),
            scales.unflatten(-1, (-1, kb // 16)).transpose(0, 1).contiguous())


def _k_unblocked(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_k_blocked`'s inverse: → codes [R, K/2], scales [R, K/32]."""
    return (shuffle_fp4_words(codes, inverse=True).transpose(0, 1).flatten(1),
            scales.transpose(0, 1).flatten(1))


def _quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "fp4":
        q, s = low_precision.fp4_quantize_weight(w, FP4_GROUP)
        return q.view(torch.uint8), s.view(torch.uint8)
    q, s = low_precision.fp8_quantize_weight(w, FP8_BLOCK)
    return q, s.view(torch.uint8)
