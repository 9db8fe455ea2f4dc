"""Fused decode MoE tile choices, per kernel, over many full-width V4-Flash layers in turn.

    python benchmarks/research/moe_tiles_bench.py --out moe_tiles.json [--layers 12] [--variants default,down_stages2]

Unlike benchmarks/moe_bench.py (one layer, replayed), each variant runs a CUDA graph of `--layers`
different layers (random FP4 experts, each layer routed by its own gate), as a decode step meets
them, and the same layer `--layers` times for comparison; torch.profiler splits the graph's time
per kernel (count sort, gate/up, down). Fraction of copy: the hit experts' bytes (and the shared
expert's) over the time, against a device-to-device copy measured in the same run. Pre-ordered
variants make their `preorder` copy of x in the counting sort's launch; the `fused*` variants
capture `moe_fused.fused_moe` whole, as the decode step runs it (copy and dense shared expert in).
`META_VARIANTS` add launch options (register caps) to another variant's two kernels. The run
ends by listing each compiled kernel's registers, spills and shared memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.moe_bench import build_layer, bytes_read, ceilings, routed_inputs  # noqa: E402
from model.kernels.moe import moe_fused  # noqa: E402
from model.kernels.moe.moe_grouped import Launch, Tiles, fit, plan_kernels  # noqa: E402

GU, DN = moe_fused.DECODE_GATEUP, moe_fused.DECODE_DOWN
SG, SD = moe_fused.SMALL_GATEUP, moe_fused.SMALL_DOWN
# name → (gate/up tiles, down tiles, with the shared expert, activations in `preorder`'s layout)
VARIANTS = {
    "default": (GU, DN, True, True),
    "natural_order": (GU, DN, True, False),
    "no_shared": (GU, DN, False, True),
    # the decode step's own kernels (the shared expert dense, beside them) with other down tiles
    "no_shared_down_bn64": (GU, replace(DN, BN=64), False, True),
    "no_shared_down_stages2": (GU, replace(DN, num_stages=2), False, True),
    "no_shared_down_stages4": (GU, replace(DN, num_stages=4), False, True),
    "no_shared_down_w8": (GU, replace(DN, num_warps=8), False, True),
    "no_shared_down_bk64": (GU, replace(DN, BK=64), False, True),
    "stages2": (replace(GU, num_stages=2), replace(DN, num_stages=2), True, True),
    "stages4": (replace(GU, num_stages=4), replace(DN, num_stages=4), True, True),
    "down_bn64": (GU, replace(DN, BN=64), True, True),
    "down_bn64_stages2": (GU, replace(DN, BN=64, num_stages=2), True, True),
    "down_stages2": (GU, replace(DN, num_stages=2), True, True),
    "gateup_bn32": (replace(GU, BN=32), DN, True, True),
    "gateup_bn128_w8": (replace(GU, BN=128, num_warps=8), DN, True, True),
    "gateup_stages4": (replace(GU, num_stages=4), DN, True, True),
    "gateup_settle": (replace(GU, settle=True), DN, True, True),
    "gateup_stages4_settle": (replace(GU, num_stages=4, settle=True), DN, True, True),
    "down_stages4": (GU, replace(DN, num_stages=4), True, True),
    "down_w8": (GU, replace(DN, num_warps=8), True, True),
    "down_bn256_w8": (GU, replace(DN, BN=256, num_warps=8), True, True),
    # the tiles of steps of up to SMALL_T tokens (split K), and their alternatives
    "small": (SG, SD, False, True),
    "small_gateup_stages4": (replace(SG, num_stages=4), SD, False, True),
    "small_gateup_stages3": (replace(SG, num_stages=3), SD, False, True),
    "small_gateup_settle": (replace(SG, settle=True), SD, False, True),
    "small_gateup_stages3_settle": (replace(SG, num_stages=3, settle=True), SD, False, True),
    "small_gateup_stages4_settle": (replace(SG, num_stages=4, settle=True), SD, False, True),
    "small_gateup_stages3_settle_split2": (replace(SG, num_stages=3, settle=True, split_k=2), SD, False, True),
    "small_gateup_stages4_settle_split2": (replace(SG, num_stages=4, settle=True, split_k=2), SD, False, True),
    "small_stages3_settle_down_stages4_settle": (replace(SG, num_stages=3, settle=True), replace(SD, settle=True),
                                                 False, True),
    "small_gateup_split2": (replace(SG, split_k=2), SD, False, True),
    "small_gateup_unsplit": (replace(SG, split_k=1, num_stages=4), SD, False, True),
    "small_down_stages2": (SG, replace(SD, num_stages=2), False, True),
    "small_gateup_split8": (replace(SG, split_k=8), SD, False, True),
    "small_gateup_bn32": (replace(SG, BN=32), SD, False, True),
    "small_gateup_bn32_split2": (replace(SG, BN=32, split_k=2), SD, False, True),
    "small_gateup_w8_bn128": (replace(SG, BN=128, num_warps=8), SD, False, True),
    "small_down_split4": (SG, replace(SD, split_k=4), False, True),
    "small_down_split1": (SG, replace(SD, split_k=1), False, True),
    "small_down_bn32": (SG, replace(SD, BN=32), False, True),
    "small_down_bn128_w8": (SG, replace(SD, BN=128, num_warps=8), False, True),
    "small_down_stages3": (SG, replace(SD, num_stages=3), False, True),
    "small_down_stages3_split4": (SG, replace(SD, num_stages=3, split_k=4), False, True),
    "small_down_stages2_split4": (SG, replace(SD, num_stages=2, split_k=4), False, True),
    "small_gateup_cap72": (replace(SG, maxnreg=72), SD, False, True),
    "small_gateup_cap64": (replace(SG, maxnreg=64), SD, False, True),
    "small_gateup_split2_down_split1": (replace(SG, split_k=2), replace(SD, split_k=1), False, True),
    "few": (moe_fused.FEW_GATEUP, moe_fused.FEW_DOWN, False, True),
    "small_down_uncapped": (SG, replace(SD, maxnreg=None), False, True),
    "small_down_unsettled": (SG, replace(SD, settle=False), False, True),
    "down_unsettled": (GU, replace(DN, settle=False), True, True),
    "gateup_unsettled": (replace(GU, settle=False), DN, True, True),
}
# name → launch options added to a VARIANTS entry's gate/up and down launches (register caps)
META_VARIANTS = {"small_regs96": ("small", {"maxnreg": 96}), "small_regs80": ("small", {"maxnreg": 80}),
                 "small_regs72": ("small", {"maxnreg": 72}),
                 "small_stages3_regs96": ("small_gateup_stages3", {"maxnreg": 96}),
                 "regs96": ("default", {"maxnreg": 96}), "regs80": ("default", {"maxnreg": 80})}
# name → (`fused_moe`'s shared_dense, the priority of a side stream for the dense shared expert or
# None): the whole call captured as the decode step runs it (the `preorder` copy and, dense, the
# shared expert's products and SwiGLU included), decode tiles
FUSED_VARIANTS = {"fused": (None, None), "fused_shared_in_kernels": (False, None), "fused_shared_dense": (True, None),
                  "fused_shared_stream": (None, 0), "fused_shared_stream_high": (None, -1),
                  "fused_shared_dense_high": (True, -1)}


def plan_fused(moe, T: int, seed: int, dense: bool | None, side: torch.cuda.Stream | None) -> tuple[list, int]:
    x, _, weights, ids = routed_inputs(moe, T, seed)
    args = (x, weights, ids, moe.experts, moe.shared_experts, moe.cfg.swiglu_limit)
    return [lambda: moe_fused.fused_moe(*args, shared_dense=dense, side=side)], bytes_read(moe, x, ids)


def plan(moe, T: int, seed: int, gateup: Tiles, down: Tiles, shared: bool, pre: bool) -> tuple[list[Launch], int]:
    x, _, weights, ids = routed_inputs(moe, T, seed)
    ex = moe.experts
    launches, _ = plan_kernels(x, weights, ids, ex, moe.shared_experts if shared else None,
                               moe.cfg.swiglu_limit, fit(gateup, ex.inter, ex.dim), fit(down, ex.dim, ex.inter),
                               fuse_combine=True, preordered=pre)
    return launches, bytes_read(moe, x, ids)


def graph_ms(launches: list[Launch], reps: int = 20) -> tuple[float, dict]:
    """Median replay time of one graph of `launches`, and its CUDA time per kernel name (one replay)."""
    from torch.profiler import ProfilerActivity, profile
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for launch in launches:
            launch()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.device_time_total / 1e3
    return sorted(times)[len(times) // 2], per_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="moe_tiles.json")
    ap.add_argument("--layers", type=int, default=12, help="distinct layers (3.4 GB each)")
    ap.add_argument("--tokens", default="64,256")
    ap.add_argument("--variants", default=",".join([*VARIANTS, *FUSED_VARIANTS]))
    args = ap.parse_args()
    ceil = ceilings()
    layers = [build_layer(seed=i) for i in range(args.layers)]
    rows = []
    for T in map(int, args.tokens.split(",")):
        for name in args.variants.split(","):
            if name in FUSED_VARIANTS:
                gateup, down = moe_fused.decode_tiles(T)
                shared, priority = FUSED_VARIANTS[name]
                side = None if priority is None else torch.cuda.Stream(priority=priority)
                pre = True
                planned = [plan_fused(m, T, 100 + i, shared, side) for i, m in enumerate(layers)]
            else:
                base, meta = META_VARIANTS.get(name, (name, {}))
                gateup, down, shared, pre = VARIANTS[base]
                planned = [plan(m, T, 100 + i, gateup, down, shared, pre) for i, m in enumerate(layers)]
                for launches, _ in planned:
                    for launch in launches[-2:]:  # gate/up and down
                        launch.meta.update(meta)
            n = len(layers)
            rot_ms, rot_k = graph_ms([launch for launches, _ in planned for launch in launches])
            same_ms, _ = graph_ms([launch for _ in range(n) for launch in planned[0][0]])
            nbytes = sum(b for _, b in planned) / n
            row = dict(T=T, variant=name, gateup=asdict(gateup), down=asdict(down), shared=shared, preordered=pre,
                       ms_per_layer=rot_ms / n, same_layer_ms=same_ms / n,
                       kernels_ms={k: v / n for k, v in rot_k.items()},
                       frac_copy=nbytes / (rot_ms / n * 1e-3) / (ceil["copy_GBps"] * 1e9))
            rows.append(row)
            print(f"T={T:4d} {name:22s} {row['ms_per_layer']:.3f} ms/layer (same layer {row['same_layer_ms']:.3f})"
                  f"  {row['frac_copy']:.0%} of copy  " + "  ".join(f"{k} {v:.3f}" for k, v in row["kernels_ms"].items()),
                  flush=True)
    Path(args.out).write_text(json.dumps(dict(ceilings=ceil, device=torch.cuda.get_device_name(), rows=rows,
                                              compiled=compiled_kernels()), indent=1))


def compiled_kernels() -> list[dict]:
    """Warps, stages, shared memory, registers and spills of every kernel of `moe_tile_kernels`
    (count sort, gate/up, down) compiled in this run (in compile order: the variants' order)."""
    from triton.runtime.jit import JITFunction

    from model.kernels.moe import moe_tile_kernels
    out = []
    for fn in [f for f in vars(moe_tile_kernels).values() if isinstance(f, JITFunction)]:
        for cache in getattr(fn, "device_caches", {}).values():
            for compiled in cache[0].values():
                md = compiled.metadata
                out.append(dict(kernel=fn.__name__, warps=md.num_warps, stages=md.num_stages, shared=md.shared,
                                regs=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None)))
    for row in out:
        print(row, flush=True)
    return out


if __name__ == "__main__":
    main()
