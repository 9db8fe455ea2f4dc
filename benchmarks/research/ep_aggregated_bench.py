"""The whole V4-Flash model at full width served aggregated on two GPUs with expert parallelism:
prefill and decode on the same GPUs, ISL 8192 / OSL 1024, closed loop at concurrency c.

    python benchmarks/research/ep_aggregated_bench.py --out $OUT/ep_agg.json      # a host with 2 GPUs

The aggregated counterpart of `ep_full_bench.py` (same model build: 43 layers, random weights in
the device format, each rank half of every layer's routed experts, attention data-parallel).
Each rank runs c/2 request slots with the scheduling of an aggregated engine without mixed
chunks (SGLang's default): when a request finishes, the next one is admitted and its whole
8192-token prompt is prefilled at once, which stalls the running requests' decode for that step;
otherwise every running request decodes one token per step (one CUDA graph per rank with the
fixed-capacity exchange). The ranks step in lockstep (every MoE layer is a collective): a step in
which only one rank admits a request is a prefill step for both, the other joining the exchanges
with no rows. Sampling is a greedy argmax over the final streams with its host sync every step.

Steady state without a warm-up period: at the start the slots hold requests at context 8192 whose
remaining output lengths are spread evenly over (0, OSL] (their KV random but valid), so requests
finish at the steady rate from the first step. The measured window is `--window` iterations
(one decode step, plus a prefill step when a request finished); at concurrency ≤ 2 it is one
whole request lifetime (OSL - 1 decode steps), so the window holds exactly one admission per slot.

Reported per concurrency: output and total (prompt + output) tokens/s per GPU over the window,
TTFT (= the prefill step: a closed loop admits at once, there is no queue), inter-token latency
percentiles over every token of every request (a prefill step between two decode steps counts in
the gap), and decode step time. The running requests' contexts are 8192 plus their progress
(8192 for the initial slots: a little short of a real steady state, at most 1024 tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.flash_model import _tile_random  # noqa: E402
from benchmarks.research.ep_full_bench import (ISL, LAYERS, OSL, WORLD, IdleGraph, build,  # noqa: E402
                                               idle_layers, join_ranks, spawn_ranks)
from model.batch import ForwardBatch  # noqa: E402
from model.cuda_graph import DecodeGraph  # noqa: E402
from model.kv_pool import KVPools, SeqKV  # noqa: E402

MAX_CONTEXT = ISL + OSL


def slots_of(c: int) -> list[int]:
    """Request slots per rank at concurrency c."""
    return [c // WORLD + (r < c % WORLD) for r in range(WORLD)]


def initial_remaining(n: int) -> list[int]:
    """Output tokens left for a rank's n initial requests, spread evenly over (0, OSL - 1]."""
    return [math.ceil((OSL - 1) * (j + 1) / n) for j in range(n)]


class RankPools:
    """One rank's pools: n running requests with trimmed windows, one admission's full prompt,
    the graph's scratch request."""

    def __init__(self, model, n: int, dev: str):
        cfg = model.cfg
        sub = dataclasses.replace(cfg, num_hidden_layers=len(model.blocks),
                                  compress_ratios=cfg.compress_ratios[:len(model.blocks)])
        probe = KVPools(sub, "fp8_pack", max_tokens=MAX_CONTEXT, max_seqs=1, device="meta")
        full = probe.pages_needed(SeqKV(), MAX_CONTEXT)["swa"]
        live = full - probe.first_live_swa_page(ISL)
        # SWA: each running request's live window on, plus the graph's scratch and up to three
        # admissions at once at full length (they are trimmed after their prefill)
        self.pools = KVPools(sub, "fp8_pack", max_tokens=MAX_CONTEXT, max_seqs=n + 3, device=dev,
                             swa_pages=n * live + 4 * full)
        _tile_random(self.pools)
        self.seqs = []
        for _ in range(n):  # the initial requests: context ISL, KV random but valid
            seq = self.admit()
            seq.num_tokens = ISL
            self.pools.trim_window(seq)
            self.seqs.append(seq)

    def admit(self) -> SeqKV:
        seq = SeqKV()
        self.pools.reserve(seq, MAX_CONTEXT)
        return seq


def sample(out: torch.Tensor) -> list[int]:
    """Greedy stand-in for sampling over the final streams [rows, hc, D]: one host sync."""
    return (out.float().sum(1).argmax(-1) % 1024).tolist()


def warm_up_prefill(model, dev: str) -> None:
    """One prefill on every rank before any window: compiles the prefill shapes' kernels."""
    rp = RankPools(model, 0, dev)
    seq = rp.admit()
    model(ForwardBatch.build([(seq, torch.randint(0, 1024, (ISL,)).tolist())], device=dev), rp.pools)
    torch.cuda.synchronize()
    del rp
    torch.cuda.empty_cache()


