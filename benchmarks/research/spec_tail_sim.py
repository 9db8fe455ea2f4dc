"""How many tokens a request a speculative step keeps over a whole run of c requests of `new` tokens
each, at forced acceptance p (`spec_decode_bench.accepted_count`'s draws): the run lasts as long as
its slowest request, so short requests keep fewer than the expected 1 + p + ... + p^N a step.
The figure `spec_step_profile.py` reports as run is (new - 1) / steps: the first token comes from
the prompt's step.

    python benchmarks/research/spec_tail_sim.py --concurrency 16 --new 48 --n 3 --accept 0.8
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.research.spec_decode_bench import accepted_count


def run_steps(c: int, new: int, n: int, p: float, rng: random.Random) -> int:
    """Steps until the slowest of c requests has its new - 1 tokens after the first."""
    slowest = 0
    for _ in range(c):
        left, steps = new - 1, 0
        while left > 0:
            left -= 1 + accepted_count(n, p, rng)
            steps += 1
        slowest = max(slowest, steps)
    return slowest


def tokens_per_step(c: int, new: int, n: int, p: float, runs: int, seed: int = 0) -> dict:
    """The as-run tokens a request a step over `runs` simulated runs: mean and 5th / 95th percentiles."""
    rng = random.Random(seed)
    kept = sorted((new - 1) / run_steps(c, new, n, p, rng) for _ in range(runs))
    return {"concurrency": c, "new": new, "n": n, "accept": p, "runs": runs, "mean": sum(kept) / runs,
            "p5": kept[int(0.05 * runs)], "p95": kept[int(0.95 * runs)],
            "expected_without_tail": sum(p ** i for i in range(n + 1))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--new", type=int, nargs="+", default=[48])
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--accept", type=float, default=0.8)
    ap.add_argument("--runs", type=int, default=3000)
    args = ap.parse_args()
    for c in args.concurrency:
        for new in args.new:
            print(json.dumps(tokens_per_step(c, new, args.n, args.accept, args.runs)))


if __name__ == "__main__":
    main()
