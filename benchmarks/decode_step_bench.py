"""Decode steps and prefill of full-width DeepSeek-V4-Flash layers on one GPU (random weights in
the device format: FP8 projections, FP4 experts; fp8_pack pools), against rooflines measured in
the same run.

    python benchmarks/decode_step_bench.py --out $OUT/decode_step.json [--layers N] [--activations bf16]

* decode: batch 1 / 64 / 256 at contexts 8K / 32K, one step of as many layers as fit (the V4-Flash
  pattern from layer 0: window, window, then ratio 4 / 128 alternating), replayed as a CUDA graph.
  Steps run as a serving loop runs them, each one position on from the last (so each finds its
  inputs staged during the previous one, model/cuda_graph.py); for comparison, the same batch over
  and over (each step loads its own inputs with the GPU idle) and the graph replay alone.
  Roofline: the fewest bytes the step must move — every dense weight, the experts the step's routing
  actually hit (counted from the gates), the KV entries read (window, picks or all compressed
  entries, the indexer's full key scan) and the activations — over the copy bandwidth.
* prefill: the same layers over one request of 8K tokens (eager). Ceiling: its FLOPs (projections,
  attention over window + picks, indexer scores, the routed + shared experts) over the bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.flash_model import decode_batches, decode_pools, layers_that_fit, roofline_bytes, stack  # noqa: E402
from benchmarks.gpu_ceilings import bench, ceilings, host_ms  # noqa: E402
from model.batch import ForwardBatch  # noqa: E402
from model.cuda_graph import DecodeGraph  # noqa: E402
from model.kv_pool import KVPools, SeqKV  # noqa: E402

WARMUP, REPS = 3, 20  # untimed and timed calls of each `bench`
STEPS = 32  # decode positions per (batch, context): room for the staged steps' WARMUP + REPS


def experts_hit(model, batch, pools) -> list[int]:
    """Distinct routed experts per layer for this batch (one eager forward with gate hooks)."""
    seen: list[int] = []
    hooks = [b.ffn.gate.register_forward_hook(lambda m, i, o: seen.append(int(o[1].unique().numel())))
             for b in model.blocks]
    model(batch, pools)
    for h in hooks:
        h.remove()
    return seen


def profile(fn, label: str, out_dir: Path, rows: int = 18, by_op: bool = False) -> None:
    """CUDA time per kernel of one eager call (torch.profiler), printed and saved: where a step goes.
    `by_op`: per torch op and input shapes instead (the op that launched each kernel)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if by_op else [ProfilerActivity.CUDA]
    with torch_profile(activities=activities, record_shapes=by_op) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages(group_by_input_shape=by_op)
    table = events.table(sort_by="self_cuda_time_total" if by_op else "cuda_time_total", row_limit=rows,
                         max_name_column_width=60, max_shapes_column_width=80)
    print(f"--- profile: {label}\n{table}", flush=True)
    (out_dir / f"profile_{label.replace(' ', '_').replace('=', '')}.txt").write_text(table)


def kv_reserve_bytes(num_layers_guess: int, batch: int, context: int) -> int:
    cfg_layers = max(1, num_layers_guess)
    per_token_layer = 584 / 4 + 132 / 4 + 584 / 128  # C4 + indexer + C128, averaged over kinds below
    return int(batch * context * per_token_layer * cfg_layers / 2 + batch * 2 * 256 * 584 * cfg_layers) + (6 << 30)


