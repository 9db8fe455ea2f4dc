"""Launch-option sweep of the sparse-attention kernels on the prefill shape (one V4-Flash CSA layer:
8K tokens, 64 heads × 512, 128 window + 512 picks per token, fp8_pack pools), GPU time per call.

    python benchmarks/research/attention_sweep.py --out $OUT/attention_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_ceilings import bench  # noqa: E402
from benchmarks.kernel_bench import CFG, ENTRY, D, H, _prefill_batch, prefill_picks  # noqa: E402
from model.kernels.attention import sparse_attention  # noqa: E402
from model.kv_pool import KVPools  # noqa: E402
from model.rope import Rope  # noqa: E402
from tests.model.kernel_cases import fill_random  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--block-h", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    args = ap.parse_args()
    T = args.tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    pools = KVPools(CFG, "fp8_pack", max_tokens=T, max_seqs=1, device="cuda")
    batch = _prefill_batch(pools, T)
    fill_random(pools, seed=1)  # valid random encodings (zeros would make every config agree trivially)
    q = torch.randn(T, H, D, device="cuda", generator=g).bfloat16()
    sink = torch.randn(H, device="cuda", generator=g)
    picks, vis = prefill_picks(T, g)
    rope = Rope.for_layer(CFG, True)
    flops = H * vis * D * 4
    ref = sparse_attention.attend(q, batch, pools, 2, 4, picks, sink, 128, rope, "triton", out_dtype=torch.bfloat16)
    rows = []
    # the first row is the default launch (on sm_90 `sparse_attention_wgmma`'s kernel), the others
    # the Triton kernel's launch options
    for bh, bn, warps, stages in [(None,) * 4] + list(itertools.product(args.block_h, args.block_n, args.warps,
                                                                       args.stages)):
        if bh == 32 and warps == 16:
            continue
        row = {"block_h": bh, "block_n": bn, "num_warps": warps, "num_stages": stages}
        try:
            fn = lambda: sparse_attention.attend(q, batch, pools, 2, 4, picks, sink, 128, rope, "triton",  # noqa: E731
                                                 block_h=bh, block_n=bn, num_warps=warps, num_stages=stages,
                                                 out_dtype=torch.bfloat16)
            out = fn()
            row["max_diff"] = float((out.float() - ref.float()).abs().max())
            row["ms"] = bench(fn, warmup=2, reps=10) * 1e3
            row["TFLOPs"] = flops / row["ms"] / 1e9
            row["GBps"] = vis * ENTRY / row["ms"] / 1e6
        except Exception as e:  # a launch that does not fit (shared memory, registers) is a result
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(row, flush=True)
    Path(args.out).write_text(json.dumps({"tokens": T, "flops": flops, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
