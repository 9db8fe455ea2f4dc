"""Host time of a decode step's input path (`DecodeGraph.load_inputs`) against the graph replay.

    python benchmarks/research/decode_inputs_bench.py --out inputs.json [--layers 4]

For each (batch, context): a step that loads its own inputs (`DecodeGraph.run` on one batch over
and over, so that nothing staged by the previous step fits) and the graph replay alone, GPU-timed
by events (benchmarks/gpu_ceilings.py's `bench`), then host wall times (median of 20, the GPU
idle before each) of `load_inputs` and of its page-table part
(`HostInputs.update_tables` with unchanged page lists, as most rows are in a decode step). The
input path does not depend on the layer count, so a few layers do.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.flash_model import decode_batch, decode_pools, stack  # noqa: E402
from benchmarks.gpu_ceilings import bench, host_ms  # noqa: E402
from model.cuda_graph import DecodeGraph  # noqa: E402
from model.kv_pool import ALL_KINDS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", nargs="+", default=["256x32768", "256x8192", "64x32768", "1x32768"],
                    metavar="BATCHxCONTEXT")
    args = ap.parse_args()
    model = stack(args.layers)
    rows = []
    for step in args.steps:
        B, C = map(int, step.split("x"))
        pools, seqs = decode_pools(model.cfg, args.layers, B, C)
        fb = decode_batch(seqs)
        graph = DecodeGraph(model, pools, batch_size=B, max_context=C + 1)
        ids = fb.input_ids.tolist()
        rows_pages = [[s.seq.pages[k] for s in fb.segments] + [graph.scratch.pages[k]] * (B - len(fb.segments))
                      for k in ALL_KINDS]
        host = graph.staging.buffers[0]
        row = {"batch": B, "context": C, "input_bytes": int(host.array.nbytes),
               "step_ms": bench(lambda: graph.run(fb)) * 1e3, "replay_ms": bench(graph.graph.replay) * 1e3,
               "load_host_ms": host_ms(lambda: graph.load_inputs(graph.staging.rows(fb.segments), ids)),
               "update_tables_host_ms": host_ms(lambda: host.update_tables(rows_pages))}
        rows.append(row)
        print(row, flush=True)
        graph.close()
        del graph, pools, seqs
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"layers": args.layers, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
