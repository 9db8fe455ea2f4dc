"""One full-width V4-Flash MoE layer on a GPU: fused decode path vs grouped path, grouped prefill.

    python -m benchmarks.moe_bench --out moe_bench.json          # ~3 min on an H100 (--quick: ~1 min)

Layer: hidden 4096, 256 routed experts top-6 (FP4 e2m1 + UE8M0/32 by default, `--fmt fp8` for FP8
128×128) + 1 shared expert (FP8), moe_intermediate 2048, random weights made on the GPU
(`MoE.random_packed`), score routing on fresh random bf16 inputs per case.

Cases: T = 1, 64, 256 through the fused decode path and the grouped path (same routing), and
T = 8192 through the grouped path and the FP4 prefill path (kernels/moe/moe_prefill.py). Times are
`triton.testing.do_bench` medians of the experts
(sort + kernels, given the routing); decode cases also time a CUDA-graph replay of the fused
path and of the whole layer (gate + experts), which is what a captured decode step sees.

Ceilings, measured in the same run: a device-to-device copy (bytes read + written per second) and
a bf16 8192³ `torch.matmul`. Each case reports bytes read (every hit expert's weights and scales,
the shared expert, x in and out written; h and y scratch not counted), GB/s and its fraction of
the copy rate, FLOP (2·3·D·I per routed and shared assignment), TFLOP/s and its fraction of the
matmul rate. Decode is judged on bandwidth, prefill on FLOP rate (target ≥ 0.4).

Tile sweeps (`SWEEP`) run each case over a few tile choices and report the best beside the
default table's. Everything lands in the JSON file; a table is printed last. Importable: the
whole-decode-step benchmark builds its layer with `flash_config` / `build_layer`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import asdict, replace

import torch

from model.config import ModelConfig
from model.kernels.moe import moe_fused, moe_grouped, moe_prefill
from model.kernels.moe.moe_grouped import Tiles
from model.moe import MoE
from model.tiny import tiny_config

DECODE_TOKENS = (1, 64, 256)
PREFILL_TOKENS = 8192
# (gate/up, down) tile alternatives per path; the first is the default table's.
SWEEP = {
    "fused": [
        (moe_fused.DECODE_GATEUP, moe_fused.DECODE_DOWN),
        (replace(moe_fused.DECODE_GATEUP, num_stages=4), replace(moe_fused.DECODE_DOWN, BN=64, num_stages=4)),
        (replace(moe_fused.DECODE_GATEUP, num_stages=2), replace(moe_fused.DECODE_DOWN, num_stages=2)),
        (replace(moe_fused.DECODE_GATEUP, BN=128, num_warps=8), replace(moe_fused.DECODE_DOWN, BN=128, num_warps=8)),
        # more, narrower programs: a few-token step hits ~7 experts, too few 64-row programs to fill the SMs
        (replace(moe_fused.DECODE_GATEUP, BN=32), replace(moe_fused.DECODE_DOWN, BN=64)),
        (replace(moe_fused.DECODE_GATEUP, BN=32, num_stages=4), replace(moe_fused.DECODE_DOWN, BN=32, num_stages=4)),
        (replace(moe_fused.DECODE_GATEUP, BN=16, num_stages=4), replace(moe_fused.DECODE_DOWN, BN=32, num_stages=4)),
        (replace(moe_fused.DECODE_GATEUP, num_stages=5), replace(moe_fused.DECODE_DOWN, BN=64, num_stages=5)),
    ],
    "grouped": [
        (moe_grouped.GROUPED_GATEUP, moe_grouped.GROUPED_DOWN),
        (replace(moe_grouped.GROUPED_GATEUP, BN=128), moe_grouped.GROUPED_DOWN),
        (replace(moe_grouped.GROUPED_GATEUP, BT=64, num_warps=4),
         replace(moe_grouped.GROUPED_DOWN, BT=64, num_warps=4)),
        (replace(moe_grouped.GROUPED_GATEUP, BK=128, num_stages=2),
         replace(moe_grouped.GROUPED_DOWN, BK=128, num_stages=2)),
        (replace(moe_grouped.GROUPED_GATEUP, num_stages=4), replace(moe_grouped.GROUPED_DOWN, num_stages=4)),
    ],
    "prefill": [
        (moe_prefill.PREFILL_GATEUP, moe_prefill.PREFILL_DOWN),
        (replace(moe_prefill.PREFILL_GATEUP, BN=64, num_warps=4), moe_prefill.PREFILL_DOWN),
        (moe_prefill.PREFILL_GATEUP, replace(moe_prefill.PREFILL_DOWN, BN=128)),
        (moe_prefill.PREFILL_GATEUP, replace(moe_prefill.PREFILL_DOWN, BT=256)),
        (replace(moe_prefill.PREFILL_GATEUP, num_stages=4), replace(moe_prefill.PREFILL_DOWN, num_stages=4)),
        (replace(moe_prefill.PREFILL_GATEUP, num_stages=2), replace(moe_prefill.PREFILL_DOWN, num_stages=2)),
        (replace(moe_prefill.PREFILL_GATEUP, BK=64), replace(moe_prefill.PREFILL_DOWN, BK=64)),
        (replace(moe_prefill.PREFILL_GATEUP, BT=64), replace(moe_prefill.PREFILL_DOWN, BT=64)),
    ],
}


# ---------------------------------------------------------------------------------------
# setup (importable)
# ---------------------------------------------------------------------------------------

def flash_config(**overrides) -> ModelConfig:
    """V4-Flash MoE widths on the tiny config's other fields (only the MoE's matter here)."""
    return tiny_config(hidden_size=4096, moe_intermediate_size=2048, n_routed_experts=256,
                       num_experts_per_tok=6, **overrides)


def build_layer(fmt: str = "fp4", impl: str = "triton", device: str = "cuda", seed: int = 0,
                layer: int = 4) -> MoE:
    """A full-width MoE layer with random packed weights on `device` (layer 4 of the tiny layout:
    score-routed, not the MTP block, so the fused path applies)."""
    return MoE.random_packed(flash_config(), layer=layer, fmt=fmt, impl=impl, device=device, seed=seed)


def routed_inputs(moe: MoE, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh bf16 x [T, D] (unit rms, like a normed hidden state), token ids, and its routing."""
    device = moe.experts.w13.device
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, moe.cfg.hidden_size, device=device, generator=g).to(torch.bfloat16)
    tok = torch.randint(0, moe.cfg.vocab_size, (T,), device=device, generator=g)
    weights, ids = moe.gate(x, tok)
    return x, tok, weights, ids


