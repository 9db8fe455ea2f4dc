"""One 8192-token prompt through the prefill engine and through the decode engine's local prefill
(the aggregated path), in one process on one GPU: the same forward, so equal times say a gap
between P/D and aggregated time-to-first-token lies in the served path, not in the engines.

    python benchmarks/research/engine_prefill_bench.py --layers 8      # one GPU (8 V4-Flash layers, dummy weights)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from decode_worker.engine import DecodeConfig, DecodeEngine  # noqa: E402
from model.dummy_weights import dummy_model  # noqa: E402
from model.kv_pool import KVPools  # noqa: E402
from model.tiny import flash_config  # noqa: E402
from model.tokenizer import ByteTokenizer  # noqa: E402
from prefill_worker.engine import PrefillConfig, PrefillEngine  # noqa: E402
from worker_runtime.model_loader import DecodeGraphs  # noqa: E402
from worker_runtime.wire import GenerateRequest  # noqa: E402


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--isl", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=4, help="the first of each engine compiles")
    args = ap.parse_args()
    cfg, max_tokens = flash_config(args.layers), args.isl + 1280
    model = dummy_model(cfg, "triton", "cuda", act_fp8=True)
    prefill = PrefillEngine(model, KVPools(cfg, "fp8_pack", max_tokens=max_tokens, max_seqs=4, device="cuda"), "p",
                            PrefillConfig(token_budget=args.isl, max_running=4))
    dpools = KVPools(cfg, "fp8_pack", max_tokens=max_tokens, max_seqs=5, device="cuda")
    decode = DecodeEngine(model, dpools, ByteTokenizer(cfg.vocab_size), "d",
                          DecodeConfig(prefill_token_budget=args.isl, max_running=4),
                          DecodeGraphs(model, dpools, (1, 2, 4), max_tokens))
    rng = random.Random(0)

    def request(i: int) -> GenerateRequest:
        return GenerateRequest(f"r{i}", tuple(rng.randrange(2, cfg.vocab_size) for _ in range(args.isl)),
                               max_tokens=2, ignore_eos=True)

    for k in range(args.rounds):
        prefill.submit(request(k))
        done = []
        tp = timed(lambda: done.extend(prefill.step()))
        for d in done:
            prefill.release(d)
        decode.submit(request(1000 + k))
        td = timed(decode.step)  # the prompt's step: the first token comes out of it
        while decode.has_work():
            decode.step()
        print(f"round {k}: prefill engine {tp * 1e3:.1f} ms, decode engine's prefill step {td * 1e3:.1f} ms",
              flush=True)


if __name__ == "__main__":
    main()
