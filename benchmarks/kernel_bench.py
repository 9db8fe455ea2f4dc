"""Per-kernel GPU benchmark at V4-Flash shapes: achieved bandwidth and FLOP rate of every Triton
kernel of `model.kernels` against the copy bandwidth and bf16 matmul rate measured in the same
run (and the torch reference of the same op, timed alike, for scale).

    python benchmarks/kernel_bench.py --out $OUT/kernels.json

Kernels are timed as GPU time (replays of a CUDA graph of back-to-back calls: decode runs from
graphs, so host launch cost is not the kernel's); the torch references eagerly, host included.
Bytes are the fewest the op must move (each input read once, each output written once: KV entries
gathered, weights, activations); FLOPs count multiply-adds as 2. A kernel is bandwidth-bound when
its FLOP/byte is under the ridge point (matmul rate / copy bandwidth) and is judged by its
bandwidth fraction, otherwise by its FLOP fraction.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.flash_model import decode_batch, decode_pools  # noqa: E402
from benchmarks.gpu_ceilings import bench, bench_graph, ceilings  # noqa: E402
from model import low_precision  # noqa: E402
from model.batch import ForwardBatch  # noqa: E402
from model.kernels.attention import (
    compressor,
    indexer,
    rope as rope_ops,  # noqa: E402
    sparse_attention,
)
from model.kernels.gemm import fp8_gemm
from model.kernels.mhc import mhc  # noqa: E402
from model.kv_pool import KVPools, SeqKV  # noqa: E402
from model.rope import Rope  # noqa: E402
from model.tiny import flash_config  # noqa: E402

CFG = flash_config(4)  # layers 0-1 window only, 2 ratio 4, 3 ratio 128
ENTRY, IDX_ENTRY, H, D = 584, 132, 64, 512


def _prefill_batch(pools, tokens: int, start: int = 0) -> ForwardBatch:
    seq = SeqKV()
    pools.reserve(seq, start + tokens)
    seq.num_tokens = start
    return ForwardBatch.build([(seq, [1] * tokens)], device="cuda")


def prefill_picks(T: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """One T-token request on a CSA layer: random causal picks [T, 512] (-1 padded) and the number of
    (query, entry) pairs it attends (window of 128 + picks)."""
    pos = torch.arange(T, device="cuda")
    nv = (pos + 1) // 4
    picks = (torch.rand(T, 512, device="cuda", generator=g) * nv.clamp_min(1)[:, None]).long()
    picks = torch.where(torch.arange(512, device="cuda")[None, :] < nv[:, None], picks, -1).int()
    return picks, (torch.clamp(pos + 1, max=128) + torch.clamp((pos + 1) // 4, max=512)).sum().item()


def cases(contexts_decode: int, batch_decode: int, prefill_tokens: int):
    """(name, {impl: thunk}, bytes, flops) for each kernel."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, C, T = batch_decode, contexts_decode, prefill_tokens
    dpools, seqs = decode_pools(CFG, 4, B, C)
    dbatch = decode_batch(seqs)
    ppools = KVPools(CFG, "fp8_pack", max_tokens=T, max_seqs=1, device="cuda")
    pbatch = _prefill_batch(ppools, T)
    out = []

    # sparse attention: decode (C4 with 512 picks; C128 all entries), prefill C4
    qd = torch.randn(B, H, D, device="cuda", generator=g).bfloat16()
    sink = torch.randn(H, device="cuda", generator=g)
    n_vis = (C + 1) // 4
    picks = torch.randint(0, n_vis, (B, 512), device="cuda", generator=g).int()
    for ratio, layer, pk, n_comp in ((4, 2, picks, 512), (128, 3, None, C // 128)):
        rope = Rope.for_layer(CFG, True)
        entries = 128 + n_comp
        # the launch heuristic, then forced head blocks, then forced KV splits
        for bh, sp in ((None, None), (16, None), (32, None), (None, 1), (None, 4), (None, 8), (None, 16)):
            fns = {impl: (lambda impl=impl, layer=layer, ratio=ratio, pk=pk, bh=bh, sp=sp: sparse_attention.attend(
                qd, dbatch, dpools, layer, ratio, pk, sink, 128, rope, impl, block_h=bh, splits=sp))
                for impl in (("triton", "torch") if bh is None and sp is None else ("triton",))}
            out.append((f"sparse_attention decode ratio {ratio} B={B} ctx={C}" + (f" BH={bh}" if bh else "")
                        + (f" splits={sp}" if sp else ""), fns,
                        B * entries * ENTRY + B * H * D * (2 + 4), B * H * entries * D * 4))
    qp = torch.randn(T, H, D, device="cuda", generator=g).bfloat16()
    pos = torch.arange(T, device="cuda")
    ppicks, vis = prefill_picks(T, g)
    rope = Rope.for_layer(CFG, True)
    for bh in (None, 16, 32):
        out.append((f"sparse_attention prefill ratio 4 T={T}" + (f" BH={bh}" if bh else ""),
                    {"triton": lambda bh=bh: sparse_attention.attend(qp, pbatch, ppools, 2, 4, ppicks, sink, 128, rope,
                                                                     "triton", block_h=bh)},
                    vis * ENTRY + T * H * D * (2 + 4), H * vis * D * 4))

    # indexer logits + top-k
    qi = torch.randn(B, 64, 128, device="cuda", generator=g).bfloat16()
    wi = torch.randn(B, 64, device="cuda", generator=g)
    out.append((f"indexer decode B={B} ctx={C}",
                {impl: (lambda impl=impl: indexer.indexer_topk(qi, wi, dbatch, dpools, 2, 512, impl, fp8_query=True))
                 for impl in ("triton", "torch")},
                B * n_vis * IDX_ENTRY, B * n_vis * 64 * 128 * 2))
    qip = torch.randn(T, 64, 128, device="cuda", generator=g).bfloat16()
    wip = torch.randn(T, 64, device="cuda", generator=g)
    tri = (((pos + 1) // 4).sum()).item()
    out.append((f"indexer prefill T={T}", {"triton": lambda: indexer.indexer_topk(qip, wip, pbatch, ppools, 2, 512,
                                                                                  "triton", fp8_query=True)},
                tri * IDX_ENTRY, tri * 64 * 128 * 2))

    # compressor (C4 main, prefill): proj read once, entries written
    proj = torch.randn(T, 4 * D, device="cuda", generator=g)
    ape = torch.randn(4, 2 * D, device="cuda", generator=g)
    wn = torch.ones(D, device="cuda")
    out.append((f"compressor ratio 4 prefill T={T}",
                {impl: (lambda impl=impl: compressor.compress(proj, pbatch, ppools, 2, 4, "c4", "state_c4", ape, wn,
                                                              1e-6, rope, impl)) for impl in ("triton", "torch")},
                T * 4 * D * 4 + (T // 4) * ENTRY, 0))

    # fused kv norm + rope + fp8 pack + store, prefill
    kv = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    out.append((f"store_kv prefill T={T}",
                {impl: (lambda impl=impl: rope_ops.store_kv(kv, pbatch, ppools, 2, wn, 1e-6, rope, impl))
                 for impl in ("triton", "torch")}, T * D * 2 + T * ENTRY, 0))

    # FP8 GEMMs: decode (bytes-bound) and prefill (FLOP-bound)
    for (n, k, grp) in ((32768, 1024, 1), (4096, 8192, 1), (1024, 4096, 8)):
        wq, ws = low_precision.fp8_quantize_weight(torch.randn(grp * n, k, device="cuda", generator=g) / k ** 0.5)
        ws = ws.float()
        for m in (1, 64, 256, T):
            x = torch.randn(*((m, grp, k) if grp > 1 else (m, k)), device="cuda", generator=g).bfloat16()
            out.append((f"fp8_gemm M={m} N={n} K={k} G={grp}",
                        {impl: (lambda impl=impl, x=x, wq=wq, ws=ws, grp=grp: fp8_gemm.fp8_linear(x, wq, ws, impl, grp))
                         for impl in ("triton", "torch")},
                        grp * n * k + m * grp * (k + n) * 2, 2 * m * grp * n * k))

    # mHC
    xs = torch.randn(T, 4, 4096, device="cuda", generator=g).bfloat16()
    fn = torch.randn(24, 4 * 4096, device="cuda", generator=g) / 128
    base, scale = torch.randn(24, device="cuda", generator=g), torch.rand(3, device="cuda", generator=g)
    o = torch.randn(T, 4096, device="cuda", generator=g).bfloat16()
    post, comb = torch.rand(T, 4, device="cuda", generator=g), torch.rand(T, 4, 4, device="cuda", generator=g)
    out.append((f"mhc hc_pre T={T}", {impl: (lambda impl=impl: mhc.hc_pre(xs, fn, base, scale, 4, 20, 1e-6, 1e-6, impl))
                                      for impl in ("triton", "torch")},
                T * 4 * 4096 * 2 * 2 + T * 4096 * 2, T * 4 * 4096 * 24 * 2))
    out.append((f"mhc hc_post T={T}", {impl: (lambda impl=impl: mhc.hc_post(o, xs, post, comb, impl))
                                       for impl in ("triton", "torch")},
                T * 4096 * 2 * 9, T * 4096 * 4 * 5 * 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--only", default="", help="only the cases whose name contains this")
    args = ap.parse_args()
    ceil = ceilings()
    bw, rate = ceil["copy_bytes_per_s"], ceil["bf16_flops"]
    ridge = rate / bw
    rows = []
    for name, fns, nbytes, flops in cases(args.context, args.batch, args.prefill_tokens):
        if args.only and args.only not in name:
            continue
        # kernels: GPU time from graph replay; torch references (host syncs, not capturable): eager
        times = {impl: (bench_graph(fn) if impl == "triton" else bench(fn, reps=5)) for impl, fn in fns.items()}
        t = times["triton"]
        bound = "flops" if flops / max(nbytes, 1) > ridge else "bytes"
        frac = (flops / t / rate) if bound == "flops" else (nbytes / t / bw)
        rows.append({"kernel": name, "ms": t * 1e3, "torch_ms": times.get("torch", float("nan")) * 1e3,
                     "GBps": nbytes / t / 1e9, "TFLOPs": flops / t / 1e12, "bound": bound, "fraction": frac})
        print(f"{name:48s} {t * 1e3:9.3f} ms  {nbytes / t / 1e9:8.1f} GB/s  {flops / t / 1e12:7.1f} TFLOP/s  "
              f"{bound:5s} {frac:6.1%}  (torch {times.get('torch', float('nan')) * 1e3:9.3f} ms)", flush=True)
    Path(args.out).write_text(json.dumps({"ceilings": ceil, "rows": rows}, indent=1))
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s ({ceil['device']})")


if __name__ == "__main__":
    main()
