"""`v4serve` command line: make-tiny, generate (and, as the cluster grows, up / drain).

Arguments are parsed and validated here, turned into frozen option objects once, and passed
explicitly; bad input prints one line `error: ...` on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from model.kv_pool import STORAGE_FORMATS


class CliError(Exception):
    """A user error: reported as one line, exit status 2."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="v4serve", description="DeepSeek-V4 disaggregated serving")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny", help="write a small random V4 checkpoint")
    tiny.add_argument("--out", required=True, type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--format", choices=("official", "hf"), default="official")

    gen = sub.add_parser("generate", help="run one request in this process")
    gen.add_argument("--model", required=True, type=Path, help="checkpoint directory")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", type=_token_ids, help="comma-separated token ids")
    gen.add_argument("--max-new-tokens", type=_positive, required=True)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--kv-dtype", choices=STORAGE_FORMATS, default="fp32")
    gen.add_argument("--chunk-size", type=_positive, default=None)
    gen.add_argument("--logits-out", type=Path, default=None, help="save float32 [new_tokens, vocab] .npy")
    return parser


def cmd_make_tiny(args: argparse.Namespace) -> None:
    from model.checkpoint import write_checkpoint
    from model.tiny import random_weights, tiny_config
    from model.transformer import Transformer

    import torch

    cfg = tiny_config()
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg, with_mtp=args.format == "official").state_dict().items()}
    write_checkpoint(args.out, cfg, random_weights(shapes, cfg, args.seed), args.format)
    print(json.dumps({"model": str(args.out), "format": args.format, "seed": args.seed}))


def cmd_generate(args: argparse.Namespace) -> None:
    from model.checkpoint import load_checkpoint
    from model.generate import generate
    from model.kv_pool import KVPools
    from model.sampling import SamplingParams
    from model.tokenizer import load_tokenizer

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValueError as e:
        raise CliError(str(e)) from None
    cfg, model = load_checkpoint(args.model)
    tokenizer = load_tokenizer(args.model, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    prompt = args.prompt_ids if args.prompt_ids is not None else tokenizer.encode(args.prompt)
    if not prompt:
        raise CliError("prompt is empty")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise CliError(f"prompt token ids out of range [0, {cfg.vocab_size}): {bad[:5]}")
    total = len(prompt) + args.max_new_tokens
    if total > cfg.max_position_embeddings:
        raise CliError(f"prompt ({len(prompt)} tokens) + max new tokens ({args.max_new_tokens}) exceeds the "
                       f"model's max_position_embeddings ({cfg.max_position_embeddings})")
    pools = KVPools(cfg, args.kv_dtype, max_tokens=total, max_seqs=1)
    stop = frozenset({cfg.eos_token_id} if cfg.eos_token_id is not None else ())
    out = generate(model, pools, prompt, args.max_new_tokens, params, chunk_size=args.chunk_size,
                   stop_ids=stop, keep_logits=args.logits_out is not None)
    if args.logits_out is not None:
        np.save(args.logits_out, out.logits.numpy().astype(np.float32))
    print(json.dumps({"token_ids": out.token_ids, "text": tokenizer.decode(out.token_ids),
                      "finish_reason": out.finish_reason}))


COMMANDS = {"make-tiny": cmd_make_tiny, "generate": cmd_generate}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, OSError) as e:  # config / checkpoint errors name the problem
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
