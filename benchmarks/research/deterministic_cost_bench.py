"""What `--deterministic` costs: decode steps at batch 1 / 16 / 64 and a prefill of 8K tokens on
full-width DeepSeek-V4-Flash layers (random device-format weights, W8A8, fp8_pack pools), with the
kernels' batch-invariant configurations (`kernels.set_deterministic`) and without, in one run.

Decode steps replay a CUDA graph captured in each mode (the graph holds the configurations it
was captured with), each step one position on from the last, as a serving loop runs them
(benchmarks/decode_step_bench.py's timing); the prefill runs eagerly over one request. The
target is a decode step at most 15% slower in the mode (issue 51).

    python benchmarks/research/deterministic_cost_bench.py --out $OUT/deterministic_cost.json [--layers 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.flash_model import decode_batches, decode_pools, stack
from benchmarks.gpu_ceilings import bench
from model.batch import ForwardBatch
from model.cuda_graph import DecodeGraph
from model.kernels import set_deterministic
from model.kv_pool import KVPools, SeqKV

WARMUP, REPS = 3, 20
STEPS = WARMUP + REPS + 4  # decode positions per (mode, batch): one a timed or warm-up step


def decode_ms(model, batch: int, context: int, layers: int) -> float:
    """Median ms of a decode step of `batch` requests at `context` tokens, replayed from a graph."""
    pools, seqs = decode_pools(model.cfg, layers, batch, context - STEPS, steps=STEPS)
    steps = iter(decode_batches(seqs, STEPS))
    graph = DecodeGraph(model, pools, batch_size=batch, max_context=context + 1)
    ms = bench(lambda: graph.run(next(steps)), warmup=WARMUP, reps=REPS) * 1e3
    graph.close()
    return ms


def prefill_ms(model, tokens: int, layers: int) -> float:
    """Median ms of an eager prefill of one request of `tokens` tokens."""
    cfg = model.cfg
    sub = dataclasses.replace(cfg, num_hidden_layers=layers, compress_ratios=cfg.compress_ratios[:layers])
    pools = KVPools(sub, "fp8_pack", max_tokens=tokens, max_seqs=1, device="cuda")

    def run():
        seq = SeqKV()
        pools.reserve(seq, tokens)
        model(ForwardBatch.build([(seq, list(range(tokens)))], device="cuda"), pools)
        pools.release(seq)

    return bench(run, warmup=1, reps=3) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument("--layers", type=int, default=8, help="V4-Flash layers from layer 0 (window, window, then "
                                                         "ratio 4 / 128 alternating)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=8192, help="tokens each decoding request holds")
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--activations", choices=("fp8", "bf16"), default="fp8",
                    help="the FP8 projections' inputs: fp8 (W8A8, the checkpoints' scheme) or bf16 (W8A16)")
    args = ap.parse_args()
    model = stack(args.layers, act_fp8=args.activations == "fp8")
    n = args.layers
    result = {"device": torch.cuda.get_device_name(0), "layers": n, "context": args.context,
              "activations": args.activations, "decode": [], "prefill": None}
    for batch in args.batches:
        row = {"batch": batch}
        for mode in (False, True):
            set_deterministic(model, mode)
            row["deterministic_ms" if mode else "ms"] = decode_ms(model, batch, args.context, n)
            torch.cuda.empty_cache()  # the last graph's and pools' memory, before the next ones
        row["cost"] = row["deterministic_ms"] / row["ms"] - 1
        result["decode"].append(row)
        print(f"decode B={batch:3d} ctx={args.context}: {row['ms']:.3f} ms, deterministic {row['deterministic_ms']:.3f} "
              f"ms ({row['cost']:+.1%})", flush=True)
    if args.prefill_tokens:
        row = {"tokens": args.prefill_tokens}
        for mode in (False, True):
            set_deterministic(model, mode)
            row["deterministic_ms" if mode else "ms"] = prefill_ms(model, args.prefill_tokens, n)
        row["cost"] = row["deterministic_ms"] / row["ms"] - 1
        result["prefill"] = row
        print(f"prefill T={args.prefill_tokens}: {row['ms']:.1f} ms, deterministic {row['deterministic_ms']:.1f} ms "
              f"({row['cost']:+.1%})", flush=True)
    set_deterministic(model, False)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
