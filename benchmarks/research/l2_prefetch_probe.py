"""Does pulling the next products' weights into L2, while a latency-bound kernel leaves HBM idle,
shorten a batch-1 step?

    python benchmarks/research/l2_prefetch_probe.py --out p.json

Each "layer" of a CUDA graph is a busy kernel (128 programs of dependent FMAs, standing in for
the mHC entry or the attention: a few µs of latency that reads nothing) followed by W8A8 decode
products at one token (`fp8_gemm.decode_product`, `decode_config`'s tiles). Twelve layers of
distinct weights rotate, so nothing is in L2 from the last replay. Variants:

* plain: busy → products;
* bulk: a side stream forked before the busy kernel issues `cp.async.bulk.prefetch.L2` over the
  products' weights (the TMA engine fetches; the kernel returns at once);
* loads: the side stream's kernel reads the weights itself (`evict_last`) into a dummy sum;
* warm: busy → products → the same products again: the second pass's time is what a product
  costs from L2, the bound on what a prefetch can save.

Replay medians, µs a layer; busy-only layers give the busy kernel's own time.
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

from benchmarks.gpu_ceilings import bench_graph  # noqa: E402
from benchmarks.research.fp8_gemm_bench import shapes  # noqa: E402
from model import low_precision  # noqa: E402
from model.kernels.gemm import fp8_gemm  # noqa: E402


@triton.jit
def _busy_kernel(out_ptr, iters):
    x = tl.program_id(0).to(tl.float32) + tl.arange(0, 128).to(tl.float32)
    for _ in range(iters):
        x = x * 0.999 + 0.5
    tl.store(out_ptr + tl.program_id(0) * 128 + tl.arange(0, 128), x)


@triton.jit
def _bulk_kernel(base, nbytes, keep_ptr, CHUNK: tl.constexpr, LANES: tl.constexpr):
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.maximum(tl.minimum(nbytes - offs, CHUNK), 16).to(tl.int32)
    addr = base + tl.where(offs < nbytes, offs, 0)
    r = tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(keep_ptr + tl.arange(0, LANES), r, mask=r != 0)  # never true: keeps the asm


@triton.jit
def _loads_kernel(w_ptr, n_words, keep_ptr, BLOCK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.int32)
    start = tl.program_id(0).to(tl.int64) * PER_PROGRAM
    for i in range(0, PER_PROGRAM, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        acc ^= tl.load(w_ptr + offs, mask=offs < n_words, other=0, eviction_policy="evict_last")
    tl.store(keep_ptr + tl.program_id(0), tl.sum(acc, 0) == 12345)


def prefetch_bulk(w: torch.Tensor, keep: torch.Tensor, chunk: int = 1 << 16) -> None:
    n = w.numel() * w.element_size()
    lanes = 128
    _bulk_kernel[(triton.cdiv(triton.cdiv(n, chunk), lanes),)](w.data_ptr(), n, keep, CHUNK=chunk, LANES=lanes)


def prefetch_loads(w: torch.Tensor, keep: torch.Tensor, programs: int = 132) -> None:
    words = w.view(torch.int32).view(-1)
    per = triton.cdiv(triton.cdiv(words.numel(), programs), 4096) * 4096
    _loads_kernel[(triton.cdiv(words.numel(), per),)](words, words.numel(), keep, BLOCK=4096, PER_PROGRAM=per)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--busy-iters", type=int, nargs="+", default=[2000, 6000])
    ap.add_argument("--sets", nargs="+", default=["wq_b", "wo_a,wo_b", "wq_a,wq_b"])
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = 12
    weights = {}
    for name, (N, K, G) in shapes().items():
        weights[name] = []
        for _ in range(layers):
            q, s = low_precision.fp8_quantize_weight(torch.randn(G * N, K, device="cuda", generator=g) / K ** 0.5)
            x = torch.randn(1, G, K, device="cuda", generator=g).bfloat16()
            weights[name].append((x, q, s.float(), fp8_gemm.arrival_counters(G * N, "cuda"), G))
    busy_out = torch.empty(132 * 128, device="cuda")
    keep = torch.zeros(1 << 16, device="cuda", dtype=torch.int32)
    side = torch.cuda.Stream()

    def product(op):
        x, q, s, arrivals, _ = op
        return fp8_gemm.decode_product(x, q, s, arrivals, quantize_x=True)

    def step(names, iters, mode):
        for i in range(layers):
            ops = [weights[n][i] for n in names]
            if mode in ("bulk", "loads"):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for op in ops:
                        (prefetch_bulk if mode == "bulk" else prefetch_loads)(op[1], keep)
            _busy_kernel[(132,)](busy_out, iters)
            if mode != "busy":
                for op in ops:
                    product(op)
            if mode == "warm":
                for op in ops:
                    product(op)
            if mode in ("bulk", "loads"):
                torch.cuda.current_stream().wait_stream(side)

    results = []
    for iters in args.busy_iters:
        for names in args.sets:
            names = names.split(",")
            row = {"busy_iters": iters, "products": names,
                   "weight_mb": sum(weights[n][0][1].numel() for n in names) / 1e6}
            for mode in ("busy", "plain", "bulk", "loads", "warm", "plain"):
                us = bench_graph(lambda: step(names, iters, mode), calls=1, reps=30) / layers * 1e6
                row[mode if mode not in row else mode + "_again"] = round(us, 2)
            row["product_us"] = round(row["plain"] - row["busy"], 2)
            row["product_from_l2_us"] = round(row["warm"] - row["plain"], 2)
            print(json.dumps(row), flush=True)
            results.append(row)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": results}, indent=1))


if __name__ == "__main__":
    main()