def serve(model, dev: str, c: int, window: int) -> dict | None:
    """One concurrency's closed-loop window; rank 0 returns the measurements."""
    rank, slots = dist.get_rank(), slots_of(c)
    n = slots[rank]
    remaining = [initial_remaining(k) for k in slots]  # every rank's schedule, updated identically
    cap = -(-c // WORLD)
    for block in model.blocks:  # before the capture: the graphs hold the fixed-capacity exchange
        block.ffn.capacity = cap
    rp = RankPools(model, n, dev) if n else None
    graph = DecodeGraph(model, rp.pools, batch_size=n, max_context=MAX_CONTEXT) if n else None
    idle = IdleGraph(model, dev) if not n else None
    tokens = [int(t) for t in torch.randint(0, 1024, (n,))]
    prompts = torch.randint(0, 1024, (n or 1, ISL)).tolist()
    itl, ttft, step_s = [], [], []
    out_tokens = prompt_tokens = 0
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    last = [t0] * n
    for _ in range(window):
        # decode: every running request one token
        ts = time.perf_counter()
        if n:
            batch = ForwardBatch.build([(s, [t]) for s, t in zip(rp.seqs, tokens)], device=dev)
            tokens = sample(graph.run(batch))
            batch.commit()
        else:
            idle.run()
            torch.cuda.synchronize()
        now = time.perf_counter()
        step_s.append(now - ts)
        itl += [now - t for t in last]
        last = [now] * n
        out_tokens += c
        done = [[j for j, left in enumerate(rs) if left == 1] for rs in remaining]
        remaining = [[left - 1 for left in rs] for rs in remaining]
        if not any(done):
            continue
        # admission: finished requests leave, their successors' prompts are prefilled at once
        for block in model.blocks:
            block.ffn.capacity = 0  # prefill rows differ per rank: the exact-split exchange
        ts = time.perf_counter()
        if done[rank]:
            fresh = []
            for j in done[rank]:
                rp.pools.release(rp.seqs[j])
                rp.seqs[j] = rp.admit()
                fresh.append((rp.seqs[j], prompts[j]))
            batch = ForwardBatch.build(fresh, device=dev)
            out = model(batch, rp.pools)
            ends = torch.tensor([s.end - 1 for s in batch.segments], device=dev)
            first = sample(out[ends])
            batch.commit()
            for (seq, _), j, tok in zip(fresh, done[rank], first):
                rp.pools.trim_window(seq)
                tokens[j] = tok
        else:
            idle_layers(model, dev)
            torch.cuda.synchronize()
        now = time.perf_counter()
        for block in model.blocks:
            block.ffn.capacity = cap
        if done[rank]:
            ttft.append(now - ts)
            for j in done[rank]:
                last[j] = now
        finished = sum(len(d) for d in done)
        out_tokens += finished  # each admission's first token
        prompt_tokens += finished * ISL
        for r, d in enumerate(done):
            for j in d:
                remaining[r][j] = OSL - 1
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if graph is not None:
        graph.close()
    del graph, idle, rp
    torch.cuda.empty_cache()
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, {"itl": itl, "ttft": ttft, "step": step_s})
    if rank:
        return None
    itl = sorted(x for g in gathered for x in g["itl"])
    ttft = [x for g in gathered for x in g["ttft"]]
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else None  # noqa: E731
    return {"concurrency": c, "window_steps": window, "wall_s": wall, "admissions": prompt_tokens // ISL,
            "output_tok_s_per_gpu": out_tokens / wall / WORLD,
            "total_tok_s_per_gpu": (out_tokens + prompt_tokens) / wall / WORLD,
            "ttft_ms_median": statistics.median(ttft) * 1e3 if ttft else None,
            "itl_ms_p50": pct(itl, 0.5), "itl_ms_p90": pct(itl, 0.9), "itl_ms_p99": pct(itl, 0.99),
            "itl_ms_mean": statistics.fmean(itl) * 1e3 if itl else None,
            "decode_step_ms_median": statistics.median(gathered[0]["step"]) * 1e3}


def worker(rank: int, args, port: int) -> None:
    dev = join_ranks(rank, port)
    t0 = time.perf_counter()
    model = build(rank, dev, args.layers)
    result = {"layers": args.layers, "build_s": time.perf_counter() - t0, "isl": ISL, "osl": OSL,
              "weights_GiB": torch.cuda.memory_allocated() / 2**30, "device": torch.cuda.get_device_name(),
              "runs": []}
    warm_up_prefill(model, dev)
    for c in args.concurrency:
        window = OSL - 1 if c <= WORLD else args.window
        r = serve(model, dev, c, window)
        if rank == 0:
            result["runs"].append(r)
            print(json.dumps(r), flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1))  # what is done survives a time limit
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=LAYERS, help="layers to build (43: the whole model)")
    ap.add_argument("--window", type=int, default=256, help="iterations measured at concurrency > 2")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    spawn_ranks(worker, ap.parse_args())


if __name__ == "__main__":
    main()
