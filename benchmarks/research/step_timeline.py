"""Where a decode step's time goes on the GPU's timeline: CUDA-graph replays profiled kernel by
kernel, per stream, split into what the main chain was doing.

    python benchmarks/research/step_timeline.py --out t.json [--batch 1] [--context 8192] [--layers 15]

A step's kernels run on the graph's streams: the main chain (the stream with the most kernels)
and the side streams (the entries' post / comb, the compressors, the dense shared expert). Each
replay's wall time (first kernel start to last kernel end) splits into

* main busy: a main-stream kernel is running;
* side only: no main-stream kernel, a side kernel running: the main chain waits (at a join, or
  for the launch of its next kernel) while side work runs;
* all idle: no kernel anywhere: launch and dependency latency alone.

The stream ids are the profiler's: in graph replays it reports each branch of the graph under a
stream of its own, which need not be the stream it was captured on (on H100 / H200 the entries,
attention and MoE of one layer came out on different ids), so the split can mislabel work; it
warns when the "main" stream's kernels overlap. Per-layer spans (`--marker`, each layer's first
sub-block entry to the next layer's) need no stream ids.

Removing a main-stream kernel shortens the step only by the part of it that is not covered by
side work: the split says how much of each kind there is. Printed with the longest gaps of the
main chain and the kernels around them; the JSON holds the split of every replay, per-kernel
times on the timeline (PDL and concurrency included, unlike the eager profile) and the median
replay's intervals.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


@dataclass(frozen=True)
class Kernel:
    name: str
    stream: int
    start: float  # µs
    end: float  # µs


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of [start, end) intervals as disjoint sorted intervals."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of [lo, hi) covered by disjoint sorted `intervals`."""
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in intervals)


def analyse(kernels: list[Kernel], top: int = 12) -> dict:
    """The split of one replay's kernels (see the module docstring), µs; `top` longest main gaps."""
    if not kernels:
        raise ValueError("no kernels to analyse")
    streams: dict[int, list[Kernel]] = {}
    for k in kernels:
        streams.setdefault(k.stream, []).append(k)
    main = max(streams, key=lambda s: (len(streams[s]), sum(k.end - k.start for k in streams[s])))
    chain = sorted(streams[main], key=lambda k: k.start)
    main_iv = merged([(k.start, k.end) for k in chain])
    side_iv = merged([(k.start, k.end) for s, ks in streams.items() if s != main for k in ks])
    any_iv = merged(main_iv + side_iv)
    t0, t1 = min(k.start for k in kernels), max(k.end for k in kernels)
    main_busy = sum(e - s for s, e in main_iv)
    any_busy = sum(e - s for s, e in any_iv)
    gaps = []
    for prev, nxt in zip(chain, chain[1:]):
        if nxt.start > prev.end:
            gaps.append({"after": prev.name, "before": nxt.name, "us": nxt.start - prev.end,
                         "side_busy_us": covered(side_iv, prev.end, nxt.start)})
    waits: dict[str, float] = {}
    for g in gaps:
        waits[g["before"]] = waits.get(g["before"], 0.0) + g["us"]
    # kernels of one stream never overlap; if the main stream's do, the trace gave a graph's
    # branches one stream id and the split below means nothing
    self_overlap = sum(k.end - k.start for k in chain) - main_busy
    return {"wall_us": t1 - t0, "main_busy_us": main_busy, "side_only_us": any_busy - main_busy,
            "main_self_overlap_us": self_overlap,
            "all_idle_us": (t1 - t0) - any_busy,
            "overlap_us": sum(covered(side_iv, s, e) for s, e in main_iv),
            "streams": {str(s): {"kernels": len(ks), "busy_us": sum(e - b for b, e in merged(
                [(k.start, k.end) for k in ks]))} for s, ks in streams.items()},
            "main_stream": main, "main_gaps": len(gaps), "main_gap_us": sum(g["us"] for g in gaps),
            "longest_gaps": sorted(gaps, key=lambda g: -g["us"])[:top],
            "wait_before": dict(sorted(waits.items(), key=lambda kv: -kv[1])[:top])}


