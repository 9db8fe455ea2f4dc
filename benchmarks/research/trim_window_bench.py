"""Host time of the decode engine's per-step window trim (`KVPools.trim_window` on every running
request after a step), on pools that hold only page ids (device "meta": no memory).

    python benchmarks/research/trim_window_bench.py [--batch 256] [--context 32768] [--steps 512]

Each step advances every request one token and trims it, as `DecodeEngine._postprocess` does;
the steps cross SWA page boundaries (one request in 256 tokens frees a page). Prints the median
and mean host time per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.kv_pool import KVPools, SeqKV  # noqa: E402
from model.tiny import flash_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=512)
    args = ap.parse_args()
    cfg = flash_config(4)
    cfg = dataclasses.replace(cfg, num_hidden_layers=4, compress_ratios=cfg.compress_ratios[:4])
    total = args.context + args.steps
    pools = KVPools(cfg, "fp8_pack", max_tokens=total, max_seqs=args.batch, device="meta")
    seqs = []
    for r in range(args.batch):
        seq = SeqKV()
        pools.reserve(seq, total)
        seq.num_tokens = args.context - r  # staggered: the page crossings fall on different steps
        pools.trim_window(seq)
        seqs.append(seq)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        for seq in seqs:
            seq.num_tokens += 1
            pools.trim_window(seq)
        times.append(time.perf_counter() - start)
    print(f"batch {args.batch}, context {args.context}: trim per step median {statistics.median(times) * 1e3:.3f} ms, "
          f"mean {statistics.mean(times) * 1e3:.3f} ms over {args.steps} steps")


if __name__ == "__main__":
    main()
