"""Would FP4 experts multiply faster on e4m3 wgmma than on bf16? The gate/up K loop alone, probed.

    python benchmarks/research/moe_e4m3_probe.py --out probe.json [--tokens 64 256]

The decode gate/up kernel is bound by the instructions that turn FP4 codes into MMA operands
(Nsight Compute at 256 tokens, H200: 0.63 issued per scheduler-cycle, the conversion's LOP3 /
HMUL2 / SHF / IMAD 60% of them; docs/journal/gpu-rounds-v29-v36.md, round v36). The e4m3 alternative:

* each 32-bit word of codes becomes two registers of e4m3 in five instructions (`_E4M3_PTX`; the
  bf16 path takes twelve for the same eight codes), with no multiply: an e2m1 code whose bits are
  placed at e4m3's sign, low exponent and top mantissa bits reads as its value times 2^-6, the
  subnormal 0.5 and zero included;
* the UE8M0 scale of each 32 K is applied to the fp32 product of its group (m64n16k32, one
  wgmma a group), 0.5 FFMA a weight at 16 tokens;
* the activations are e4m3 too (one scale per token here, applied after the loop).

Three kernels over the same expert tiles (one program a tile of 16 tokens × 64 gate and 64 up
rows, the weights and scale bytes of a real `PackedExperts`, read once): `e4m3` (the above),
`bf16` (the production K loop, `moe_gemm.w_xt`, in the same wrapper) and the production
`_gateup_kernel` on a routed batch of `--tokens` (its tiles decide how many tiles the probes run).
The e4m3 kernel is first checked against a torch reference of its own packing; the bf16 probe
reads the bytes as codes of the production layout, so its values mean nothing, its time does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.moe_bench import build_layer, ceilings, routed_inputs  # noqa: E402
from benchmarks.research.moe_tiles_bench import graph_ms, plan  # noqa: E402
from model.kernels.moe import moe_fused  # noqa: E402
from model.kernels.moe.moe_gemm import w_xt  # noqa: E402
from model.low_precision import E2M1_VALUES  # noqa: E402

# word w (bytes 4j..4j+3 of a row's 32-byte half step) → (lo, hi): four e4m3 each. lo takes the
# bits at 7 (sign), 4, 3, 2 (e1 e0 m) of every byte; hi the sign at bit 1, e1 e0 at bits 6, 5 of
# the byte before (cyclically) and m at bit 0 (`pack_words`).
_E4M3_PTX = tl.constexpr("""{ .reg .b32 a, b;
 and.b32 $0, $2, 0x9C9C9C9C;
 shf.l.wrap.b32 a, $2, $2, 6; and.b32 b, $2, 0x01010101; shf.l.wrap.b32 b, b, b, 2;
 lop3.b32 $1, a, 0x98989898, b, 0xEA; }""")  # (a & mask) | b


@triton.jit
def _words_to_e4m3(w):
    """uint8 [R, 32] (a wgmma A operand's layout: four consecutive bytes a register) → (lo, hi)
    e4m3 [R, 32]: the K = 32 codes of two scale groups, each as value · 2^-6."""
    return tl.inline_asm_elementwise(asm=_E4M3_PTX, constraints="=r,=r,r", args=[w],
                                     dtype=(tl.float8e4nv, tl.float8e4nv), is_pure=True, pack=4)


@triton.jit
def _factor(byte):
    """UE8M0 scale byte → fp32 2^(byte - 127 + 6) (the 2^-6 of the placed codes undone)."""
    return ((byte.to(tl.int32) + 6) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _half_step(acc, w_ptr, off, x_lo, x_hi, f_lo, f_hi):
    """acc += the products of two scale groups (32 bytes a row at `off`), each times its factor."""
    lo, hi = _words_to_e4m3(tl.load(w_ptr + off))
    acc += tl.dot(lo, tl.trans(x_lo)) * f_lo[:, None]
    acc += tl.dot(hi, tl.trans(x_hi)) * f_hi[:, None]
    return acc


@triton.jit
def _group_factors(s_ptr, off):
    """The four groups' factors [BN] of a K step from scale bytes [BN, 4] at `off`."""
    f = _factor(tl.load(s_ptr + off))
    even, odd = tl.split(tl.reshape(f, [f.shape[0], 2, 2]))  # groups (0, 2), (1, 3)
    f0, f2 = tl.split(even)
    f1, f3 = tl.split(odd)
    return f0, f1, f2, f3


@triton.jit
def _e4m3_gateup_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, h_ptr, stride_we, stride_se,
                        D: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr):
    """Program (tile e, BN columns of I): tokens e·BT.. of x e4m3 [E·BT, D] (scale xs per token)
    against expert e's gate and up rows n, I + n → h bf16 [E·BT, I] = silu(g) · u."""
    e = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    tok = e * BT + tl.arange(0, BT)
    c = tl.arange(0, 32)
    w = w_ptr + e.to(tl.int64) * stride_we
    s = s_ptr + e.to(tl.int64) * stride_se
    R: tl.constexpr = 2 * I
    g = tl.zeros([BN, BT], tl.float32)
    u = tl.zeros([BN, BT], tl.float32)
    for i in range(0, D // 128):  # a K step: 128 codes, 64 bytes a row (one K block)
        x_row = x_ptr + tok[:, None] * D + i * 128 + c[None, :]
        x0, x1 = tl.load(x_row), tl.load(x_row + 32)
        x2, x3 = tl.load(x_row + 64), tl.load(x_row + 96)
        f0, f1, f2, f3 = _group_factors(s, i * (R * 4) + n[:, None] * 4 + tl.arange(0, 4)[None, :])
        v0, v1, v2, v3 = _group_factors(s, i * (R * 4) + (I + n)[:, None] * 4 + tl.arange(0, 4)[None, :])
        g_off = i * (R * 64) + n[:, None] * 64 + c[None, :]
        u_off = g_off + I * 64
        g = _half_step(g, w, g_off, x0, x1, f0, f1)
        g = _half_step(g, w, g_off + 32, x2, x3, f2, f3)
        u = _half_step(u, w, u_off, x0, x1, v0, v1)
        u = _half_step(u, w, u_off + 32, x2, x3, v2, v3)
    xs = tl.load(xs_ptr + tok)
    g = g * xs[None, :]
    u = u * xs[None, :]
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + tok[None, :] * I + n[:, None], h.to(tl.bfloat16))


