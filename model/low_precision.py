"""Low-precision codecs of DeepSeek-V4: weights (checkpoint) and KV entries (cache pools).

* FP8 e4m3 with UE8M0 (power-of-two) scales: dense weights in 128×128 blocks, KV "nope" dims in
  blocks of 64 along the feature axis (the official QAT simulation, `act_quant(kv[..., :-rd], 64)`).
* FP4 e2m1 with UE8M0 scales per 32 along K: routed-expert weights, two values per byte,
  low nibble first.
* The KV entry pack (`NopeFp8RopeBf16Pack`): per entry `nope` FP8 bytes, `rope` BF16 values,
  one UE8M0 byte per 64 nope dims, zero padding to a multiple of 8 bytes. For V4 (d=512, r=64):
  448 + 128 + 7 + 1 = 584 bytes.
* The indexer key pack: `index_head_dim` FP8 bytes + one FP32 scale (amax / 448): 132 bytes.

All functions are pure torch and run on CPU and CUDA alike.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
# Smallest amax the official kernels quantise with; keeps the scale finite for all-zero blocks.
AMAX_FLOOR = 1e-4
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
KV_SCALE_BLOCK = 64


# ---------------------------------------------------------------------------------------
# UE8M0 scales
# ---------------------------------------------------------------------------------------

def ue8m0_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """Power-of-two scale `2^ceil(log2(amax / fmax))` (float32), as the official kernels round it:
    from the bits of the quotient (its exponent, plus one unless the mantissa is zero), which is
    exact where a float log2 rounds a quotient just above a power of two down to it."""
    bits = (amax.float().clamp_min(AMAX_FLOOR) / fmax).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    # into a fresh tensor: the shift of an empty [0, 1] operand comes out with a last stride of 0,
    # which callers viewing the scales as bytes (EP dispatch of no rows) cannot take
    out = torch.empty(amax.shape, dtype=torch.int32, device=amax.device)
    return torch.bitwise_left_shift(exponent, 23, out=out).view(torch.float32)


def scale_to_ue8m0_byte(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scale → biased exponent byte (uint8)."""
    return (torch.log2(scale).round() + 127).to(torch.uint8)


def ue8m0_byte_to_scale(byte: torch.Tensor) -> torch.Tensor:
    return torch.exp2(byte.float() - 127.0)


# ---------------------------------------------------------------------------------------
# FP8 activations / KV (blocks along the last axis)
# ---------------------------------------------------------------------------------------

