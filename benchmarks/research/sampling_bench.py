"""Time from a decode step's logits to its token ids on the host: sampling on the logits' device
(`model.sampling.sample_rows`, the engines' path; the draw by the Triton kernel and by its torch
reference) against copying the fp32 logits to the host and sampling there (what the engines did
before).

    python benchmarks/research/sampling_bench.py [--batches 1 64 256] [--vocab 129280] [--reps 10] [--out F]

The copy alone is also timed: it is what the old path cost even for greedy rows. Three request
mixes: every row greedy; every row drawn from the whole vocabulary (temperature 0.8, the API's
default top_p 1); every row drawn with top_p 0.95, half of them with top_k 50. All paths give
the same ids (checked). Prints ms per step, median of `--reps` (the upper median for an even count), and writes JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_ceilings import host_ms  # noqa: E402
from model.sampling import SamplingParams, sample_rows  # noqa: E402


def _warm_ms(fn, reps: int) -> float:
    fn()  # allocator, kernels
    return host_ms(fn, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mixes = {
        "greedy": lambda i: SamplingParams(),
        "drawn": lambda i: SamplingParams(temperature=0.8, seed=i),
        "top_p": lambda i: SamplingParams(temperature=0.8, top_p=0.95, top_k=50 * (i % 2), seed=i),
    }
    results = []
    for batch in args.batches:
        gen = torch.Generator(device).manual_seed(batch)
        logits = torch.randn(batch, args.vocab, generator=gen, device=device).mul_(3).bfloat16()
        positions = list(range(1000, 1000 + batch))
        for mix, make in mixes.items():
            params = [make(i) for i in range(batch)]
            on_device = sample_rows(logits, params, positions)
            on_host = sample_rows(logits.float().cpu(), params, positions)
            row = {"batch": batch, "vocab": args.vocab, "mix": mix, "device": str(device),
                   "same_ids": on_device == on_host == sample_rows(logits, params, positions, "torch"),
                   "copy_ms": _warm_ms(lambda: logits.float().cpu(), args.reps),
                   "device_ms": _warm_ms(lambda: sample_rows(logits, params, positions), args.reps),
                   "device_torch_ms": _warm_ms(lambda: sample_rows(logits, params, positions, "torch"), args.reps),
                   "host_ms": _warm_ms(lambda: sample_rows(logits.float().cpu(), params, positions), args.reps)}
            results.append(row)
            print(f"B{batch:<4} {mix:<7} on device {row['device_ms']:8.2f} ms (torch draw {row['device_torch_ms']:.2f})"
                  f"   copy + host {row['host_ms']:8.2f} ms"
                  f" (copy alone {row['copy_ms']:.2f})"
                  f"   same ids {row['same_ids']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda"
                                              else "cpu", "results": results}, indent=1))


if __name__ == "__main__":
    main()
