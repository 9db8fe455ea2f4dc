"""Where a speculative decode step's time goes on the GPU: the decode engine with CUDA graphs at
forced acceptance (as `spec_decode_bench.py`), each phase timed between device synchronisations
(drafting, the verify replay with its MTP extension, sampling, the roll-back; `--phases`), against
the plain step's replay. Synchronising adds to every phase and stops the host from queueing ahead,
so the step's own time is measured without `--phases`. `--busy` profiles the timed pass instead:
the GPU's busy and idle time a step (idle: waiting for the host), its longest kernels, and the
kernels the longest idle gaps came before.
The requests run twice through each engine and the second pass is timed: the first compiles the
kernels its eager shapes need (a compilation inside the timed steps would read as ~10 ms a step).

    python benchmarks/research/spec_step_profile.py --layers 30 --concurrency 1 --n 0 1 2 [--phases] --out p.json
    python benchmarks/research/spec_step_profile.py --layers 30 --concurrency 1 --n 0 3 --busy
    python benchmarks/research/spec_step_profile.py --layers 8 --concurrency 16 64 --n 0 2 --max-batch 16 --isl 256
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.research.spec_decode_bench import forced
from benchmarks.research.step_timeline import merged
from decode_worker import speculative
from decode_worker.engine import DecodeConfig, DecodeEngine
from model import speculation
from model.cuda_graph import DecodeGraph
from model.dummy_weights import dummy_model
from model.kv_pool import KVPools
from model.tiny import flash_config
from model.tokenizer import ByteTokenizer
from worker_runtime.model_loader import DecodeGraphs
from worker_runtime.wire import GenerateRequest, RequestState

SPENT: dict[str, float] = collections.defaultdict(float)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        key = name(args) if callable(name) else name
        SPENT[key] += time.perf_counter() - t
        return out
    return wrapper


def head_agreement(model, rows: int = 4096) -> float:
    """How often the FP8 draft head's argmax is the exact head's, on unit-RMS inputs (the head's
    input is normed). Random weights give flat logits, whose top two are close: a pessimistic
    figure for a trained model's peaked ones."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(rows, model.cfg.hidden_size, device="cuda", generator=g).bfloat16()
    agree = 0
    for part in h.split(256):
        agree += int((model.head(part).argmax(-1) == model.draft_head(part).argmax(-1)).sum())
    return agree / rows


