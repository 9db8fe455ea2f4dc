"""Decode FP8 projections of one V4-Flash layer, per tile choice: the six dense products of a CSA
layer (wq_a, wq_b, wkv, grouped wo_a, wo_b, indexer wq_b) at decode batch sizes, or with
`--products shared` the MoE's dense shared expert (gate/up [2I, D], down [D, I]; W8A16, the
products `moe_shared.shared_expert` runs beside the routed kernels).

    python benchmarks/research/fp8_gemm_bench.py --out fp8.json [--batches 1 64 256] [--variants default,a8,tokens_m]
    python benchmarks/research/fp8_gemm_bench.py --out s.json --products shared --batches 1 --variants default,split=x2

Each product runs in a CUDA graph over enough different weights of its shape (>= 256 MB in all)
that none is read from L2, as a decode step meets them. Fraction of copy: the weight, scale,
activation and output bytes over the time, against a device-to-device copy measured in the same
run; TFLOP/s against the bf16 matmul rate of the same run. Every variant's output is checked
against the torch reference first (relative error printed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_ceilings import bench, ceilings  # noqa: E402
from model import low_precision  # noqa: E402
from model.kernels.gemm import act_quant, fp8_cublas, fp8_gemm  # noqa: E402
from model.tiny import flash_config  # noqa: E402

CFG = flash_config(4)


def shapes(products: str = "attention") -> dict[str, tuple[int, int, int]]:
    """name → (N, K, G) of a CSA layer's FP8 projections ("attention") or its shared expert's ("shared")."""
    c = CFG
    if products == "shared":
        return {"shared.w13": (2 * c.moe_intermediate_size, c.hidden_size, 1),
                "shared.w2": (c.hidden_size, c.moe_intermediate_size, 1)}
    heads_in = c.num_attention_heads * c.head_dim // c.o_groups
    return {"wq_a": (c.q_lora_rank, c.hidden_size, 1),
            "wq_b": (c.num_attention_heads * c.head_dim, c.q_lora_rank, 1),
            "wkv": (c.head_dim, c.hidden_size, 1),
            "wo_a": (c.o_lora_rank, heads_in, c.o_groups),
            "wo_b": (c.hidden_size, c.o_groups * c.o_lora_rank, 1),
            "indexer.wq_b": (c.index_n_heads * c.index_head_dim, c.q_lora_rank, 1)}


def variant(name: str, M: int, N: int, K: int, G: int) -> dict | None:
    """Tile config of a named variant (None: `decode_config`'s choice). Names: default; a8 (W8A8
    as `fp8_linear` runs it: up to `INLINE_QUANT_MAX_M` rows `_fp8_a8_kernel` quantises its
    input itself, above the input is quantised first); a8_separate (always quantised first, in a
    launch of its own); a8_kernel (the W8A8 kernel alone, on codes quantised once); a8_scaled_mm
    (cuBLAS's blockwise FP8 GEMMs, `fp8_cublas.gemm`, on codes quantised once, as a8_kernel; a call
    a group); a8_dense (the quantised-dequantised input times the dequantised weight on cuBLAS's
    bf16 GEMM, the prefill path where the FP8 GEMM does not apply); dense (the weight
    dequantised, then cuBLAS: the path above `KERNEL_MAX_M` rows, W8A16); tokens_m (the
    tokens-as-M kernel at every row count, with the tiles it had before the weights-as-M kernel:
    16 / 64 / 128 token rows up to 16 / 64 / 256 tokens, the last with 128-row weight tiles and 8
    warps); or key=value pairs joined by '+' over the default (BLOCK_T=64+num_stages=4; split=xF
    multiplies SPLIT_K by F), after "a8_kernel+" over the W8A8 kernel's default, after "a8+" the
    same over the W8A8 kernel quantising its input itself (up to `INLINE_QUANT_MAX_M` rows)."""
    if name in ("default", "dense", "a8", "a8_separate", "a8_kernel", "a8_scaled_mm", "a8_dense"):
        return None
    a8 = name.startswith(("a8_kernel+", "a8+"))
    if a8:
        name = name.split("+", 1)[1]
    if name == "tokens_m":
        if M <= 64:
            return fp8_gemm.decode_config(M, N, K, G, BLOCK_M=16 if M <= 16 else 64)
        return fp8_gemm.decode_config(M, N, K, G, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    tiles, factor = {}, 1.0
    for kv in name.split("+"):
        key, value = kv.split("=")
        if key == "split":
            factor = float(value.lstrip("x"))
        else:
            tiles[key] = int(value)
    cfg = fp8_gemm.decode_config(M, N, K, G, a8=a8, **tiles)
    cfg["SPLIT_K"] = max(1, int(cfg["SPLIT_K"] * factor))
    return cfg


def run(M: int, N: int, K: int, G: int, names: list[str], g: torch.Generator) -> list[dict]:
    wbytes = G * N * K
    copies = max(2, -(-(256 << 20) // wbytes))
    weights = []
    for _ in range(copies):
        q, s = low_precision.fp8_quantize_weight(torch.randn(G * N, K, device="cuda", generator=g) / K ** 0.5)
        weights.append((q, s.float()))
    x = torch.randn(M, G, K, device="cuda", generator=g).bfloat16()
    arrivals = fp8_gemm.arrival_counters(G * N, "cuda")
    nbytes = wbytes + weights[0][1].numel() * 4 + M * G * (K + N) * 2
    rows = []
    for name in names:
        cfg = variant(name, M, N, K, G)
        # W8A8 variants against the reference of the quantised input
        ref = fp8_gemm.fp8_linear(x.float(), *weights[0], "torch", G, act_fp8=name.startswith("a8")).reshape(M, G, N)
        if name == "dense":  # dequantised weights and cuBLAS, the prefill-size path
            def product(q, s):
                return fp8_gemm.dense_product(x if G > 1 else x[:, 0], q, s, G).reshape(M, G, N)
        elif name == "a8":  # W8A8 as the model runs it (up to INLINE_QUANT_MAX_M rows, one launch)
            def product(q, s):
                return fp8_gemm.fp8_linear(x, q, s, "triton", G, arrivals, act_fp8=True)
        elif name == "a8_separate":  # W8A8 in two launches at every size: act_quant, then the kernel
            def product(q, s):
                codes, x_scale = act_quant.quantize(x, "triton")
                return fp8_gemm.decode_product(codes, q, s, arrivals, out_dtype=x.dtype, x_scale=x_scale)
        elif name.startswith("a8+"):  # W8A8 quantising its input inside the kernel, other tiles
            def product(q, s, cfg=cfg):
                return fp8_gemm.decode_product(x, q, s, arrivals, cfg, out_dtype=x.dtype, quantize_x=True)
        elif name.startswith("a8_kernel"):  # the W8A8 kernel alone, on codes quantised once
            codes, x_scale = act_quant.quantize(x, "triton")

            def product(q, s, cfg=cfg):
                return fp8_gemm.decode_product(codes, q, s, arrivals, cfg, out_dtype=x.dtype, x_scale=x_scale)
        elif name == "a8_dense":
            def product(q, s):
                xq = act_quant.fake_quantize(x, "triton")
                return fp8_gemm.dense_product(xq if G > 1 else xq[:, 0], q, s, G).reshape(M, G, N)
        elif name == "a8_scaled_mm":  # cuBLAS's GEMMs alone, on codes quantised once
            codes, x_scale = act_quant.quantize(x.reshape(M, G * K), "triton", scales_by_column=True)

            def product(q, s):
                return fp8_cublas.gemm(codes, x_scale, q, s, G, x.dtype).reshape(M, G, N)
        else:
            def product(q, s, cfg=cfg):
                return fp8_gemm.decode_product(x, q, s, arrivals, cfg)
        out = product(*weights[0]).float().reshape(M, G, N)
        err = ((out - ref).norm() / ref.norm()).item()

        def step():
            for q, s in weights:
                product(q, s)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            step()
        t = bench(graph.replay, warmup=2, reps=10) / copies
        rows.append({"variant": name, "M": M, "N": N, "K": K, "G": G, "ms": t * 1e3, "bytes": nbytes,
                     "flops": 2 * M * G * N * K, "rel_err": err,
                     "cfg": name if name in ("dense", "a8_dense", "a8_scaled_mm") else cfg or fp8_gemm.decode_config(M, N, K, G,
                                                                                          a8=name.startswith("a8"))})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--variants", default="default,tokens_m")
    ap.add_argument("--products", choices=("attention", "shared"), default="attention")
    args = ap.parse_args()
    names = args.variants.split(",")
    ceil = ceilings()
    bw, rate = ceil["copy_bytes_per_s"], ceil["bf16_flops"]
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for M in args.batches:
        layer = {n: 0.0 for n in names}
        layer_bytes = 0
        for proj, (N, K, G) in shapes(args.products).items():
            for r in run(M, N, K, G, names, g):
                r["proj"] = proj
                r["fraction_of_copy"] = r["bytes"] / (r["ms"] / 1e3) / bw
                r["TFLOPs"] = r["flops"] / (r["ms"] / 1e3) / 1e12
                rows.append(r)
                layer[r["variant"]] += r["ms"]
                print(f"M={M:4d} {proj:13s} {r['variant']:32s} {r['ms'] * 1e3:8.1f} us  {r['fraction_of_copy']:6.1%} "
                      f"of copy  {r['TFLOPs']:6.1f} TFLOP/s  err {r['rel_err']:.1e}", flush=True)
            layer_bytes += rows[-1]["bytes"]
        for n in names:
            print(f"M={M:4d} layer {n:32s} {layer[n] * 1e3:8.1f} us  {layer_bytes / (layer[n] / 1e3) / bw:6.1%} of copy",
                  flush=True)
        rows.append({"variant": "layer", "M": M, "ms_by_variant": layer, "bytes": layer_bytes})
    Path(args.out).write_text(json.dumps({"ceilings": ceil, "rows": rows}, indent=1))
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s ({ceil['device']})")


if __name__ == "__main__":
    main()