def expert_bytes(moe: MoE) -> int:
    """Bytes of one routed expert (codes + scales)."""
    p = moe.experts
    return sum(t[0].numel() * t.element_size() for t in (p.w13, p.w13_scale, p.w2, p.w2_scale))


def bytes_read(moe: MoE, x: torch.Tensor, ids: torch.Tensor) -> int:
    """The floor for a pass over the experts: each hit expert and the shared expert read once,
    x read and the output written once."""
    shared = 0
    if moe.shared_experts is not None:
        p = moe.shared_experts
        shared = sum(t.numel() * t.element_size() for t in (p.w13, p.w13_scale, p.w2, p.w2_scale))
    hit = int(torch.unique(ids).numel())
    return hit * expert_bytes(moe) + shared + 2 * x.numel() * x.element_size()


def flop(moe: MoE, T: int) -> float:
    D, I, k = moe.cfg.hidden_size, moe.cfg.moe_intermediate_size, moe.cfg.num_experts_per_tok
    return 2.0 * 3 * D * I * T * (k + (moe.shared_experts is not None))


def ceilings(device: str = "cuda") -> dict:
    """Device-to-device copy rate (bytes read + written per s) and bf16 8192³ matmul rate, measured now."""
    from triton.testing import do_bench
    n = 1 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    del src, dst
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "matmul_TFLOPs": 2 * 8192 ** 3 / mm_ms / 1e9}