def gpu_split(prof, steps: int, top: int = 12) -> dict:
    """The profiled pass's device work a step, ms: busy (a kernel, copy or memset running), idle
    (none: the device waits for the host), the longest kernels, and the idle time summed by the
    kernel it came before (what the device was waiting to be given)."""
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        trace = json.loads(Path(f"{tmp}/trace.json").read_text())
    events = sorted(((e["name"][:70], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
                     for e in trace.get("traceEvents", []) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e[1])
    if not events:
        raise RuntimeError("the profiler saw no device work")
    busy = sum(b - a for a, b in merged([(a, b) for _, a, b in events]))
    wall = max(b for _, _, b in events) - events[0][1]
    kernels: dict[str, float] = collections.defaultdict(float)
    waits: dict[str, float] = collections.defaultdict(float)
    end = events[0][2]
    for name, a, b in events:
        kernels[name] += b - a
        if a > end:
            waits[name] += a - end
        end = max(end, b)
    per_step = lambda us: round(us / steps / 1e3, 4)  # noqa: E731
    return {"wall_ms": per_step(wall), "busy_ms": per_step(busy), "idle_ms": per_step(wall - busy),
            "kernels_ms": {k: per_step(v) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]},
            "idle_before_ms": {k: per_step(v) for k, v in sorted(waits.items(), key=lambda kv: -kv[1])[:top]}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1])
    ap.add_argument("--n", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--accept", type=float, default=0.8)
    ap.add_argument("--isl", type=int, default=512)
    ap.add_argument("--new", type=int, default=40)
    ap.add_argument("--max-batch", type=int, default=0,
                    help="--speculative-max-batch (a graph bucket; 0: the concurrency, speculating at every step)")
    ap.add_argument("--phases", action="store_true",
                    help="time each phase between synchronisations (which adds to the step: without, the step alone)")
    ap.add_argument("--draft-head", choices=("fp8", "bf16"), default="fp8",
                    help="the head the drafts read (fp8: as workers draft, `Transformer.quantize_draft_head`)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="take steps one at a time (DecodeConfig.overlap off): the host's time between steps shows")
    ap.add_argument("--busy", action="store_true",
                    help="profile the timed pass: the GPU's busy / idle time a step and its longest kernels")
    ap.add_argument("--trace", action="store_true",
                    help="print each timed step's tokens per request (where a run's tokens a step go)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cfg = flash_config(args.layers)
    model = dummy_model(cfg, "triton", "cuda", act_fp8=True, with_mtp=True)
    if args.draft_head == "fp8":
        model.quantize_draft_head()
        print(json.dumps({"draft_head_agreement": head_agreement(model)}), flush=True)
    if args.phases:
        speculation.draft = timed("draft", speculation.draft)
        speculation.settle = timed("settle", speculation.settle)
        speculation.settle_chain = timed("settle", speculation.settle_chain)
        speculative.sample_rows = timed("sample", speculative.sample_rows)
        speculative.draw_rows = timed("sample", speculative.draw_rows)
        speculative.token_logprobs = timed("logprobs", speculative.token_logprobs)
        DecodeGraph.run = timed(lambda a: "draft replay" if a[0].draft else f"replay of {a[0].L} a row",
                                DecodeGraph.run)
    rows = []
    for c in args.concurrency:
        rng = random.Random(0)
        requests = [GenerateRequest(f"r{i}", tuple(rng.randrange(2, 256) for _ in range(args.isl)),
                                    max_tokens=args.new, ignore_eos=True) for i in range(c)]
        for n in args.n:
            pools = KVPools(cfg, "fp8_pack", max_tokens=args.isl + args.new + 8, max_seqs=c + 1, device="cuda",
                            with_mtp=True)
            buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= c) or (1,)
            limit = args.max_batch or c
            graphs = DecodeGraphs(model, pools, buckets, args.isl + args.new + 8, tokens_per_row=n + 1,
                                  verify_max_rows=limit)
            engine = DecodeEngine(model, pools, ByteTokenizer(cfg.vocab_size), f"d{n}",
                                  DecodeConfig(prefill_token_budget=args.isl * c, max_running=c, speculative_tokens=n,
                                               speculative_max_batch=limit, overlap=not args.no_overlap),
                                  graphs)
            for rep in range(2):  # the first pass compiles what the step shapes need; the second is timed
                # the forced decisions from one seed a pass: every depth's timed pass draws the same stream
                restore = forced(args.accept)
                for r in requests:
                    engine.submit(dataclasses.replace(r, request_id=f"{r.request_id}.{rep}"))
                # from the first step of decoding rows alone to the last: the wall clock, synchronised
                # at both ends only (with `--phases` around every step too)
                steps, emitted, t = 0, 0, None
                prof = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                        if args.busy and rep == 1 else contextlib.nullcontext())
                while engine.has_work():
                    if t is None and not engine.waiting and all(x.state is RequestState.DECODING
                                                                for x in engine.running.values()):
                        torch.cuda.synchronize()
                        SPENT.clear()
                        prof.__enter__()
                        t = time.perf_counter()
                    chunks = engine.step()
                    if args.phases:
                        torch.cuda.synchronize()
                    if t is not None:
                        steps += 1
                        emitted += sum(len(ch.token_ids) for ch in chunks)
                        if args.trace and rep == 1:
                            print(json.dumps({"c": c, "n": n, "step": steps, "running": len(engine.running),
                                              "ahead": engine.ahead is not None,
                                              "tokens": sorted(len(ch.token_ids) for ch in chunks)}), flush=True)
                torch.cuda.synchronize()
                total = time.perf_counter() - t
                prof.__exit__(None, None, None)
                restore()
            # a step costs the same whatever it accepts: at the forcing's expected 1 + p + ... + p^N
            # tokens a step (where no request ends) the figure does not hang on one run's draws
            expected = sum(args.accept ** i for i in range(n + 1)) if c <= limit else 1.0
            row = {"concurrency": c, "n": n, "max_batch": limit, "overlap": not args.no_overlap,
                   "draft_head": args.draft_head,
                   "accept": args.accept, "step_ms": total / steps * 1e3,
                   "tokens_per_step": emitted / steps / c, "ms_per_token": total / (emitted / c) * 1e3,
                   "ms_per_expected_token": total / steps / expected * 1e3,
                   "phases_ms": {k: v / steps * 1e3 for k, v in sorted(SPENT.items())}}
            if args.busy:
                row["gpu"] = gpu_split(prof, steps)
            if args.phases:
                row["other_ms"] = (row["step_ms"] - sum(row["phases_ms"].values())
                                   + row["phases_ms"].get("draft replay", 0))
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps({"layers": args.layers, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
