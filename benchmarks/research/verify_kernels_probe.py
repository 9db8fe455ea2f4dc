"""What a verify step of L tokens a request costs over a one-token step at batch 1, by kernel: a
CUDA-graph replay of L = 1..4 tokens (random ids, so the L tokens route to different experts) is
timed with CUDA events, and one eager forward of the same batch is profiled per kernel
(torch.profiler); the table shows each kernel family's time at every L, largest growth first.

    python benchmarks/research/verify_kernels_probe.py --layers 30 --context 512 [--small-tokens 4] --out v.json
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.batch import ForwardBatch
from model.cuda_graph import DecodeGraph
from model.dummy_weights import dummy_model
from model.kernels.mhc import mhc
from model.kv_pool import KVPools, SeqKV
from model.tiny import flash_config


def family(name: str) -> str:
    """A kernel's name without template arguments and launch suffixes."""
    name = re.sub(r"<.*", "", name)
    return re.sub(r"_\d+$|\(.*", "", name)[:60]


def kernel_times(fn, reps: int = 5) -> dict[str, float]:
    """CUDA microseconds per call of each kernel family in `fn`."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = collections.defaultdict(float)
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.self_device_time_total > 0:
            out[family(e.key)] += e.self_device_time_total / reps
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--small-tokens", type=int, default=mhc.SMALL_TOKENS,
                    help="mHC entries of up to this many tokens take the one-launch kernel")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    mhc.SMALL_TOKENS = args.small_tokens  # before the model is built: its blocks size their mixes buffers by it
    cfg = flash_config(args.layers)
    model = dummy_model(cfg, "triton", "cuda", act_fp8=True, with_mtp=True)
    max_context = args.context + 16
    pools = KVPools(cfg, "fp8_pack", max_tokens=max_context, max_seqs=4, device="cuda", with_mtp=True)
    seq = SeqKV()
    pools.reserve(seq, max_context)
    rng = random.Random(0)
    prompt = [rng.randrange(2, cfg.vocab_size) for _ in range(args.context)]
    batch = ForwardBatch.build([(seq, prompt)], "cuda")
    model(batch, pools)
    batch.commit()
    rows, kernels = [], {}
    for L in args.tokens:
        graph = DecodeGraph(model, pools, 1, max_context, tokens_per_row=L)
        ids = [rng.randrange(2, cfg.vocab_size) for _ in range(L)]

        def replay(graph=graph, ids=ids):
            graph.run(ForwardBatch.build([(SeqKV(seq.pages, seq.num_tokens), ids)], "cpu"))

        for _ in range(5):
            replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graph.graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay_ms = start.elapsed_time(end) / 50
        eager = ForwardBatch.build([(SeqKV(seq.pages, seq.num_tokens), ids)], "cuda")
        kernels[L] = kernel_times(lambda eager=eager: model(eager, pools, all_logits=True, return_streams=L > 1))
        rows.append({"tokens": L, "replay_ms": replay_ms, "eager_kernels_ms": sum(kernels[L].values()) / 1e3})
        print(json.dumps(rows[-1]), flush=True)
        graph.close()
    base = kernels[args.tokens[0]]
    names = sorted({k for t in kernels.values() for k in t},
                   key=lambda k: -(kernels[args.tokens[-1]].get(k, 0) - base.get(k, 0)))
    print(f"{'kernel (us per step)':60s} " + " ".join(f"L={L:<7d}" for L in args.tokens))
    for k in names[:30]:
        print(f"{k:60s} " + " ".join(f"{kernels[L].get(k, 0):<9.0f}" for L in args.tokens))
    if args.out:
        Path(args.out).write_text(json.dumps({"layers": args.layers, "context": args.context,
                                              "small_tokens": args.small_tokens, "rows": rows,
                                              "kernels_us": {L: kernels[L] for L in args.tokens}}, indent=1))


if __name__ == "__main__":
    main()
