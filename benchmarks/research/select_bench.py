"""The indexer's top-k select kernel (`indexer.top_k`) at decode and prefill row counts: GPU time
per call from CUDA graph replays (benchmarks/gpu_ceilings.py's `bench_graph`), k = 512 of 2048
entries (an 8K context) and of 8192 (32K), random scores with a causal tail per row.

    python benchmarks/research/select_bench.py --out s.json [--rows 1 64 256 8192] [--warps 1 2 4 8]

`--warps`: the select kernel's warps (`indexer.top_k`'s `num_warps`); by default its own choice.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_ceilings import bench_graph  # noqa: E402
from model.kernels.attention import indexer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 8192])
    ap.add_argument("--entries", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--warps", type=int, nargs="+", default=[0], help="0: the kernel's choice")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n in args.entries:
        for R in args.rows:
            scores = torch.randn(R, n, device="cuda", generator=g)
            visible = n - (torch.arange(R, device="cuda") * n) // (2 * R)  # row 0 sees all n, the last ~half
            scores = scores.masked_fill(torch.arange(n, device="cuda")[None, :] >= visible[:, None], float("-inf"))
            want = indexer.top_k(scores, args.k)
            for warps in args.warps:
                kw = {"num_warps": warps} if warps else {}
                assert torch.equal(indexer.top_k(scores, args.k, **kw), want)
                us = bench_graph(lambda: indexer.top_k(scores, args.k, **kw)) * 1e6
                rows.append({"rows": R, "entries": n, "k": args.k, "num_warps": warps or None, "us": us})
                print(f"top_k rows={R:5d} entries={n:5d} k={args.k} warps={warps or '-'}: {us:8.2f} µs", flush=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