# ---------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------

def _experts_fn(moe: MoE, path: str, x, weights, ids, tiles: tuple[Tiles, Tiles]):
    args = (x, weights, ids, moe.experts, moe.shared_experts, moe.cfg.swiglu_limit)
    if path == "fused":
        return lambda: moe_fused.fused_moe(*args, *tiles)
    if path == "prefill":
        return lambda: moe_prefill.prefill_moe(*args, *tiles)
    return lambda: moe_grouped.grouped_moe(*args, "triton", *tiles)


def _graph_ms(fn, static_inputs: list[torch.Tensor], fresh: list[torch.Tensor]) -> float:
    """Median replay time of `fn` captured in a CUDA graph (inputs copied into its static buffers)."""
    from triton.testing import do_bench
    for s, f in zip(static_inputs, fresh):
        s.copy_(f)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median")


def bench_case(moe: MoE, path: str, T: int, seed: int, ceil: dict, n_tiles: int) -> dict:
    from triton.testing import do_bench
    x, tok, weights, ids = routed_inputs(moe, T, seed)
    nbytes, nflop = bytes_read(moe, x, ids), flop(moe, T)
    row = {"path": path, "T": T, "fmt": moe.experts.fmt, "bytes": nbytes, "flop": nflop,
           "hit_experts": int(torch.unique(ids).numel())}
    results = []
    for tiles in SWEEP[path][:n_tiles]:
        entry = {"gateup": asdict(tiles[0]), "down": asdict(tiles[1])}
        try:
            fn = _experts_fn(moe, path, x, weights, ids, tiles)
            fn()
            torch.cuda.synchronize()
            entry["ms"] = do_bench(fn, warmup=10, rep=100, return_mode="median")
        except Exception as e:  # a tile choice that fails to compile or launch is reported, not fatal
            entry["error"] = f"{type(e).__name__}: {e}"[:400]
        results.append(entry)
    row["tiles"] = results
    ok = [r for r in results if "ms" in r]
    if not ok:
        row["error"] = results[0].get("error", "no tile choice ran")
        return row
    best = min(ok, key=lambda r: r["ms"])
    row["ms_default"] = results[0].get("ms")
    row["ms"] = best["ms"]
    row["best_tiles"] = {"gateup": best["gateup"], "down": best["down"]}
    row.update(_rates(row["ms"], nbytes, nflop, ceil))
    if path == "fused":  # what a captured decode step sees: no launch gaps
        try:
            gu, dn = Tiles(**best["gateup"]), Tiles(**best["down"])
            sx, sw, si = x.clone(), weights.clone(), ids.clone()
            row["graph_ms"] = _graph_ms(_experts_fn(moe, path, sx, sw, si, (gu, dn)), [sx, sw, si], [x, weights, ids])
            row.update({f"graph_{k}": v for k, v in _rates(row["graph_ms"], nbytes, nflop, ceil).items()})
            stok = tok.clone()
            row["layer_graph_ms"] = _graph_ms(lambda: moe(sx, stok), [sx, stok], [x, tok])
        except Exception as e:
            row["graph_error"] = f"{type(e).__name__}: {e}"[:400]
    return row


def _rates(ms: float, nbytes: int, nflop: float, ceil: dict) -> dict:
    gbps, tflops = nbytes / ms / 1e6, nflop / ms / 1e9
    return {"GBps": gbps, "frac_copy": gbps / ceil["copy_GBps"], "TFLOPs": tflops,
            "frac_matmul": tflops / ceil["matmul_TFLOPs"]}


