"""A short MoE run for Nsight Compute: the fused decode path over 4 full-width V4-Flash layers, twice.

    ncu --clock-control none -k regex:"_gateup_kernel|_down_kernel" --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \\
        python3 benchmarks/research/moe_profile_target.py --tokens 64

Four layers (13.4 GB of FP4 experts) so that a profiled launch reads weights the previous one did
not; `--tokens` per step (default 64), routed by each layer's gate on random inputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.moe_bench import build_layer, routed_inputs  # noqa: E402
from model.kernels.moe import moe_fused  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    T = ap.parse_args().tokens
    layers = [build_layer(seed=i) for i in range(4)]
    inputs = [routed_inputs(m, T, 7 + i) for i, m in enumerate(layers)]
    for _ in range(2):
        for moe, (x, _, weights, ids) in zip(layers, inputs):
            moe_fused.fused_moe(x, weights, ids, moe.experts, moe.shared_experts, moe.cfg.swiglu_limit)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