def prefill_flops(cfg, layers: list[int], model, T: int) -> float:
    pos = torch.arange(T, dtype=torch.float64)
    total = 0.0
    for i, block in zip(layers, model.blocks):
        dense = sum(t.numel() for n, t in block.state_dict().items()  # each weight once, fused or not
                    if t.dim() == 2 and not n.startswith("ffn.") and "hc_" not in n and "ape" not in n)
        total += 2 * dense * T + 2 * 24 * 4 * cfg.hidden_size * T * 2  # projections + mHC mixes
        ratio = cfg.compress_ratios[i]
        entries = torch.clamp(pos + 1, max=cfg.sliding_window)
        if ratio == 4:
            entries = entries + torch.clamp((pos + 1) // 4, max=cfg.index_topk)
            total += float(((pos + 1) // 4).sum()) * cfg.index_n_heads * cfg.index_head_dim * 2
        elif ratio == 128:
            entries = entries + (pos + 1) // 128
        total += float(entries.sum()) * cfg.num_attention_heads * cfg.head_dim * 4
        experts = cfg.num_experts_per_tok + cfg.n_shared_experts
        total += T * experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=0, help="layers to build (0: as many as fit)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--skip-decode", action="store_true", help="prefill only")
    ap.add_argument("--profile-steps", nargs="*", default=["1x8192", "64x8192"], metavar="BATCHxCONTEXT",
                    help="decode steps to profile per kernel (eagerly)")
    ap.add_argument("--skip-prefill", action="store_true", help="decode only")
    ap.add_argument("--profile-ops", action="store_true",
                    help="also profile the prefill by torch op and input shape (what the small kernels are)")
    ap.add_argument("--activations", choices=("fp8", "bf16"), default="fp8",
                    help="the FP8 projections' inputs: fp8 (W8A8, the V4 checkpoints' dynamic activation "
                         "scheme) or bf16 (W8A16)")
    ap.add_argument("--unfused", action="store_true",
                    help="each projection its own launch (no `Attention.fuse_products`)")
    args = ap.parse_args()
    ceil = ceilings()
    bw, rate = ceil["copy_bytes_per_s"], ceil["bf16_flops"]
    free, _ = torch.cuda.mem_get_info()
    reserve = kv_reserve_bytes(16, max(args.batches), max(args.contexts))
    n = args.layers or layers_that_fit(free, reserve)
    model = stack(n, act_fp8=args.activations == "fp8", fuse=not args.unfused)
    cfg = model.cfg
    layers = list(range(n))
    print(f"{n} layers ({[cfg.compress_ratios[i] for i in layers]}), "
          f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB of weights", flush=True)
    result = {"ceilings": ceil, "layers": n, "activations": args.activations, "fused": not args.unfused,
              "decode": [], "prefill": None}

    for context in [] if args.skip_decode else args.contexts:
        for batch in args.batches:
            # the steps decode positions context - STEPS .. context - 1 in a graph sized for context + 1
            # tokens, as serving sizes it: a graph sized past the context makes the step slower
            pools, seqs = decode_pools(cfg, n, batch, context - STEPS, steps=STEPS)
            fbs = decode_batches(seqs, STEPS)
            fb = fbs[0]
            hit = experts_hit(model, fb, pools)
            graph = DecodeGraph(model, pools, batch_size=batch, max_context=context + 1)
            # consecutive steps, as a serving loop runs them: each finds its inputs staged by the last
            steps = iter(fbs)
            t = bench(lambda: graph.run(next(steps)), warmup=WARMUP, reps=REPS)
            staged = graph.staging.hits
            # one batch over and over: nothing staged fits, each step loads its inputs (the GPU idle)
            unstaged = bench(lambda: graph.run(fb), warmup=WARMUP, reps=REPS)
            replay = bench(graph.graph.replay, warmup=WARMUP, reps=REPS)  # the GPU's part alone: no input copy
            load = host_ms(lambda: graph.load_inputs(graph.staging.rows(fb.segments), list(fb.host_ids)))
            if f"{batch}x{context}" in args.profile_steps:
                profile(lambda: model(fb, pools), f"decode B={batch} ctx={context}", Path(args.out).parent, rows=40)
            # bytes of the first (shortest) of the steps: the roofline errs low
            need = [roofline_bytes(cfg, i, b, batch, context - STEPS, h) for i, b, h in zip(layers, model.blocks, hit)]
            total = sum(sum(d.values()) for d in need)
            row = {"batch": batch, "context": context, "ms": t * 1e3, "ms_per_layer": t * 1e3 / n,
                   "roofline_ms": total / bw * 1e3, "fraction_of_roofline": total / bw / t,
                   "bytes": total, "weight_bytes": sum(d["weights"] for d in need),
                   "kv_bytes": sum(d["kv"] for d in need), "experts_hit_mean": sum(hit) / len(hit),
                   "replay_ms": replay * 1e3, "load_host_ms": load, "unstaged_ms": unstaged * 1e3,
                   "staged_steps": staged}
            result["decode"].append(row)
            print(f"decode B={batch:4d} ctx={context:6d}: {t * 1e3:8.2f} ms ({t * 1e3 / n:.3f}/layer)  roofline "
                  f"{total / bw * 1e3:8.2f} ms  → {total / bw / t:6.1%}   experts hit/layer {sum(hit) / len(hit):.0f}"
                  f"  (graph replay alone {replay * 1e3:.2f} ms; steps loading their own inputs {unstaged * 1e3:.2f} "
                  f"ms, the load {load:.2f} ms on the host; {staged}/{WARMUP + REPS} steps staged)",
                  flush=True)
            graph.close()
            del graph, pools, seqs
            torch.cuda.empty_cache()

    if args.skip_prefill:
        Path(args.out).write_text(json.dumps(result, indent=1))
        return
    T = args.prefill_tokens
    sub = dataclasses.replace(cfg, num_hidden_layers=n, compress_ratios=cfg.compress_ratios[:n])
    pools = KVPools(sub, "fp8_pack", max_tokens=T, max_seqs=1, device="cuda")
    flops = prefill_flops(cfg, layers, model, T)

    def run_prefill():
        seq = SeqKV()
        pools.reserve(seq, T)
        model(ForwardBatch.build([(seq, list(range(T)))], device="cuda"), pools)
        pools.release(seq)

    t = bench(run_prefill, warmup=1, reps=3)
    profile(run_prefill, f"prefill T={T}", Path(args.out).parent)
    if args.profile_ops:
        profile(run_prefill, f"prefill ops T={T}", Path(args.out).parent, rows=60, by_op=True)
    result["prefill"] = {"tokens": T, "ms": t * 1e3, "ms_per_layer": t * 1e3 / n, "flops": flops,
                         "TFLOPs": flops / t / 1e12, "fraction_of_matmul": flops / t / rate}
    print(f"prefill T={T}: {t * 1e3:.1f} ms ({t * 1e3 / n:.2f}/layer), {flops / t / 1e12:.0f} TFLOP/s "
          f"= {flops / t / rate:.1%} of bf16 matmul", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s ({ceil['device']})")


if __name__ == "__main__":
    main()
