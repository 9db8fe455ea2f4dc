"""Launch-shape sweep of the mHC mixes kernel (`hc_pre`) at V4-Flash width (4 streams × 4096):
tokens per program, K per step, warps, K splits. GPU time
per hc_pre call (mixes + Sinkhorn + collapse) and its read bandwidth; decode sizes (up to 256
tokens) are timed from CUDA-graph replays, where a call's launch overhead would otherwise dominate,
and also sweep K splits up to 128.

    python benchmarks/mhc_sweep.py --out $OUT/mhc_sweep.json --tokens 8192
    python benchmarks/mhc_sweep.py --out $OUT/mhc_decode.json --tokens 1 64 256
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_ceilings import bench, bench_graph  # noqa: E402
from model.kernels import mhc  # noqa: E402

HC, D, MIX = 4, 4096, 24


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--bt", type=int, nargs="+", help="tokens per program (default: by token count)")
    ap.add_argument("--bk", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--splits", type=int, nargs="+", help="K splits (default: by token count; 0 = the heuristic)")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    fn = torch.randn(MIX, HC * D, device="cuda", generator=g) / (HC * D) ** 0.5
    base, scale = 0.5 * torch.randn(MIX, device="cuda", generator=g), 0.5 + torch.rand(3, device="cuda", generator=g)
    results = []
    for T in args.tokens:
        x = torch.randn(T, HC, D, device="cuda", generator=g).bfloat16()
        ref = mhc.hc_pre(x, fn, base, scale, HC, 20, 1e-6, 1e-6, "torch")
        default = mhc.MIX_TILES
        decode = T <= 256
        splits = ([sp or None for sp in args.splits] if args.splits else
                  (None, 2, 4, 8, 16, 32, 64, 128) if decode else (None, 2, 4))
        bts = args.bt or ((16, 32, 64, 128) if not decode else (16, 32, 64) if T >= 64 else (16,))
        shapes = [None] + [mhc.MixTiles(bt, bk, nw, split) for bt, bk, nw, split in
                           itertools.product(bts, args.bk, args.warps, splits)]
        for tiles in shapes:
            row = {"tokens": T, "tiles": str(tiles or default), "default": tiles is None}
            try:
                call = lambda: mhc.hc_pre(x, fn, base, scale, HC, 20, 1e-6, 1e-6, "triton", tiles=tiles)  # noqa: E731
                out = call()
                row["max_diff_comb"] = float((out[2] - ref[2]).abs().max())
                row["ms"] = (bench_graph(call) if decode else bench(call, warmup=2, reps=10)) * 1e3
                row["GBps"] = x.numel() * 2 * 2 / row["ms"] / 1e6  # mixes read x once, the collapse once more
            except Exception as e:  # a shape that does not fit (shared memory, registers) is a result
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            results.append(row)
        best = min((r for r in results if r["tokens"] == T and "ms" in r), key=lambda r: r["ms"])
        print(f"T={T}: default {results[-len(shapes)].get('ms')} ms, best {best['ms']:.4f} ms {best['tiles']}",
              flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
