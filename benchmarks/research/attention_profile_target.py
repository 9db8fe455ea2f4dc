"""A short decode-attention run for Nsight Compute: a CSA layer's sparse attention (128 window +
512 picks) and indexer logits over fp8_pack pools at one batch size and context, three times.

    ncu --clock-control none -k regex:_sparse_attn_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/research/attention_profile_target.py --batch 64

(`-k regex:_sparse_attn_wgmma_kernel` for the kernel sm_90 runs with these pools,
`-k regex:_logits_kernel` for the logits; `--section SourceCounters --page source --print-source
sass --csv` for per-instruction stall samples.) The inputs are those of
benchmarks/research/decode_attention_sweep.py: random picks, random queries and head weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernel_bench import CFG  # noqa: E402
from benchmarks.research.decode_attention_sweep import attention_inputs  # noqa: E402
from model.kernels.attention import indexer, sparse_attention  # noqa: E402
from model.rope import Rope  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=32768)
    args = ap.parse_args()
    B, C = args.batch, args.context
    g = torch.Generator(device="cuda").manual_seed(0)
    pools, batch, q, sink, picks = attention_inputs(B, C, g)
    rope = Rope.for_layer(CFG, True)
    qi = torch.randn(B, 64, 128, device="cuda", generator=g).bfloat16()
    wi = torch.randn(B, 64, device="cuda", generator=g)
    for _ in range(3):
        sparse_attention.attend(q, batch, pools, 2, 4, picks, sink, 128, rope, "triton")
        indexer.logits(qi, wi, batch, pools, 2, slice(0, B), batch.meta.max_end // 4, fp8_query=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
