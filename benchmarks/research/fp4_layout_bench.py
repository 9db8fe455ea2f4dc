"""How the expert weights' layout in HBM sets the decode MoE's bandwidth, kernel work held fixed.

    python benchmarks/research/fp4_layout_bench.py --out fp4_layout.json

The fused decode kernels read, per program and K step, a tile of BN weight rows × 64 bytes. Row-major
experts ([rows, K/2]) make that BN reads of 64 bytes, each a row (2 KB at V4-Flash widths) apart;
K-blocked experts (model/moe.py's `PackedExperts`: [K/2/64, rows, 64]) make it one contiguous read
of BN·64 bytes. This benchmark streams the same bytes (168 experts × 4096 rows × 2048 bytes: a
batch-64 step's gate/up weights at V4-Flash shapes) through a kernel shaped like the decode gate/up
(one BN × 64-byte tile per step, then a tensor-core product with 16 token columns), in both layouts,
with the bytes consumed either as FP8 straight from shared memory or converted to bf16 in
registers, against a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

EXPERTS, ROWS, ROW_BYTES, STEP_BYTES = 168, 4096, 2048, 64


@triton.jit
def _stream_kernel(w_ptr, x_ptr, out_ptr, ROW_BYTES: tl.constexpr, ROWS: tl.constexpr, BN: tl.constexpr,
                   KB: tl.constexpr, BLOCKED: tl.constexpr, FP8: tl.constexpr):
    pid_n = tl.program_id(0)
    e = tl.program_id(1)
    r = tl.arange(0, BN)
    c = tl.arange(0, KB)
    base = w_ptr + e.to(tl.int64) * (ROWS * ROW_BYTES)
    xt = tl.load(x_ptr + tl.arange(0, 16)[:, None] * KB + c[None, :])
    acc = tl.zeros([BN, 16], dtype=tl.float32)
    for s in range(0, ROW_BYTES // KB):
        if BLOCKED:  # step s of all rows contiguous: [ROW_BYTES / KB, ROWS, KB]
            p = base + s * (ROWS * KB) + (pid_n * BN + r)[:, None] * KB + c[None, :]
        else:  # row-major [ROWS, ROW_BYTES]
            p = base + (pid_n * BN + r)[:, None] * ROW_BYTES + s * KB + c[None, :]
        t = tl.load(p)
        if FP8:
            acc = tl.dot(t.to(tl.float8e4nv, bitcast=True), tl.trans(xt.to(tl.float8e4nv)), acc)
        else:
            acc = tl.dot(t.to(tl.bfloat16), tl.trans(xt), acc)
    tl.store(out_ptr + ((e * (ROWS // BN) + pid_n) * BN + r)[:, None] * 16 + tl.arange(0, 16)[None, :], acc)


def main() -> None:
    from triton.testing import do_bench
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fp4_layout.json")
    args = ap.parse_args()
    nbytes = EXPERTS * ROWS * ROW_BYTES
    w = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    x = torch.randn(16, STEP_BYTES, device="cuda").to(torch.bfloat16)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() / do_bench(lambda: dst.copy_(src), rep=200) / 1e6
    del src, dst
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps:.0f} GB/s; {nbytes / 1e9:.2f} GB streamed per run")
    rows = []
    for bn in (64, 128):
        out = torch.empty(EXPERTS * ROWS * 16, device="cuda")
        for fp8 in (True, False):
            for blocked in (False, True):
                for stages, warps in ((3, 4), (4, 4), (3, 8)):
                    def run(bn=bn, blocked=blocked, fp8=fp8, stages=stages, warps=warps):
                        _stream_kernel[(ROWS // bn, EXPERTS)](w, x, out, ROW_BYTES, ROWS, bn, STEP_BYTES, blocked, fp8,
                                                              num_warps=warps, num_stages=stages)
                    run()
                    ms = do_bench(run, rep=200)
                    gbps = nbytes / ms / 1e6
                    rows.append(dict(BN=bn, operand="fp8" if fp8 else "bf16", layout="blocked" if blocked else "row-major",
                                     num_stages=stages, num_warps=warps, ms=ms, GBps=gbps, frac_copy=gbps / copy_gbps))
                    print(f"BN={bn:3d} {rows[-1]['operand']:4s} {rows[-1]['layout']:9s} stages={stages} warps={warps}: "
                          f"{ms:.3f} ms {gbps:.0f} GB/s = {gbps / copy_gbps:.0%} of copy", flush=True)
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_GBps=copy_gbps, bytes=nbytes,
                                              rows=rows), indent=1))


if __name__ == "__main__":
    main()