def layer_spans(kernels: list[Kernel], marker: str, per_layer: int) -> list[float]:
    """Each layer's span of one replay, µs: from a layer's first `marker` kernel (every
    `per_layer`-th start of that kernel) to the next layer's, the last layer's to the replay's end.
    Unlike the stream split, it needs no stream ids: a layer's time, whatever ran in it."""
    starts = sorted(k.start for k in kernels if k.name == marker)
    if not starts or len(starts) % per_layer:
        raise ValueError(f"{len(starts)} {marker} kernels do not make layers of {per_layer}")
    firsts = starts[::per_layer] + [max(k.end for k in kernels)]
    return [b - a for a, b in zip(firsts, firsts[1:])]


def kernels_of_trace(trace: dict) -> list[Kernel]:
    """The kernel events of a torch.profiler Chrome trace."""
    return [Kernel(e["name"][:60], int(e.get("args", {}).get("stream", e.get("tid", 0))), float(e["ts"]),
                   float(e["ts"]) + float(e["dur"]))
            for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]


def replays(kernels: list[Kernel], n: int) -> list[list[Kernel]]:
    """Kernels of `n` back-to-back replays of one graph, split by order of start (replays on one
    stream do not overlap; each holds the same kernels)."""
    if len(kernels) % n:
        raise ValueError(f"{len(kernels)} kernels do not split into {n} replays of one graph")
    ordered = sorted(kernels, key=lambda k: k.start)
    per = len(ordered) // n
    return [ordered[i * per:(i + 1) * per] for i in range(n)]


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.decode_step_bench import STEPS
    from benchmarks.flash_model import decode_batches, decode_pools, stack
    from model.cuda_graph import DecodeGraph

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--marker", default="_entry_small_kernel", help="a kernel that starts every layer's sub-blocks")
    ap.add_argument("--per-layer", type=int, default=2, help="how many times --marker runs a layer")
    args = ap.parse_args()
    model = stack(args.layers, act_fp8=True)
    pools, seqs = decode_pools(model.cfg, args.layers, args.batch, args.context - STEPS, steps=STEPS)
    fb = decode_batches(seqs, STEPS)[0]
    graph = DecodeGraph(model, pools, batch_size=args.batch, max_context=args.context + 1)
    graph.run(fb)
    for _ in range(3):
        graph.graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            graph.graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        trace = json.loads(Path(f"{tmp}/trace.json").read_text())
    runs = replays(kernels_of_trace(trace), args.replays)
    splits = [analyse(r) for r in runs]
    median = sorted(range(len(splits)), key=lambda i: splits[i]["wall_us"])[len(splits) // 2]
    per_kernel: dict[str, list[float]] = {}
    for r in runs:
        for k in r:
            per_kernel.setdefault(k.name, []).append(k.end - k.start)
    s = splits[median]
    print(f"B={args.batch} ctx={args.context}, {args.layers} layers, median of {args.replays} replays: "
          f"{s['wall_us']:.0f} µs = main busy {s['main_busy_us']:.0f} + side only {s['side_only_us']:.0f} "
          f"+ all idle {s['all_idle_us']:.0f} (main and side overlapping {s['overlap_us']:.0f}); "
          f"{s['main_gaps']} gaps on the main stream, {s['main_gap_us']:.0f} µs", flush=True)
    if s["main_self_overlap_us"] > 0:
        print(f"  warning: main-stream kernels overlap by {s['main_self_overlap_us']:.0f} µs: the trace does not "
              f"tell the graph's branches apart, so the split above is not meaningful", flush=True)
    for g in s["longest_gaps"]:
        print(f"  gap {g['us']:6.1f} µs (side busy {g['side_busy_us']:5.1f}) after {g['after']} before {g['before']}")
    for name, us in s["wait_before"].items():
        print(f"  waited {us:7.1f} µs in all before {name}")
    spans = layer_spans(runs[median], args.marker, args.per_layer)
    print("  layers (µs, from one --marker to the next layer's): " + " ".join(f"{x:.1f}" for x in spans))
    result = {"batch": args.batch, "context": args.context, "layers": args.layers,
              "device": torch.cuda.get_device_name(), "splits": splits, "median_replay": median,
              "kernel_us": {n: {"calls": len(v) // args.replays, "median": statistics.median(v),
                                "total": sum(v) / args.replays} for n, v in per_kernel.items()},
              "median_replay_kernels": [asdict(k) for k in runs[median]],
              "layer_us": [layer_spans(r, args.marker, args.per_layer) for r in runs]}
    Path(args.out).write_text(json.dumps(result, indent=1))
    graph.close()


if __name__ == "__main__":
    main()