def check_parity(moe: MoE, path: str, T: int, seed: int) -> float:
    """Relative error of the path against the fp32 torch reference on fresh inputs (sanity, not the test)."""
    x, _, weights, ids = routed_inputs(moe, T, seed)
    got = _experts_fn(moe, path, x, weights, ids, SWEEP[path][0])().float()
    want = moe_grouped.reference(x, weights, ids, moe.experts, moe.shared_experts, moe.cfg.swiglu_limit).float()
    return float((got - want).norm() / want.norm())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="moe_bench.json", help="JSON results path")
    ap.add_argument("--fmt", default="fp4", choices=("fp4", "fp8"), help="routed expert format")
    ap.add_argument("--quick", action="store_true", help="default tiles only (no sweep)")
    ap.add_argument("--tiles", type=int, default=0, help="only the first N tile choices of each sweep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fused-only", action="store_true", help="only the fused decode cases (tile sweep)")
    ap.add_argument("--prefill-only", action="store_true", help="only T=8192: grouped against the prefill path")
    ap.add_argument("--tokens", default=",".join(map(str, DECODE_TOKENS)), help="decode token counts, comma-separated")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_bench: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fmt": args.fmt,
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import triton
        report["triton"] = triton.__version__
        report["ceilings"] = ceil = ceilings()
        moe = build_layer(args.fmt, seed=args.seed)
        report["expert_MB"] = expert_bytes(moe) / 1e6
    except Exception:
        report["error"] = traceback.format_exc()
        _write(args.out, report)
        print(report["error"], file=sys.stderr)
        return 1
    rows, seed = [], args.seed + 1
    decode = [int(t) for t in args.tokens.split(",")]
    cases = [("fused", T) for T in decode]
    if not args.fused_only:
        cases += [("grouped", T) for T in (*decode, PREFILL_TOKENS)]
    cases.append(("prefill", PREFILL_TOKENS))
    if args.prefill_only:
        cases = [("grouped", PREFILL_TOKENS), ("prefill", PREFILL_TOKENS)]
    elif args.fused_only:
        cases.pop()
    for path, T in cases:
        seed += 1
        try:
            row = bench_case(moe, path, T, seed, ceil, 1 if args.quick else args.tiles or len(SWEEP[path]))
            row["rel_err_vs_reference"] = check_parity(moe, path, min(T, 1024), seed + 1000)
        except Exception:
            row = {"path": path, "T": T, "error": traceback.format_exc()[-2000:]}
        rows.append(row)
        _write(args.out, {**report, "cases": rows})
        print(f"  {path:7s} T={T:5d}: " + (f"{row['ms']:.3f} ms" if "ms" in row else "error"), flush=True)
    _write(args.out, {**report, "cases": rows})
    _print_table(report, rows)
    return 0 if all("error" not in r for r in rows) else 1


def _write(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)


def _print_table(report: dict, rows: list[dict]) -> None:
    c = report["ceilings"]
    print(f"\n{report['device']}  torch {report['torch']}  triton {report.get('triton')}  experts {report['fmt']}")
    print(f"ceilings: copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['matmul_TFLOPs']:.0f} TFLOP/s")
    head = (f"{'path':8s}{'T':>6s}{'hit':>5s}{'ms':>9s}{'default':>9s}{'graph':>9s}{'layer':>9s}{'GB':>8s}"
            f"{'GB/s':>8s}{'×copy':>7s}{'TFLOP/s':>9s}{'×mm':>6s}{'err':>9s}")
    print(head)
    for r in rows:
        if "ms" not in r:
            print(f"{r['path']:8s}{r['T']:6d}  error: {r.get('error', '')[-200:]!r}")
            continue
        fmt = lambda v, w, p: f"{v:{w}.{p}f}" if isinstance(v, (int, float)) else f"{'-':>{w}s}"
        print(f"{r['path']:8s}{r['T']:6d}{r['hit_experts']:5d}{fmt(r['ms'], 9, 3)}{fmt(r.get('ms_default'), 9, 3)}"
              f"{fmt(r.get('graph_ms'), 9, 3)}{fmt(r.get('layer_graph_ms'), 9, 3)}{r['bytes'] / 1e9:8.3f}"
              f"{r['GBps']:8.0f}{r['frac_copy']:7.2f}{r['TFLOPs']:9.1f}{r['frac_matmul']:6.2f}"
              f"{fmt(r.get('rel_err_vs_reference'), 9, 4)}")


if __name__ == "__main__":
    sys.exit(main())
