"""SM clock and board power while decode work loops on the GPU: a batch's MoE layers, whole decode
steps of full-width V4-Flash layers, and a device-to-device copy for comparison, with nvidia-smi
sampling every 100 ms beside the loops.

    python benchmarks/research/power_probe.py --out power.json [--tokens 256] [--layers 15] [--batches 256 64]

Why: a kernel that holds the board at its power limit runs at a lower SM clock, and then the
instructions it saves pay only in the energy they spent. Each window's first second (the ramp)
is left out of its means; "capped" is the share of samples whose clock-event reasons include the
software power cap (bit 0x4).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.flash_model import decode_batches, decode_pools, stack  # noqa: E402
from benchmarks.gpu_ceilings import capture  # noqa: E402
from benchmarks.research import moe_tiles_bench  # noqa: E402
from model.cuda_graph import DecodeGraph  # noqa: E402

POWER_CAP = 0x4  # nvidia-smi clocks_event_reasons: software power cap
QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"


def loop(fn, seconds: float, label: str) -> dict:
    """Call `fn` (GPU work) back to back for `seconds` → the window: label, wall start / end, ms a call."""
    fn()
    torch.cuda.synchronize()
    start, calls = time.time(), 0
    while time.time() - start < seconds:
        fn()
        calls += 1
        if calls % 5 == 0:  # a few calls queued at a time: the GPU never idles between them
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    end = time.time()
    print(f"{label}: {(end - start) / calls * 1e3:.3f} ms a call", flush=True)
    return dict(label=label, start=start, end=end, ms=(end - start) / calls * 1e3)


def moe_window(tokens: int, seconds: float) -> dict:
    """Eight V4-Flash MoE layers (random FP4 experts, each routed by its own gate) at `tokens` tokens:
    the decode tiles' sort, gate/up and down launches, the shared expert outside (as the step runs it)."""
    layers = [moe_tiles_bench.build_layer(seed=i) for i in range(8)]
    planned = [moe_tiles_bench.plan(m, tokens, 100 + i, moe_tiles_bench.GU, moe_tiles_bench.DN, False, True)
               for i, m in enumerate(layers)]
    launches = [launch for layer, _ in planned for launch in layer]

    def run() -> None:
        for launch in launches:
            launch()

    window = loop(capture(run).replay, seconds, f"MoE layers, {tokens} tokens")
    del layers, planned, launches
    torch.cuda.empty_cache()
    return window


def step_windows(layers: int, batches: list[int], context: int, seconds: float) -> list[dict]:
    """Decode steps of `layers` full-width layers at each batch, their inputs staged once (the graph
    then replays a real step's routing)."""
    model = stack(layers, act_fp8=True, fuse=True)
    windows = []
    for batch in batches:
        pools, seqs = decode_pools(model.cfg, layers, batch, context - 32, steps=32)
        graph = DecodeGraph(model, pools, batch_size=batch, max_context=context + 1)
        graph.run(decode_batches(seqs, 32)[0])
        windows.append(loop(graph.graph.replay, seconds, f"decode step, batch {batch}, {context // 1024}K"))
        graph.close()
        del graph, pools, seqs
        torch.cuda.empty_cache()
    return windows


def summarise(samples: list[tuple], window: dict) -> dict:
    inside = [s for s in samples if window["start"] + 1.0 <= s[0] <= window["end"]]
    if not inside:
        return {**window, "samples": 0}
    return {**window, "samples": len(inside), "clock_mhz": sum(s[1] for s in inside) / len(inside),
            "clock_min_mhz": min(s[1] for s in inside), "power_w": sum(s[2] for s in inside) / len(inside),
            "capped": sum(bool(s[3] & POWER_CAP) for s in inside) / len(inside)}


def parse(line: str) -> tuple[float, float, float, int]:
    stamp, clock, power, reasons = (f.strip() for f in line.split(","))
    t = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()  # the machine's local time
    return t, float(clock), float(power), int(reasons, 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=256, help="tokens of the MoE-layer window")
    ap.add_argument("--layers", type=int, default=15, help="full-width layers of the decode-step windows")
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 64])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each window")
    args = ap.parse_args()
    with tempfile.NamedTemporaryFile("w+", suffix=".csv") as log:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100",
                                "-i", str(torch.cuda.current_device())], stdout=log, text=True)
        try:
            windows = [moe_window(args.tokens, args.seconds)]
            windows += step_windows(args.layers, args.batches, args.context, args.seconds)
            src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            windows.append(loop(lambda: dst.copy_(src), args.seconds, "device copy, 4 GiB"))
            time.sleep(0.5)
        finally:
            smi.terminate()
            smi.wait()
        log.seek(0)
        samples = [parse(line) for line in log if line.count(",") == 3]
    rows = [summarise(samples, w) for w in windows]
    for r in rows:
        if r["samples"]:
            print(f"{r['label']:34s} {r['ms']:8.3f} ms  SM clock {r['clock_mhz']:5.0f} MHz (min {r['clock_min_mhz']:.0f})"
                  f"  {r['power_w']:4.0f} W  at the power cap {r['capped']:.0%}")
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), windows=rows,
                                              samples=[list(s) for s in samples]), indent=1))


if __name__ == "__main__":
    main()
