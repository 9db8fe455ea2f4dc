"""All 43 layers of V4-Flash at full width on two GPUs with expert parallelism: one pool of the
4-GPU P/D deployment (prefill on two GPUs, decode on two), measured on its own.

    python benchmarks/research/ep_full_bench.py --out $OUT/ep_full.json      # a host with 2 GPUs

Two processes, one GPU each, one NCCL group. Each builds every layer with random weights in the
device format (FP8 projections, FP4 routed experts, FP8 shared expert; `model.dummy_weights.dummy_block`)
and keeps its half of each layer's routed experts (`model.ep.ExpertParallelMoE`: 128 of 256,
~1.6 GB a layer) and a full copy of everything else: attention is data-parallel, so each rank
runs its own requests and the two meet in every MoE layer's all-to-all dispatch and combine.
About 80 GB a GPU. No embedding, LM head or MTP block (the slice benchmarks leave them out too).

* prefill: each rank prefills its own ISL-token request at the same time (the pool's two
  requests in flight); TTFT = wall time of the 43-layer forward (eager, one chunk).
* decode: concurrency c split over the two ranks (c = 1: one rank decodes, the other joins each
  MoE exchange with no tokens), every request at context ISL, one CUDA graph per rank and
  concurrency with the fixed-capacity exchange (`ExpertParallelMoE.capacity` = ⌈c/2⌉ tokens per
  rank; the idle rank replays a graph of the exchanges alone). ITL = wall time per step.
  `--eager-too` also times eager steps with the exact-split exchange (a host sync per layer).

Derived, stated as composed from these measurements: a 4-GPU P/D deployment (this prefill pool +
this decode pool, KV hand-off from the kvtransfer benchmark) serving ISL/OSL requests at
concurrency c: requests/s = min(c / (TTFT + hand-off + OSL · ITL), prefill pool rate 2 / TTFT).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.flash_model import LayerStack, decode_pools  # noqa: E402
from model.batch import ForwardBatch  # noqa: E402
from model.dummy_weights import dummy_block  # noqa: E402
from model.cuda_graph import DecodeGraph  # noqa: E402
from model.ep import ExpertParallelMoE  # noqa: E402
from model.kv_pool import KVPools, SeqKV  # noqa: E402
from model.tiny import flash_config  # noqa: E402

ISL, OSL, LAYERS, WORLD = 8192, 1024, 43, 2


def build(rank: int, dev: str, layers: int) -> LayerStack:
    """The layers with this rank's expert slice; the other half of each layer is freed as it goes."""
    cfg = flash_config(LAYERS)
    blocks = []
    for i in range(layers):
        block = dummy_block(cfg, i, "triton", dev, seed=i)
        ep = ExpertParallelMoE(block.ffn, None)
        for name, buf in list(ep.experts.named_buffers()):  # own the slice: the full layer goes
            setattr(ep.experts, name, buf.clone())
        block.ffn = ep
        blocks.append(block)
        torch.cuda.empty_cache()
    return LayerStack(cfg, blocks, dev)


@torch.no_grad()
def idle_layers(model: LayerStack, dev: str) -> None:
    """A rank with no tokens this step: join each MoE layer's exchanges with zero rows."""
    x = torch.empty(0, model.cfg.hidden_size, dtype=torch.bfloat16, device=dev)
    ids = torch.empty(0, dtype=torch.long, device=dev)
    for block in model.blocks:
        block.ffn(x, ids)


def timed(fn) -> float:
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - t0


def prefill(model: LayerStack, dev: str, layers: int, repeats: int) -> list[float]:
    cfg = model.cfg
    sub = dataclasses.replace(cfg, num_hidden_layers=layers, compress_ratios=cfg.compress_ratios[:layers])
    pools = KVPools(sub, "fp8_pack", max_tokens=ISL, max_seqs=1, device=dev)
    prompt = torch.randint(0, 1024, (ISL,)).tolist()
    times = []
    for r in range(repeats + 1):  # the first warms up
        seq = SeqKV()
        pools.reserve(seq, ISL)
        t = timed(lambda: model(ForwardBatch.build([(seq, prompt)], device=dev), pools))
        pools.release(seq)
        if r:
            times.append(t)
        if dist.get_rank() == 0:
            print(f"prefill {r}: {t * 1e3:.1f} ms", flush=True)
    del pools
    torch.cuda.empty_cache()
    return times


class IdleGraph:
    """A rank with no requests this step, captured: each MoE layer's fixed-capacity exchanges with
    no rows of its own, the same collectives the busy ranks' captured steps issue."""

    def __init__(self, model: LayerStack, dev: str):
        self.model, self.dev = model, dev
        for _ in range(2):  # as DecodeGraph: two eager rounds before the capture
            idle_layers(model, dev)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            idle_layers(model, dev)

    def run(self, batch=None) -> None:
        self.graph.replay()


