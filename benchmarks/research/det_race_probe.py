"""Which stream ordering fault stops `--deterministic` prefill steps of tens of thousands of tokens:
the 63-companion case of tests/gpu/test_deterministic_gpu.py (a target of 2,500 tokens beside 63
requests of up to 1,500, prefilled in chunks of 2,048: steps of ~49K tokens) stops on an illegal
memory access, and passes with CUDA_LAUNCH_BLOCKING=1. Each variant runs in its own process (a
fault poisons the CUDA context): side streams as served, the blocks' side streams off (the
compressors and mHC post / comb in order), and the same without `--deterministic`. One JSON line
per variant: whether the prefill finished, and the error if not.

    python benchmarks/research/det_race_probe.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VARIANTS = {"served": (True, True), "no_side_streams": (True, False), "default_kernels": (False, True)}


def run(deterministic: bool, side_streams: bool) -> None:
    import torch

    from model.batch import ForwardBatch
    from model.dummy_weights import dummy_model
    from model.kernels import set_deterministic
    from model.kv_pool import KVPools, SeqKV
    from model.tiny import flash_config

    cfg = flash_config(4)
    model = dummy_model(cfg, "triton", "cuda", act_fp8=True)
    set_deterministic(model, deterministic)
    for block in model.layers:
        block.side_stream = side_streams
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (2500,), generator=g).tolist()] + [
        torch.randint(0, cfg.vocab_size, (int(torch.randint(1, 1500, (1,), generator=g)),), generator=g).tolist()
        for _ in range(63)]
    pools = KVPools(cfg, "fp8_pack", max_tokens=4096, max_seqs=64, device="cuda")
    seqs = [SeqKV() for _ in prompts]
    for s, p in zip(seqs, prompts):
        pools.reserve(s, len(p) + 8)
    for start in range(0, 2500, 2048):
        items = [(s, p[start:start + 2048]) for s, p in zip(seqs, prompts) if p[start:start + 2048]]
        batch = ForwardBatch.build(items, device="cuda")
        model(batch, pools)
        batch.commit()
        torch.cuda.synchronize()


def main() -> None:
    if len(sys.argv) == 3:
        run(sys.argv[1] == "1", sys.argv[2] == "1")
        return
    for name, (det, side) in VARIANTS.items():
        p = subprocess.run([sys.executable, __file__, str(int(det)), str(int(side))], capture_output=True, text=True,
                           check=False, timeout=300)
        error = next((line for line in p.stderr.splitlines()[::-1] if "Error" in line), "")
        print(json.dumps({"variant": name, "deterministic": det, "side_streams": side, "finished": p.returncode == 0,
                          "error": error[:300]}), flush=True)


if __name__ == "__main__":
    main()
