"""What programmatic dependent launch (PDL) saves between short decode kernels.

    python benchmarks/research/pdl_probe.py

A CUDA graph of twelve CSA layers' six FP8 products at one token (`fp8_gemm._fp8_gemm_kernel`
with `decode_config`'s tiles and K splits; twelve layers of weights, so none is read from L2),
launched plainly and with PDL as kernels/common/pdl.py uses it (each kernel waits for its predecessor
first, none triggers early). Replay medians, two rounds; each form's outputs are checked against
the torch reference. (Round v19 also measured early triggers, on entry and after the K loop:
both slower than plain; docs/journal/.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_ceilings import bench_graph  # noqa: E402
from benchmarks.research.fp8_gemm_bench import shapes  # noqa: E402
from model import low_precision  # noqa: E402
from model.kernels.gemm import fp8_gemm  # noqa: E402

MODES = ["plain", "PDL, wait only"]


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(12):
        ops = []
        for N, K, G in shapes().values():
            q, s = low_precision.fp8_quantize_weight(torch.randn(G * N, K, device="cuda", generator=g) / K ** 0.5)
            x = torch.randn(1, G, K, device="cuda", generator=g).bfloat16()
            arrivals = fp8_gemm.arrival_counters(G * N, "cuda")
            ops.append((x, q, s.float(), arrivals, fp8_gemm.decode_config(1, N, K, G), G))
        layers.append(ops)

    def run(mode: int) -> list[torch.Tensor]:
        return [fp8_gemm.decode_product(x, q, s, arrivals, {**cfg, "PDL": mode > 0, "launch_pdl": mode > 0})
                for ops in layers for x, q, s, arrivals, cfg, _ in ops]

    for _ in range(2):
        for mode, name in enumerate(MODES):
            outs = run(mode)
            ok = all(torch.allclose(out.float(), fp8_gemm.reference(x.float(), q, s, G).float(), rtol=2e-2, atol=2e-2)
                     for out, (x, q, s, _, _, G) in zip(outs, [op for ops in layers for op in ops]))
            ms = bench_graph(lambda: run(mode), calls=1, reps=20) * 1e3
            print(f"{name:30s} {ms:.3f} ms for {6 * len(layers)} products ({ms / len(layers) * 1e3:.1f} µs a layer)"
                  f"  outputs {'match' if ok else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