def decode(model: LayerStack, dev: str, layers: int, c: int, steps: int, graphs: bool) -> float:
    rank = dist.get_rank()
    mine = c // WORLD + (rank < c % WORLD)  # requests this rank decodes
    cap = -(-c // WORLD)  # the fixed-capacity exchange: every rank sends cap·k rows to each peer
    for block in model.blocks:
        block.ffn.capacity = cap if graphs else 0
    pools, seqs = decode_pools(model.cfg, layers, mine, ISL, device=dev, steps=steps) if mine else (None, [])
    tokens = [int(t) for t in torch.randint(0, 1024, (mine,))]
    graph = None
    if graphs:
        graph = DecodeGraph(model, pools, batch_size=mine, max_context=ISL + steps + 1) if mine else IdleGraph(model, dev)

    def step():
        if not mine:
            graph.run() if graph else idle_layers(model, dev)
            return
        batch = ForwardBatch.build([(s, [t]) for s, t in zip(seqs, tokens)], device=dev)
        graph.run(batch) if graph else model(batch, pools)
        batch.commit()

    for _ in range(2):  # warm-up
        step()
    itl = timed(lambda: [step() for _ in range(steps - 2)]) / (steps - 2)
    if isinstance(graph, DecodeGraph):
        graph.close()
    del graph, pools, seqs
    torch.cuda.empty_cache()
    return itl


def join_ranks(rank: int, port: int) -> str:
    """In a spawned rank: its GPU, the NCCL group, its seed; → the device name."""
    torch.cuda.set_device(rank)
    dev = f"cuda:{rank}"
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            device_id=torch.device(dev))
    torch.manual_seed(rank)
    return dev


def spawn_ranks(worker, args) -> None:
    """Run `worker(rank, args, port)` on each of the WORLD GPUs, then print what rank 0 wrote to `args.out`."""
    if torch.cuda.device_count() < WORLD:
        sys.exit(f"{Path(sys.argv[0]).stem} needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(worker, args=(args, 29000 + os.getpid() % 1000), nprocs=WORLD, join=True)
    print(Path(args.out).read_text())


def worker(rank: int, args, port: int) -> None:
    dev = join_ranks(rank, port)
    t0 = time.perf_counter()
    model = build(rank, dev, args.layers)
    result = {"layers": args.layers, "build_s": time.perf_counter() - t0,
              "weights_GiB": torch.cuda.memory_allocated() / 2**30, "device": torch.cuda.get_device_name()}
    if rank == 0:
        print(f"built {args.layers} layers: {result['weights_GiB']:.1f} GiB per GPU in {result['build_s']:.0f} s",
              flush=True)
    result["prefill_s"] = prefill(model, dev, args.layers, args.repeats)
    result["decode"], result["decode_eager"] = [], []
    for graphs in (True, False) if args.eager_too else (True,):
        for c in args.concurrency:
            itl = decode(model, dev, args.layers, c, args.steps, graphs)
            result["decode" if graphs else "decode_eager"].append({"concurrency": c, "itl_s": itl})
            if rank == 0:
                print(f"decode c={c:4d} {'graphs' if graphs else 'eager'}: ITL {itl * 1e3:8.2f} ms", flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(summarise(result, args.handoff_ms), indent=1))
    dist.destroy_process_group()


def summarise(r: dict, handoff_ms: float) -> dict:
    """Composed 4-GPU P/D figures: at concurrency c (closed loop) a request lives TTFT + OSL · ITL,
    so requests/s = c / that (Little's law), capped by the prefill pool's rate (2 per TTFT)."""
    ttft = statistics.median(r["prefill_s"]) * LAYERS / r["layers"]  # layer-scaled only if built partial
    prefill_rps = WORLD / ttft
    composed = []
    for d in r["decode"]:
        itl = d["itl_s"] * LAYERS / r["layers"]
        lifetime = ttft + handoff_ms / 1e3 + OSL * itl
        rps = min(d["concurrency"] / lifetime, prefill_rps)
        composed.append({"concurrency": d["concurrency"], "itl_ms": itl * 1e3, "ttft_ms": ttft * 1e3 + handoff_ms,
                         "output_tok_s_per_gpu": rps * OSL / (2 * WORLD),
                         "total_tok_s_per_gpu": rps * (ISL + OSL) / (2 * WORLD),
                         "bound": "prefill" if rps == prefill_rps else "decode"})
    return {**r, "ttft_s_median": ttft, "prefill_tok_s_per_gpu": ISL / ttft,
            "handoff_ms_assumed": handoff_ms, "pd_4gpu_composed": composed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=LAYERS, help="layers to build (43: the whole model)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--eager-too", action="store_true", help="also time eager steps (exact-split exchange)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--handoff-ms", type=float, default=4.2,
                    help="KV hand-off per request added to TTFT (the 2x H200 slice measured 4.2 ms at ISL 8192)")
    spawn_ranks(worker, ap.parse_args())


if __name__ == "__main__":
    main()
