"""CPU throughput of the pure-torch reference path on the tiny model.

Prefill: B requests of `--prompt` tokens in one batch → prompt tokens/s.
Decode: B requests at context `--prompt`, `--steps` single-token steps → generated tokens/s.

    python benchmarks/model_cpu_bench.py --batch 1 8 32 --kv-dtype fp32 --out results.json

No hardware ceiling: the reference path is the model's definition, not a fast path. Its figures
compare KV formats (fp32 against fp8_pack: what packing costs on the CPU) and batch sizes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model.batch import ForwardBatch  # noqa: E402
from model.kv_pool import KVPools, SeqKV  # noqa: E402
from model.tiny import random_weights, tiny_config  # noqa: E402
from model.transformer import Transformer  # noqa: E402


def bench(model: Transformer, fmt: str, batch: int, prompt: int, steps: int, repeats: int) -> dict:
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    prefill_s, decode_s = [], []
    for _ in range(repeats):
        pools = KVPools(cfg, fmt, page_size=256, max_tokens=prompt + steps, max_seqs=batch)
        seqs = [SeqKV() for _ in range(batch)]
        for s in seqs:
            pools.reserve(s, prompt + steps)
        items = [(s, torch.randint(0, cfg.vocab_size, (prompt,), generator=g).tolist()) for s in seqs]
        t0 = time.perf_counter()
        fb = ForwardBatch.build(items)
        logits = model(fb, pools)
        fb.commit()
        prefill_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(steps):
            fb = ForwardBatch.build([(s, [int(t)]) for s, t in zip(seqs, logits.argmax(-1))])
            logits = model(fb, pools)
            fb.commit()
            for s in seqs:
                pools.trim_window(s)
        decode_s.append(time.perf_counter() - t0)
    p, d = statistics.median(prefill_s), statistics.median(decode_s)
    return {"batch": batch, "kv_dtype": fmt, "prompt": prompt, "steps": steps,
            "prefill_tok_s": batch * prompt / p, "decode_tok_s": batch * steps / d,
            "decode_step_ms": 1000 * d / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--kv-dtype", nargs="+", default=["fp32", "fp8_pack"])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cfg = tiny_config()
    model = Transformer(cfg)
    model.load_state_dict(random_weights({k: v.shape for k, v in model.state_dict().items()}, cfg, 0))
    rows = [bench(model, fmt, b, args.prompt, args.steps, args.repeats) for fmt in args.kv_dtype for b in args.batch]
    print(f"threads={torch.get_num_threads()}  prompt={args.prompt}  decode steps={args.steps}")
    print("| kv dtype | batch | prefill tok/s | decode tok/s | decode step ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kv_dtype']} | {r['batch']} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.0f} | {r['decode_step_ms']:.1f} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
