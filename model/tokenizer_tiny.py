"""The tiny model's `tokenizer.json`: the byte tokenizer (model/tokenizer.py) as a Hugging Face
`tokenizers` file, so any Hugging Face client (AutoTokenizer, benchmark tools) loads the tiny
model's tokenizer from its directory and gets exactly the ids the server uses.

A byte-level BPE without merges: byte b is id b (its GPT-2 byte-level character in the vocabulary),
the byte tokenizer's special tokens follow as ids 256.., and the rest of the model's vocabulary is
reserved placeholders, which decode to nothing as the byte tokenizer decodes unknown ids.
Encoding equals `ByteTokenizer`'s for every text, and decoding for every id sequence except
one: invalid UTF-8 bytes on both sides of a placeholder are one run here (one U+FFFD where
the byte tokenizer, which decodes the runs apart, gives two).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from model.tokenizer import BYTE_SPECIALS

PLACEHOLDER = "<｜place▁holder▁no▁{}｜>"


def byte_chars() -> list[str]:
    """GPT-2's byte → printable character map, the alphabet of byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_tokenizer_json(vocab_size: int) -> str:
    specials = list(BYTE_SPECIALS) + [PLACEHOLDER.format(i) for i in range(vocab_size - 256 - len(BYTE_SPECIALS))]
    if len(specials) + 256 != vocab_size or vocab_size < 256 + len(BYTE_SPECIALS):
        raise ValueError(f"the byte tokenizer needs vocab_size >= {256 + len(BYTE_SPECIALS)}, got {vocab_size}")
    added = [{"id": 256 + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(specials)]
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"Regex": "<｜place▁holder▁no▁[0-9]+｜>"}, "content": ""},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {c: b for b, c in enumerate(byte_chars())}, "merges": []},
    }
    return json.dumps(doc, ensure_ascii=False, indent=1)


def _write_atomically(path: Path, text: str) -> None:
    """Readers of a shared model directory (a cached tiny model) see the whole file or none."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_tiny_tokenizer(model_dir: str | Path, vocab_size: int) -> None:
    """tokenizer.json and tokenizer_config.json (for AutoTokenizer) into the model directory."""
    out = Path(model_dir)
    _write_atomically(out / "tokenizer.json", tiny_tokenizer_json(vocab_size))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BYTE_SPECIALS[0],
              "eos_token": BYTE_SPECIALS[1], "add_bos_token": False, "add_eos_token": False,
              "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}
    _write_atomically(out / "tokenizer_config.json", json.dumps(config, ensure_ascii=False, indent=1) + "\n")
