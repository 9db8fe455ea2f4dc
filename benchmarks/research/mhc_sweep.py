"""Launch-shape sweep of the mHC entry kernels at V4-Flash width (4 streams × 4096): the mixes
kernel's tokens per program, K per step, warps, K splits, up to 8 tokens the one-launch
kernel's columns per program, and up to 1024 tokens the two-launch batch entry's tokens and
columns per program. GPU time per sub-block entry as the model runs it (`sublayer_input`: the
pending hc_post, mixes, Sinkhorn, collapse and RMSNorm) and the bandwidth of its compulsory
bytes (fn, the old streams, the sub-block output, the new streams written and read back, the
normed row); decode sizes (up to 1024 tokens) are timed from CUDA-graph replays, where a call's
launch overhead would otherwise dominate, and also sweep K splits up to 64. Post and the Sinkhorn
comb run in order here; the model runs the one-launch entry's on a side stream, off its chain
(benchmarks/research/mhc_entry_parts.py times that).

    python benchmarks/research/mhc_sweep.py --out $OUT/mhc_sweep.json --tokens 8192
    python benchmarks/research/mhc_sweep.py --out $OUT/mhc_decode.json --tokens 1 2 4 64 256 --warps 4
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_ceilings import bench, bench_graph  # noqa: E402
from model.kernels import arrival_counter
from model.kernels.mhc import mhc  # noqa: E402

HC, D, MIX = 4, 4096, 24


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--bt", type=int, nargs="+", help="tokens per program (default: by token count)")
    ap.add_argument("--bk", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--columns", type=int, nargs="+", default=[16, 32, 64],
                    help="D columns per program of the few-token kernel (up to 8 tokens)")
    ap.add_argument("--splits", type=int, nargs="+", help="K splits (default: by token count; 0 = the heuristic)")
    ap.add_argument("--batch-columns", type=int, nargs="+", default=[16, 32, 64, 128],
                    help="D columns per program of the two-launch batch entry (3 to 512 tokens)")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    fn = torch.randn(MIX, HC * D, device="cuda", generator=g) / (HC * D) ** 0.5
    base, scale = 0.5 * torch.randn(MIX, device="cuda", generator=g), 0.5 + torch.rand(3, device="cuda", generator=g)
    results = []
    for T in args.tokens:
        res = mhc.Residual(torch.randn(T, HC, D, device="cuda", generator=g).bfloat16(),
                           torch.randn(T, D, device="cuda", generator=g).bfloat16(),
                           2 * torch.rand(T, HC, device="cuda", generator=g),
                           torch.softmax(torch.randn(T, HC, HC, device="cuda", generator=g), -1))
        w = 1 + 0.1 * torch.randn(D, device="cuda", generator=g)
        arrivals = arrival_counter("cuda")

        def entry(impl, tiles=None):
            return mhc.sublayer_input(res, fn, base, scale, w, 1e-6, HC, 20, 1e-6, 1e-6, impl, arrivals, tiles)

        ref = entry("torch")
        nbytes = fn.numel() * 4 + T * D * 2 * (3 * HC + 2)
        default = mhc.MIX_TILES
        decode = T <= 1024
        splits = ([sp or None for sp in args.splits] if args.splits else
                  (None, 2, 4, 8, 16, 32, 64) if decode else (None, 2, 4))
        bts = args.bt or ((16, 32, 64, 128) if not decode else (16, 32, 64) if T >= 64 else (16,))
        shapes = [None] + [mhc.MixTiles(bt, bk, nw, split) for bt, bk, nw, split in
                           itertools.product(bts, args.bk, args.warps, splits)]
        if T <= 8:  # the one-launch kernel of a few tokens
            shapes += [mhc.SmallTiles(cd, nw) for cd, nw in itertools.product(args.columns, args.warps)]
        if T <= 2 * mhc.BATCH_TOKENS:  # the two-launch batch entry (from one token: against the one-launch one)
            shapes += [mhc.BatchTiles(bt, cd, nw) for bt, cd, nw in
                       itertools.product((16, 32, 64), args.batch_columns, args.warps) if bt <= max(16, T)]
        for tiles in shapes:
            implied = (mhc.SMALL_TILES if T <= mhc.SMALL_TOKENS else mhc.batch_tiles(T) if T <= mhc.BATCH_TOKENS
                       else default)
            row = {"tokens": T, "tiles": str(tiles or implied),
                   "default": tiles is None}
            try:
                call = lambda: entry("triton", tiles)  # noqa: E731
                out = call()
                row["max_diff_comb"] = float((out[3] - ref[3]).abs().max())
                row["max_diff_input"] = float((out[1].float() - ref[1].float()).abs().max())
                row["ms"] = (bench_graph(call) if decode else bench(call, warmup=2, reps=10)) * 1e3
                row["GBps"] = nbytes / row["ms"] / 1e6
            except Exception as e:  # a shape that does not fit (shared memory, registers) is a result
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            results.append(row)
        best = min((r for r in results if r["tokens"] == T and "ms" in r), key=lambda r: r["ms"])
        print(f"T={T}: default {results[-len(shapes)].get('ms')} ms, best {best['ms']:.4f} ms {best['tiles']}",
              flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
