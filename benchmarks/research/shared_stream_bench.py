"""Decode steps with side-stream work on a side stream (the default) against the same step with it
on the main stream, in one process: two CUDA graphs of the same layers and pools, timed in
alternating rounds so that both see the same host and clocks. `--switch shared`: the MoE's dense
shared expert (`MoE.shared_on_side_stream`); `--switch block`: the block's side stream (the mHC
post / comb and the attention's compressors, `Block.side_stream`).

    python benchmarks/research/shared_stream_bench.py --out s.json [--layers 15] [--rounds 3] [--switch block]

Per (batch, context) and variant: the graph replay alone and the whole step (input load on the
host included), median of 20 per round (benchmarks/gpu_ceilings.py's `bench`); and whether the
two graphs' logits are bit-identical (they must be: same kernels, same order of sums).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.flash_model import decode_batch, decode_pools, stack  # noqa: E402
from benchmarks.gpu_ceilings import bench  # noqa: E402
from model.cuda_graph import DecodeGraph  # noqa: E402


def switch(model, name: str, on: bool) -> None:
    """Side-stream work `name` of every block on (the default) or off."""
    for block in model.blocks:
        if name == "shared":
            block.ffn.shared_on_side_stream = on
        else:
            block.side_stream = on


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--switch", choices=["shared", "block"], default="shared")
    ap.add_argument("--steps", nargs="+", default=["256x8192", "64x8192", "256x32768"], metavar="BATCHxCONTEXT")
    args = ap.parse_args()
    model = stack(args.layers)
    rows = []
    for step in args.steps:
        B, C = map(int, step.split("x"))
        pools, seqs = decode_pools(model.cfg, args.layers, B, C)
        fb = decode_batch(seqs)
        graphs = {}
        for side in (True, False):  # captured with the flag as it is at capture time
            switch(model, args.switch, side)
            scratch = graphs["side"].scratch if graphs else None
            graphs["side" if side else "main"] = DecodeGraph(model, pools, batch_size=B, max_context=C + 1,
                                                            scratch=scratch)
        for g in graphs.values():
            g.run(fb)  # the batch's inputs in place before the replay-alone timings
        times = {k: {"replay_ms": [], "step_ms": []} for k in graphs}
        for _ in range(args.rounds):
            for k, g in graphs.items():
                times[k]["replay_ms"].append(bench(g.graph.replay) * 1e3)
                times[k]["step_ms"].append(bench(lambda: g.run(fb)) * 1e3)
        equal = torch.equal(graphs["side"].run(fb), graphs["main"].run(fb))
        row = {"batch": B, "context": C, "logits_equal": equal, **times}
        rows.append(row)
        for k, t in times.items():
            print(f"B={B:4d} ctx={C:6d} {k:5s} replay " + " ".join(f"{v:.2f}" for v in t["replay_ms"])
                  + "  step " + " ".join(f"{v:.2f}" for v in t["step_ms"]) + f"  logits equal {equal}", flush=True)
        for g in graphs.values():
            g.close()
        del graphs, pools, seqs
        torch.cuda.empty_cache()
    switch(model, args.switch, True)
    Path(args.out).write_text(json.dumps({"layers": args.layers, "switch": args.switch,
                                          "device": torch.cuda.get_device_name(),
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
