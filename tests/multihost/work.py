"""Requests for the multi-host tests (as the agent sends them) and what `v4serve generate`
gives each alone."""

from __future__ import annotations

import random
from pathlib import Path

# Ray custom resources of a host serving a pool: its role (what the actors always request) and
# the pin `v4serve up --prefill-resources v4serve_prefill=1` / `--decode-resources ...` adds
PREFILL_NODE = {"prefill": 1, "v4serve_prefill": 1}
DECODE_NODE = {"decode": 1, "v4serve_decode": 1}
PINS = ["--prefill-resources", "v4serve_prefill=1", "--decode-resources", "v4serve_decode=1"]


def workload(n: int, seed: int, lengths: tuple[int, int] = (64, 400)) -> list[dict]:
    """`n` requests alternating HTTP and gRPC, some streamed, greedy and seeded sampling."""
    rng = random.Random(seed)
    return [{"door": ("http", "grpc")[i % 2], "stream": i % 4 == 0,
             "prompt": [rng.randrange(32, 127) for _ in range(rng.randrange(*lengths))],
             "max_tokens": rng.randrange(4, 16), "temperature": 0.0 if i % 3 else 0.8, "seed": i} for i in range(n)]


def reference(ckpt: Path):
    """request → the tokens `v4serve generate` gives it alone."""
    from model.checkpoint import load_checkpoint
    from model.generate import generate
    from model.kv_pool import KVPools
    from model.sampling import SamplingParams

    cfg, model = load_checkpoint(ckpt)

    def run(w: dict) -> list[int]:
        pools = KVPools(cfg, "fp32", max_tokens=len(w["prompt"]) + w["max_tokens"], max_seqs=1)
        return generate(model, pools, w["prompt"], w["max_tokens"],
                        SamplingParams(temperature=w["temperature"], seed=w["seed"]),
                        stop_ids=frozenset({cfg.eos_token_id})).token_ids
    return run
