"""Launch-option sweep of the decode-time attention kernels at V4-Flash shapes: sparse attention on
a CSA layer (128 window + 512 picks) and an HCA layer (128 window + context/128 entries), the
indexer's logits over the CSA layer's compressed keys and the top-512 select over those logits
(bits of the K-th score a pass, warps); fp8_pack pools, GPU time per call from CUDA-graph replays.

    python benchmarks/research/decode_attention_sweep.py --out $OUT/decode_attention.json --batches 64 256 --context 32768

Each row gives the launch options (None: the launch heuristic's choice) and the largest difference
from the heuristic's output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.flash_model import decode_batch, decode_pools  # noqa: E402
from benchmarks.gpu_ceilings import bench_graph  # noqa: E402
from benchmarks.kernel_bench import CFG, D, H  # noqa: E402
from model.kernels.attention import indexer, sparse_attention  # noqa: E402
from model.rope import Rope  # noqa: E402

# (block_h, block_n, splits, num_warps, num_stages); None = the heuristic's. The first row is the
# default launch (`sparse_attention_wgmma`'s kernel on sm_90), the second the Triton kernel's
# default launch; the third and fourth what the Triton kernel's heuristic chose before 64-entry
# steps (32-head programs when there are at most half as many tokens as SMs, else 64-head ones;
# 32 entries a step). Any launch option given runs the Triton kernel.
ATTENTION = [(None, None, None, None, None), (64, 64, None, 8, 2), (32, 32, None, 4, 2), (64, 32, None, 8, 2),
             (64, 64, 1, 8, 2), (64, 64, 4, 8, 2), (64, 64, 8, 8, 2), (64, 64, None, 8, 3), (64, 64, None, 4, 2),
             (32, 64, None, 4, 2), (64, 128, None, 8, 2)]
# small batches (up to 4 tokens) add programs of fewer heads and more entry splits, empty splits
# included: one 64-head program a token leaves most SMs idle there
SMALL = [(16, 64, 8, 4, 2), (16, 64, 16, 4, 2), (16, 32, 16, 4, 2), (16, 32, 32, 4, 2), (32, 64, 8, 4, 2),
         (32, 64, 16, 4, 2), (32, 32, 16, 4, 2), (32, 32, 32, 4, 2), (64, 32, 16, 8, 2), (16, 16, 32, 4, 2), (64, 64, 16, 8, 2)]
# (block_n, blocks, num_warps); None = the heuristic's
LOGITS = [(None, None, 4), (64, None, 4), (64, 2, 4), (64, 4, 4), (64, 8, 4), (128, 2, 4), (128, 4, 4), (128, 8, 4),
          (128, 2, 8), (128, 4, 8), (256, 1, 8), (256, 2, 8)]
# (digit_bits, num_warps) of the select kernel; None = the default's
SELECT = [(None, None), (1, None), (2, None), (4, None), (8, None), (2, 4), (2, 8), (4, 4), (4, 8), (1, 8), (4, 16),
          (8, 16)]


def attention_inputs(B: int, C: int, g: torch.Generator):
    """fp8_pack pools of 4 layers for B requests of C tokens, their decode batch, and random
    queries q [B, H, D] bf16, sinks [H] and a CSA layer's picks [B, 512] (drawn from g in that order)."""
    pools, seqs = decode_pools(CFG, 4, B, C)
    q = torch.randn(B, H, D, device="cuda", generator=g).bfloat16()
    sink = torch.randn(H, device="cuda", generator=g)
    picks = torch.randint(0, (C + 1) // 4, (B, 512), device="cuda", generator=g).int()
    return pools, decode_batch(seqs), q, sink, picks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--skip-attention", action="store_true", help="the indexer's logits only")
    ap.add_argument("--skip-indexer", action="store_true", help="the sparse attention only")
    ap.add_argument("--attention-rows", type=int, default=None, help="only the first N attention launches")
    args = ap.parse_args()
    C = args.context
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for B in args.batches:
        pools, batch, q, sink, picks = attention_inputs(B, C, g)
        rope = Rope.for_layer(CFG, True)
        for ratio, layer, pk in () if args.skip_attention else ((4, 2, picks), (128, 3, None)):
            ref = None
            for bh, bn, sp, nw, ns in (ATTENTION + (SMALL if B <= 4 else []))[:args.attention_rows]:
                fn = lambda: sparse_attention.attend(q, batch, pools, layer, ratio, pk, sink, 128, rope,  # noqa: E731
                                                     "triton", block_h=bh, block_n=bn, splits=sp, num_warps=nw,
                                                     num_stages=ns)
                row = {"kernel": f"attention ratio {ratio}", "batch": B, "context": C, "block_h": bh, "block_n": bn,
                       "splits": sp, "num_warps": nw, "num_stages": ns}
                try:
                    out = fn()
                    ref = out if ref is None else ref
                    row["max_diff"] = float((out - ref).abs().max())
                    row["us"] = bench_graph(fn) * 1e6
                except Exception as e:  # a launch that does not fit (shared memory, registers) is a result
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                print(row, flush=True)
        if args.skip_indexer:
            continue
        qi = torch.randn(B, 64, 128, device="cuda", generator=g).bfloat16()
        wi = torch.randn(B, 64, device="cuda", generator=g)
        n_max = batch.meta.max_end // 4
        ref = None
        for bn, nb, nw in LOGITS:
            fn = lambda: indexer.logits(qi, wi, batch, pools, 2, slice(0, B), n_max, bn, nb, nw,  # noqa: E731
                                        fp8_query=True)  # a W8A8 model's (the official checkpoints')
            row = {"kernel": "indexer logits", "batch": B, "context": C, "block_n": bn, "blocks": nb, "num_warps": nw}
            out = fn()
            ref = out if ref is None else ref
            row["max_diff"] = float((out - ref).abs().nan_to_num().max())
            row["us"] = bench_graph(fn) * 1e6
            rows.append(row)
            print(row, flush=True)
        scores, ref = ref, None  # the heuristic's logits: -inf past each causal end, as the step's
        for bits, nw in SELECT:
            fn = lambda: indexer.top_k(scores, 512, nw, bits)  # noqa: E731
            row = {"kernel": "indexer select", "batch": B, "context": C, "digit_bits": bits, "num_warps": nw}
            out = fn()
            ref = out if ref is None else ref
            row["same_ids"] = bool(torch.equal(out, ref))
            row["us"] = bench_graph(fn) * 1e6
            rows.append(row)
            print(row, flush=True)
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
