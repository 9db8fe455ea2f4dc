"""What a grammar costs a decode step per token: the host filling each grammar row's bitmask
(llguidance, `model/grammar.py`), its copy to the GPU, and the mask applied to the logits before
sampling (`model/sampling.py::apply_bitmask`), at batch 1 / 16 / 64 and V4's vocabulary (129,280).

    python benchmarks/research/grammar_mask_bench.py --out grammar_mask.json [--batches 1 16 64] [--steps 40]

Every row holds the JSON schema of `grammar_backend_probe.py` and walks it token by token (a random
allowed token each step), so the masks are those of real mid-output states. The vocabulary is the
probe's synthetic byte-level BPE of 129,280 tokens (no V4 tokenizer is stored here). Per batch:

* fill_ms: the batch's bitmask on the host (`Grammars.bitmask`, rows filled in parallel by
  llguidance's executor) plus its copy to the device, median over `--steps` steps;
* apply_ms: `apply_bitmask` on fp32 logits [B, V] on the device (synchronised), median;
* sample_ms / sample_masked_ms: `sample_rows` at temperature 0.8 without / with the masks, so the
  difference is what the grammar adds to the sampling a step already does.

Prints a table and writes JSON with `--out` (device, vocab, and per batch the four medians).
Without a GPU it runs on the CPU (for a check of the script, not a figure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.research.grammar_backend_probe import SCHEMA, synthetic_tokenizer_json
from model.grammar import Grammars, from_json_schema
from model.sampling import SamplingParams, apply_bitmask, sample_rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(device, fn, *args, **kwargs) -> tuple[float, object]:
    """(milliseconds, fn's result), the device synchronised on both sides."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    _sync(device)
    return (time.perf_counter() - t0) * 1e3, out


def bench_batch(grammars: Grammars, batch: int, steps: int, device: torch.device) -> dict:
    grammar = from_json_schema(SCHEMA)
    states = [grammars.state(grammar) for _ in range(batch)]
    vocab = grammars.vocab_size
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(batch)]
    fill, apply, plain, masked = [], [], [], []
    for step in range(steps):
        states = [s if not s.done else grammars.state(grammar) for s in states]  # a finished row starts over
        logits = torch.randn(batch, vocab, device=device)
        ms, masks = _timed(device, grammars.bitmask, states, device)
        fill.append(ms)
        ms, _ = _timed(device, apply_bitmask, logits, masks)
        apply.append(ms)
        positions = [step] * batch
        ms, _ = _timed(device, sample_rows, logits, params, positions)
        plain.append(ms)
        ms, tokens = _timed(device, sample_rows, logits, params, positions, masks=masks)
        masked.append(ms)
        for s, t in zip(states, tokens):  # the walk follows the masked draw from random logits
            s.advance(t)
    warm = slice(2, None)  # the first steps pay allocations and kernel compilation
    return {name: statistics.median(v[warm]) for name, v in
            (("fill_ms", fill), ("apply_ms", apply), ("sample_ms", plain), ("sample_masked_ms", masked))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok_json, eos = synthetic_tokenizer_json(args.vocab)
    grammars = Grammars(tok_json, args.vocab, eos)
    t0 = time.perf_counter()
    grammars.prepare(from_json_schema(SCHEMA))
    index_s = time.perf_counter() - t0
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "vocab": args.vocab,
               "vocab_index_s": index_s, "batches": {}}
    print(f"{results['device']}, vocab {args.vocab}, vocabulary index {index_s:.2f} s")
    print(f"{'batch':>5} {'fill+copy ms':>13} {'apply ms':>9} {'sample ms':>10} {'sample+mask ms':>15}")
    for b in args.batches:
        torch.manual_seed(b)
        r = bench_batch(grammars, b, args.steps, device)
        results["batches"][str(b)] = r
        print(f"{b:>5} {r['fill_ms']:>13.3f} {r['apply_ms']:>9.3f} {r['sample_ms']:>10.3f} {r['sample_masked_ms']:>15.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