def fp8_quantize_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (n % block == 0) → (e4m3 [..., n], float32 pow2 scales [..., n/block])."""
    blocks = x.float().unflatten(-1, (-1, block))
    scale = ue8m0_scale(blocks.abs().amax(-1), FP8_MAX)
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale


def fp8_dequantize_rows(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    return (q.float().unflatten(-1, (-1, block)) * scale.unsqueeze(-1)).flatten(-2)


def fake_quant_kv(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """The official QAT view of a KV entry: nope dims through FP8/UE8M0 per 64, rope dims BF16.

    x [..., d] float → float32 [..., d]; this is what the `fp8_pack` pool must decode to.
    """
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    q, s = fp8_quantize_rows(nope, KV_SCALE_BLOCK)
    return torch.cat([fp8_dequantize_rows(q, s, KV_SCALE_BLOCK), rope.to(torch.bfloat16).float()], dim=-1)


def kv_pack_bytes(head_dim: int, rope_dim: int) -> int:
    nope = head_dim - rope_dim
    raw = nope + 2 * rope_dim + nope // KV_SCALE_BLOCK
    return (raw + 7) // 8 * 8


def pack_kv(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """x [N, d] → uint8 [N, kv_pack_bytes(d, r)] laid out [nope e4m3 | rope bf16 | ue8m0 | pad]."""
    n, d = x.shape
    nope = d - rope_dim
    q, s = fp8_quantize_rows(x[:, :nope], KV_SCALE_BLOCK)
    out = torch.zeros(n, kv_pack_bytes(d, rope_dim), dtype=torch.uint8, device=x.device)
    out[:, :nope] = q.view(torch.uint8)
    out[:, nope:nope + 2 * rope_dim] = x[:, nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    out[:, nope + 2 * rope_dim:nope + 2 * rope_dim + s.shape[-1]] = scale_to_ue8m0_byte(s)
    return out


def unpack_kv(packed: torch.Tensor, head_dim: int, rope_dim: int) -> torch.Tensor:
    """uint8 [N, B] → float32 [N, d]; inverse of :func:`pack_kv` up to the quantisation."""
    nope = head_dim - rope_dim
    q = packed[:, :nope].contiguous().view(torch.float8_e4m3fn)
    rope = packed[:, nope:nope + 2 * rope_dim].contiguous().view(torch.bfloat16).float()
    s = ue8m0_byte_to_scale(packed[:, nope + 2 * rope_dim:nope + 2 * rope_dim + nope // KV_SCALE_BLOCK])
    return torch.cat([fp8_dequantize_rows(q, s, KV_SCALE_BLOCK), rope], dim=-1)


def index_pack_bytes(index_head_dim: int) -> int:
    return index_head_dim + 4


def pack_index_key(x: torch.Tensor) -> torch.Tensor:
    """Indexer key x [N, c] → uint8 [N, c + 4]: e4m3 values then one float32 scale (amax/448)."""
    n, c = x.shape
    scale = x.float().abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR) / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch.empty(n, c + 4, dtype=torch.uint8, device=x.device)
    out[:, :c] = q.view(torch.uint8)
    out[:, c:] = scale.contiguous().view(torch.uint8)
    return out


def unpack_index_key(packed: torch.Tensor, index_head_dim: int) -> torch.Tensor:
    c = index_head_dim
    q = packed[:, :c].contiguous().view(torch.float8_e4m3fn).float()
    return q * packed[:, c:c + 4].contiguous().view(torch.float32)


# ---------------------------------------------------------------------------------------
# weights: FP8 128×128 blocks, FP4 1×32 blocks
# ---------------------------------------------------------------------------------------

def fp8_quantize_weight(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] → (e4m3 [out, in], UE8M0 scales float8_e8m0fnu [ceil(out/b), ceil(in/b)])."""
    out_f, in_f = w.shape
    po, pi = -out_f % block, -in_f % block
    padded = torch.nn.functional.pad(w.float(), (0, pi, 0, po))
    blocks = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [bo, b, bi, b]
    scale = ue8m0_scale(blocks.abs().amax(dim=(1, 3)), FP8_MAX)  # [bo, bi]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.flatten(2).flatten(0, 1)[:out_f, :in_f].to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def fp8_dequantize_weight(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Inverse of :func:`fp8_quantize_weight` → float32 [out, in]."""
    s = _scale_as_float(scale)
    s = s.repeat_interleave(block, 0)[: q.shape[0]].repeat_interleave(block, 1)[:, : q.shape[1]]
    return q.float() * s


def fp4_quantize_weight(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] → (int8 [out, in/2] packed e2m1, low nibble first; UE8M0 scales [out, in/32])."""
    blocks = w.float().unflatten(-1, (-1, block))
    scale = ue8m0_scale(blocks.abs().amax(-1), FP4_MAX)
    codes = e2m1_encode((blocks / scale.unsqueeze(-1)).flatten(-2))
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def fp4_dequantize_weight(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    u8 = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    vals = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1).flatten(-2)
    return (vals.unflatten(-1, (-1, block)) * _scale_as_float(scale).unsqueeze(-1)).flatten(-2)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (ties to the even code) → 4-bit codes (uint8)."""
    mag = x.abs().clamp(max=FP4_MAX)
    grid = torch.tensor(E2M1_VALUES[:8], device=x.device)
    # nearest grid point; on an exact tie prefer the even code (round-half-even like hardware)
    dist = (mag.unsqueeze(-1) - grid).abs()
    best = dist.min(-1, keepdim=True).values
    tie_even = (dist == best) & (torch.arange(8, device=x.device) % 2 == 0)
    idx = torch.where(tie_even.any(-1), tie_even.float().argmax(-1), dist.argmin(-1))
    sign = (x < 0) & (idx > 0)
    return (idx + 8 * sign).to(torch.uint8)


def _scale_as_float(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8:
        return ue8m0_byte_to_scale(scale)
    return scale.float()
