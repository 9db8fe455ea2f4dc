"""Which grammar library constrains v4serve's decoding: xgrammar 0.2.9 against llguidance 1.9.1 on the
CPU work each puts on a worker, at DeepSeek-V4's vocabulary size (129,280 ids).

    python benchmarks/research/grammar_backend_probe.py [--vocab 129280] [--tokens 200] [--out F]

No V4 tokenizer is stored on this machine, so the probe builds a byte-level BPE `tokenizer.json` of
`--vocab` ids whose tokens are the most frequent substrings (2..12 bytes) of the Python standard
library's sources: a realistic mix of words, code and whitespace runs, and what both libraries
index (a token's bytes). Three timings per library:

* tokenizer: the per-worker preparation of the vocabulary (once per process);
* compile: a typical JSON schema (an object with a nested object, an enum, bounded integers, an
  array of strings, a required list) to a matcher, cold (the schema not seen before);
* mask: one token's bitmask [ceil(V/32)] int32 on the host, mean and p99 over a walk of
  `--tokens` tokens that picks a random allowed token each step.

Measured on this 2-core CPU machine (the workers' host threads do this work on GPU hosts too):

    library      tokenizer   compile (cold)   mask mean / p99 per token
    xgrammar       1.33 s       130.1 ms         0.61 / 5.7 ms
    llguidance     0.86 s         1.57 ms        0.18 / 2.2 ms

(150 tokens, the machine shared, so the p99s are noisy.) The choice is llguidance: its compile
is lazy (the lexer is built as the output needs it) so a new schema costs under 2 ms where
xgrammar precompiles the whole grammar against the vocabulary (130 ms here, seconds for large
schemas, which must then run off the loop); its mean mask is a third of xgrammar's; and its Lark front end takes
`%json{...}` inside a grammar, which is what a DeepSeek-V4 DSML tool call with JSON-schema
arguments needs (`router/response_format.py`).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.tokenizer_tiny import byte_chars

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def synthetic_tokenizer_json(vocab: int) -> tuple[str, int]:
    """(a byte-level BPE tokenizer.json of `vocab` ids, its EOS id)."""
    counts: collections.Counter = collections.Counter()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:400]:
        data = path.read_bytes()
        for n in (2, 3, 4, 5, 6, 8, 10, 12):
            counts.update(data[i:i + n] for i in range(0, len(data) - n, n))
    chars = byte_chars()
    vocab_map = {c: b for b, c in enumerate(chars)}
    for piece, _ in counts.most_common():
        if len(vocab_map) >= vocab - 2:
            break
        vocab_map.setdefault("".join(chars[b] for b in piece), len(vocab_map))
    specials = [{"id": len(vocab_map) + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True} for i, t in enumerate(["<bos>", "<eos>"])]
    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": specials, "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                             "use_regex": False},
           "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": False,
                                                "trim_offsets": False, "use_regex": False},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                     "ignore_merges": False, "vocab": vocab_map, "merges": []}}
    return json.dumps(doc), len(vocab_map) + 1


def _walk(mask_fn, allowed_fn, consume_fn, done_fn, tokens: int, rng) -> list[float]:
    times = []
    for _ in range(tokens):
        if done_fn():
            break
        t0 = time.perf_counter()
        mask = mask_fn()
        times.append(time.perf_counter() - t0)
        consume_fn(rng.choice(allowed_fn(mask)))
    return times


def _allowed(mask, vocab: int) -> list[int]:
    import torch
    bits = (mask.reshape(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return [i for i in bits.reshape(-1).nonzero().flatten().tolist() if i < vocab]


def probe_llguidance(tok_json: str, vocab: int, eos: int, tokens: int) -> dict:
    import llguidance
    import llguidance.torch as llt
    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    t_tok = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(tok, grammar)
    t_compile = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    bitmask = llt.allocate_token_bitmask(1, vocab)

    def mask():
        llt.fill_next_token_bitmask(m, bitmask, 0)
        return bitmask[0]
    times = _walk(mask, lambda b: _allowed(b, vocab), m.consume_token, m.is_stopped, tokens, random.Random(0))
    return {"tokenizer_s": t_tok, "compile_ms": t_compile * 1e3, "mask_ms": times}


def probe_xgrammar(tok_json: str, vocab: int, eos: int, tokens: int) -> dict:
    import xgrammar as xgr
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok_json), eos_token="<eos>")
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    t_compile = time.perf_counter() - t0
    m = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def mask():
        m.fill_next_token_bitmask(bitmask, 0)
        return bitmask[0]
    times = _walk(mask, lambda b: _allowed(b, vocab), m.accept_token, m.is_terminated, tokens, random.Random(0))
    return {"tokenizer_s": t_tok, "compile_ms": t_compile * 1e3, "mask_ms": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args()
    tok_json, eos = synthetic_tokenizer_json(args.vocab)
    results = {}
    for name, fn in (("xgrammar", probe_xgrammar), ("llguidance", probe_llguidance)):
        r = fn(tok_json, args.vocab, eos, args.tokens)
        ms = sorted(t * 1e3 for t in r.pop("mask_ms"))
        r.update(tokens=len(ms), mask_mean_ms=statistics.fmean(ms), mask_p99_ms=ms[min(len(ms) - 1, int(len(ms) * .99))])
        results[name] = r
        print(f"{name:11s} tokenizer {r['tokenizer_s']:.2f} s  compile {r['compile_ms']:.2f} ms  "
              f"mask mean {r['mask_mean_ms']:.3f} ms p99 {r['mask_p99_ms']:.3f} ms over {len(ms)} tokens")
    if args.out:
        Path(args.out).write_text(json.dumps({"vocab": args.vocab, **results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
