"""Speculative decoding in the decode engine at a forced acceptance rate, against the same engine
without speculation: time per output token and per step at each concurrency (dummy V4-Flash
layers with the MTP block on one GPU; `--device cpu`: the tiny model on the reference path).

Random weights accept no drafts, so acceptance is forced at the accept decision: each draft is
accepted with probability p until the first one refused (`speculation.accepted` and
`accept_counts` replaced: `forced`), and the
request emits the target's tokens of those rows as always. Forcing the drafts themselves to equal a
plain run's tokens does not work on a GPU without batch invariance: a verify row's logits differ in
the last bits from a one-token step's, random weights give near-ties everywhere, one flip makes the
request leave the recorded text and every later draft is refused. The forced outputs are not a
draw of the model; only the timing is measured, which depends on how many tokens a step keeps,
not on which. At depth N a step emits 1 + p + p² + ... + p^N tokens on average. Every engine runs
the same requests once first, so no kernel compilation is timed (a compilation inside the timed
steps reads as ~10 ms a step).

    python benchmarks/research/spec_decode_bench.py --layers 8 --concurrency 1 16 64 --n 1 2 --accept 0.6 0.8 0.9
    python benchmarks/research/spec_decode_bench.py --device cpu --concurrency 1 2 --n 1 --accept 0.8 --new 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from decode_worker.engine import DecodeConfig, DecodeEngine
from model import speculation
from model.batch import to_device
from model.dummy_weights import dummy_model
from model.kv_pool import KVPools
from model.tiny import flash_config, tiny_config
from model.tokenizer import ByteTokenizer
from worker_runtime.model_loader import DecodeGraphs
from worker_runtime.wire import GenerateRequest, RequestState


def run(engine: DecodeEngine, requests: list[GenerateRequest], sync) -> tuple[dict[str, list[int]], float, int, int]:
    """Serve `requests` together: (tokens per request, seconds of steps where all decode, their
    steps, the tokens those steps emitted)."""
    for r in requests:
        engine.submit(r)
    tokens = {r.request_id: [] for r in requests}
    seconds = steps = emitted = 0
    while engine.has_work():
        decoding = all(x.state is RequestState.DECODING for x in engine.running.values()) and not engine.waiting
        sync()
        t = time.perf_counter()
        chunks = engine.step()
        sync()
        if decoding:
            seconds += time.perf_counter() - t
            steps += 1
            emitted += sum(len(c.token_ids) for c in chunks)
        for c in chunks:
            tokens[c.request_id] += c.token_ids
    return tokens, seconds, steps, emitted


def forcing(p: float, rng: random.Random):
    """`speculation.accepted` with each leading draft accepted with probability p."""

    def accepted(drafts: tuple[int, ...], targets: list[int]) -> int:
        return accepted_count(len(drafts), p, rng)

    return accepted


def forcing_counts(p: float, rng: random.Random):
    """`speculation.accept_counts` (a step drafted on the device) with the same forcing: the counts
    are drawn on the host and copied over without waiting."""

    def accept_counts(drafts: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return to_device([accepted_count(drafts.shape[1], p, rng) for _ in range(drafts.shape[0])], drafts.device,
                         torch.int64)

    return accept_counts


def accepted_count(n: int, p: float, rng: random.Random) -> int:
    a = 0
    while a < n and rng.random() < p:
        a += 1
    return a


def forced(p: float, seed: int = 1):
    """Replace both accept decisions of `model/speculation.py` by forced ones; → a function that
    puts the real ones back."""
    real = speculation.accepted, speculation.accept_counts
    speculation.accepted = forcing(p, random.Random(seed))
    speculation.accept_counts = forcing_counts(p, random.Random(seed))

    def restore() -> None:
        speculation.accepted, speculation.accept_counts = real

    return restore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--layers", type=int, default=8, help="V4-Flash layers (cuda)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--n", type=int, nargs="+", default=[1, 2], help="speculative tokens")
    ap.add_argument("--accept", type=float, nargs="+", default=[0.6, 0.8, 0.9])
    ap.add_argument("--isl", type=int, default=512)
    ap.add_argument("--new", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--graphs", action="store_true", help="capture decode graphs (verify buckets with N > 0)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    cfg = flash_config(args.layers) if cuda else tiny_config()
    model = dummy_model(cfg, "triton" if cuda else "torch", args.device, act_fp8=cuda, with_mtp=True)
    fmt = "fp8_pack" if cuda else "fp32"
    max_tokens = args.isl + args.new + 8
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rng = random.Random(0)
    for c in args.concurrency:
        requests = [GenerateRequest(f"r{i}", tuple(rng.randrange(2, 256) for _ in range(args.isl)),
                                    max_tokens=args.new, ignore_eos=True) for i in range(c)]

        def engine(n: int, c: int = c) -> DecodeEngine:
            pools = KVPools(cfg, fmt, max_tokens=max_tokens, max_seqs=c + 1, device=args.device, with_mtp=True)
            buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= c) or (1,)
            graphs = (DecodeGraphs(model, pools, buckets, max_tokens, tokens_per_row=n + 1, verify_max_rows=c)
                      if args.graphs else None)
            return DecodeEngine(model, pools, ByteTokenizer(cfg.vocab_size), f"d{n}",
                                DecodeConfig(prefill_token_budget=args.isl * c, max_running=c, speculative_tokens=n,
                                             speculative_max_batch=c),
                                graphs)

        warm = [dataclasses.replace(r, request_id=f"w{r.request_id}") for r in requests]
        run(engine(0), warm, sync)
        _, secs, steps, emitted = run(engine(0), requests, sync)
        base = secs / emitted
        print(json.dumps({"concurrency": c, "n": 0, "tpot_ms": base * 1e3 * c, "step_ms": secs / steps * 1e3,
                          "tokens_per_step": emitted / steps / c}), flush=True)
        for n in args.n:
            for p in args.accept:
                restore = forced(p)
                try:
                    run(engine(n), warm, sync)
                    e = engine(n)
                    _, secs, steps, emitted = run(e, requests, sync)
                finally:
                    restore()
                print(json.dumps({"concurrency": c, "n": n, "accept": p, "tpot_ms": secs / emitted * 1e3 * c,
                                  "step_ms": secs / steps * 1e3, "tokens_per_step": emitted / steps / c,
                                  "measured_accept": e.spec_accepted / max(1, e.spec_proposed),
                                  "speedup": base / (secs / emitted)}), flush=True)


if __name__ == "__main__":
    main()
