"""The fused decode MoE's first launch alone: the counting sort of the assignments by expert and, in
its other programs, the `preorder` copy of x the FP4 experts read (kernels/moe/moe_tile_kernels.py's
`_count_sort_kernel`), at decode sizes of a full-width V4-Flash layer.

    python benchmarks/research/count_sort_bench.py --out count_sort.json

Each launch is timed from replays of a CUDA graph of 50 launches (`gpu_ceilings.bench_graph`), at 1,
2, 4 and 8 warps and, for comparison, as the sort's program alone (no copy programs).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_ceilings import bench_graph  # noqa: E402
from benchmarks.moe_bench import build_layer, routed_inputs  # noqa: E402
from model.kernels.moe import moe_fused  # noqa: E402
from model.kernels.moe.moe_grouped import fit, plan_kernels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="count_sort.json")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256])
    args = ap.parse_args()
    moe = build_layer(seed=0)
    ex = moe.experts
    rows = []
    for T in args.tokens:
        x, _, weights, ids = routed_inputs(moe, T, seed=7)
        gateup, down = moe_fused.decode_tiles(T)
        launches, _ = plan_kernels(x, weights, ids, ex, None, moe.cfg.swiglu_limit, fit(gateup, ex.inter, ex.dim),
                                   fit(down, ex.dim, ex.inter), fuse_combine=True, preordered=True)
        sort = launches[0]
        row = dict(T=T, assignments=T * ids.shape[1], default_warps=sort.meta["num_warps"],
                   us={w: bench_graph(replace(sort, meta={**sort.meta, "num_warps": w}), calls=50) * 1e6
                       for w in (1, 2, 4, 8)},
                   sort_alone_us=bench_graph(replace(sort, grid=(1,)), calls=50) * 1e6)
        rows.append(row)
        print(f"T={T:4d} ({row['assignments']} assignments): " + "  ".join(f"{w} warps {t:.2f}" for w, t in
              row["us"].items()) + f" µs; the sort's program alone {row['sort_alone_us']:.2f} µs "
              f"(default {row['default_warps']} warps)", flush=True)
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
