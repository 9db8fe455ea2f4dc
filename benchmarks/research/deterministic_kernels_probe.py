"""Where `--deterministic`'s decode-step cost goes: the same decode step replayed from a graph
captured in each mode, profiled kernel by kernel, and the per-kernel time of the two modes side by
side (µs a replay, summed over a kernel's launches), largest difference first.

    python benchmarks/research/deterministic_kernels_probe.py --out k.json [--layers 8] [--batches 1 64]

Kernel times are the profiler's, which adds little to a replay; the step's own cost is
deterministic_cost_bench.py's figure.

`--tiles` first asks whether a row's bits depend on the M tile at all: the fixed-tile product
(`fixed_matmul`) at other row and weight tiles, warps and stages, each compared bit for bit with
its own configuration, K order unchanged. Every row equal is what lets the mode's kernels choose
their tiles by the step and fix only the K order.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.decode_step_bench import STEPS  # noqa: E402
from benchmarks.flash_model import decode_batches, decode_pools, stack  # noqa: E402
from benchmarks.research.step_timeline import kernels_of_trace  # noqa: E402
from model.cuda_graph import DecodeGraph  # noqa: E402
from model.kernels import set_deterministic  # noqa: E402


def kernel_us(model, batch: int, context: int, layers: int, replays: int) -> dict[str, dict]:
    """Per kernel name: launches and µs a replay of one decode step's graph."""
    pools, seqs = decode_pools(model.cfg, layers, batch, context - STEPS, steps=STEPS)
    graph = DecodeGraph(model, pools, batch_size=batch, max_context=context + 1)
    graph.run(decode_batches(seqs, STEPS)[0])
    for _ in range(3):
        graph.graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        kernels = kernels_of_trace(json.loads(Path(f"{tmp}/trace.json").read_text()))
    graph.close()
    out: dict[str, dict] = {}
    for k in kernels:
        row = out.setdefault(k.name, {"calls": 0, "us": 0.0})
        row["calls"] += 1
        row["us"] += k.end - k.start
    for row in out.values():
        row["calls"] //= replays
        row["us"] /= replays
    return out


def tile_bits(M: int = 200, N: int = 4096, K: int = 4096) -> list[dict]:
    """Rows of x · wᵀ under other tile shapes, against `fixed_matmul.config`'s, bit for bit."""
    from model.kernels.gemm import fixed_matmul as fm

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
    ref = fm.linear(x, w, torch.float32)
    out = []
    for bm, bn, warps, stages in [(16, 128, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), (64, 256, 8, 3),
                                  (128, 128, 8, 3), (128, 128, 4, 3), (128, 256, 8, 4), (64, 32, 4, 3)]:
        y = fm.linear(x, w, torch.float32, split=False,
                      tiles={"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages})
        equal_rows = int((y == ref).all(dim=1).sum())
        out.append({"block_m": bm, "block_n": bn, "warps": warps, "stages": stages, "rows": M,
                    "rows_equal": equal_rows, "max_abs_diff": float((y - ref).abs().max())})
        print(f"tiles {bm}x{bn} warps {warps} stages {stages}: {equal_rows}/{M} rows bit-equal, "
              f"max |diff| {out[-1]['max_abs_diff']:.3g}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--tiles", action="store_true", help="first the tile-shape bit test")
    args = ap.parse_args()
    tiles = tile_bits() if args.tiles else None
    model = stack(args.layers, act_fp8=True)
    result = {"device": torch.cuda.get_device_name(0), "layers": args.layers, "context": args.context, "batches": {},
              "tiles": tiles}
    for batch in args.batches:
        modes = {}
        for det in (False, True):
            set_deterministic(model, det)
            modes["deterministic" if det else "default"] = kernel_us(model, batch, args.context, args.layers,
                                                                     args.replays)
            torch.cuda.empty_cache()
        set_deterministic(model, False)
        names = set(modes["default"]) | set(modes["deterministic"])
        rows = []
        for name in names:
            a = modes["default"].get(name, {"calls": 0, "us": 0.0})
            b = modes["deterministic"].get(name, {"calls": 0, "us": 0.0})
            rows.append({"kernel": name, "calls": a["calls"], "us": a["us"], "det_calls": b["calls"],
                         "det_us": b["us"], "delta_us": b["us"] - a["us"]})
        rows.sort(key=lambda r: -abs(r["delta_us"]))
        total = {m: sum(r["us"] for r in modes[m].values()) for m in modes}
        print(f"B={batch}: kernel time a replay {total['default']:.0f} µs, deterministic "
              f"{total['deterministic']:.0f} µs", flush=True)
        for r in rows[:16]:
            print(f"  {r['delta_us']:+8.1f} µs  {r['us']:7.1f} ({r['calls']:3d}) -> {r['det_us']:7.1f} "
                  f"({r['det_calls']:3d})  {r['kernel']}", flush=True)
        result["batches"][str(batch)] = {"kernel_us_total": total, "kernels": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