@triton.jit
def _bf16_gateup_kernel(x_ptr, w_ptr, s_ptr, h_ptr, stride_we, stride_se,
                        D: tl.constexpr, I: tl.constexpr, WKB: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr,
                        BK: tl.constexpr):
    """The production K loop (`w_xt`: FP4 → bf16 in registers, wgmma, x bf16 in `preorder`'s
    layout) in `_e4m3_gateup_kernel`'s wrapper."""
    e = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    tok = e * BT + tl.arange(0, BT)
    w = w_ptr + e.to(tl.int64) * stride_we
    s = s_ptr + e.to(tl.int64) * stride_se
    g, u = w_xt(x_ptr, tok, tok >= 0, w, s, n, n, n + I, n + I, D, True, True, True, True, True, BN, BT, BK,
                True, 2 * I, WKB, 1, 0, True)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + tok[None, :] * I + n[:, None], h.to(tl.bfloat16))


def pack_words(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [..., 128] (one K block of a row: 4 groups of 32; s = bit 3) → its 64 bytes in
    `_E4M3_PTX`'s layout: half h (bytes 32h..) holds groups 2h (A) and 2h + 1 (B); word j of a half
    holds A's and B's codes 4j..4j+3."""
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], 2, 2, 8, 4)  # [.., half, A/B, word, i]
    a, b = c[..., 0, :, :], c[..., 1, :, :]  # [.., half, word, i]
    bit = lambda v, k: (v >> k) & 1  # noqa: E731
    word = torch.zeros(a.shape[:-1], dtype=torch.int64, device=codes.device)
    for lane in range(4):
        sa, sb = a[..., lane], b[..., lane]
        word |= bit(sa, 3) << (8 * lane + 7) | bit(sa, 2) << (8 * lane + 4) | bit(sa, 1) << (8 * lane + 3) \
            | bit(sa, 0) << (8 * lane + 2)
        prev = 8 * ((lane - 1) % 4)
        word |= bit(sb, 3) << (8 * lane + 1) | bit(sb, 2) << (prev + 6) | bit(sb, 1) << (prev + 5) | bit(sb, 0) << (8 * lane)
    out = torch.stack([(word >> (8 * k)) & 0xFF for k in range(4)], -1)  # [.., half, word, byte]
    return out.reshape(*codes.shape[:-1], 64).to(torch.uint8)


def e4m3_tile_inputs(E: int, D: int, I: int, BT: int, device, seed: int = 0):
    """Random codes, scale bytes and x for E tiles → (kernel inputs, float weights [E, 2I, D], x [E·BT, D] as the
    kernel sees it: e4m3 values times their token scale)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    codes = torch.randint(0, 16, (E, 2 * I, D), generator=g)
    sbytes = torch.randint(118, 125, (E, 2 * I, D // 32), generator=g)
    w = torch.tensor(E2M1_VALUES)[codes] * torch.exp2(sbytes.float() - 127).repeat_interleave(32, -1)
    blocks = codes.reshape(E, 2 * I, D // 128, 128).permute(0, 2, 1, 3)  # [E, block, row, 128]
    wq = pack_words(blocks).contiguous()
    sq = sbytes.reshape(E, 2 * I, D // 128, 4).permute(0, 2, 1, 3).contiguous().to(torch.uint8)
    x = torch.randn(E * BT, D, generator=g)
    xs = x.abs().amax(1) / 448
    x8 = (x / xs[:, None]).to(torch.float8_e4m3fn)
    xq = x8.float() * xs[:, None]
    return (x8.to(device), xs.to(device), wq.to(device), sq.to(device)), w, xq


def run_e4m3(inputs, E: int, D: int, I: int, BT: int, BN: int = 64, h: torch.Tensor | None = None) -> torch.Tensor:
    """`_e4m3_gateup_kernel` over E tiles: inputs (x8, xs, wq, sq) → h [E·BT, I] bf16 (into `h` when given)."""
    x8, xs, wq, sq = inputs
    if h is None:
        h = torch.empty(E * BT, I, dtype=torch.bfloat16, device=x8.device)
    _e4m3_gateup_kernel[(E, I // BN)](x8, xs, wq, sq, h, wq[0].numel(), sq[0].numel(), D=D, I=I, BN=BN, BT=BT,
                                      num_warps=4, num_stages=3)
    return h


def check(device) -> float:
    """Largest error of the e4m3 kernel against fp64 on its own inputs, relative to the largest |h|."""
    E, D, I, BT = 3, 512, 128, 16
    inputs, w, xq = e4m3_tile_inputs(E, D, I, BT, device)
    h = run_e4m3(inputs, E, D, I, BT).double().cpu()
    gu = torch.einsum("end,etd->ent", w.double(), xq.double().reshape(E, BT, D))  # [E, 2I, BT]
    gate, up = gu[:, :I], gu[:, I:]
    ref = (gate * torch.sigmoid(gate) * up).permute(0, 2, 1).reshape(E * BT, I)
    return float((h - ref).abs().max() / ref.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="moe_e4m3_probe.json")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256])
    args = ap.parse_args()
    device = torch.device("cuda")
    err = check(device)
    print(f"e4m3 kernel against fp64: max error {err:.2e} of max |h|", flush=True)
    ceil = ceilings()
    moe = build_layer()
    ex = moe.experts
    D, I, BT, BN = ex.dim, ex.inter, 16, 64
    rows = []
    for T in args.tokens:
        ids = routed_inputs(moe, T, seed=100)[3]
        counts = torch.bincount(ids.flatten(), minlength=ex.w13.shape[0])
        tiles = int(((counts + BT - 1) // BT).sum())
        gateup, down = moe_fused.decode_tiles(T)
        launches, _ = plan(moe, T, 100, gateup, down, False, True)
        _, per_kernel = graph_ms(launches)
        prod_ms = per_kernel["_gateup_kernel"]
        x16 = torch.randn(tiles * BT, D, device=device).to(torch.bfloat16)
        h = torch.empty(tiles * BT, I, dtype=torch.bfloat16, device=device)
        x8 = x16.to(torch.float8_e4m3fn)
        xs = torch.ones(tiles * BT, device=device)
        w13, s13 = ex.w13, ex.w13_scale
        e4m3_ms, _ = graph_ms([lambda: run_e4m3((x8, xs, w13, s13), tiles, D, I, BT, BN, h)])
        bf16_ms, _ = graph_ms([lambda: _bf16_gateup_kernel[(tiles, I // BN)](
            x16, w13, s13, h, w13[0].numel(), s13[0].numel(), D=D, I=I, WKB=ex.kb13, BN=BN, BT=BT, BK=128,
            num_warps=4, num_stages=3)])
        nbytes = tiles * (w13[0].numel() + s13[0].numel())
        row = dict(T=T, tiles=tiles, production_ms=prod_ms, bf16_probe_ms=bf16_ms, e4m3_probe_ms=e4m3_ms,
                   e4m3_frac_copy=nbytes / (e4m3_ms * 1e-3) / (ceil["copy_GBps"] * 1e9),
                   bf16_frac_copy=nbytes / (bf16_ms * 1e-3) / (ceil["copy_GBps"] * 1e9))
        rows.append(row)
        print(f"T={T} tiles={tiles}: production gate/up {prod_ms * 1e3:.1f} µs, bf16 probe {bf16_ms * 1e3:.1f} µs "
              f"({row['bf16_frac_copy']:.0%} of copy), e4m3 probe {e4m3_ms * 1e3:.1f} µs "
              f"({row['e4m3_frac_copy']:.0%})", flush=True)
    compiled = []
    for fn in (_e4m3_gateup_kernel, _bf16_gateup_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            for k in cache[0].values():
                compiled.append(dict(kernel=fn.__name__, regs=getattr(k, "n_regs", None),
                                     spills=getattr(k, "n_spills", None)))
    print(compiled)
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), ceilings=ceil, check_error=err,
                                              rows=rows, compiled=compiled), indent=1))


if __name__ == "__main__":
    main()
