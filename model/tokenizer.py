"""Tokenizers: a byte-level one for tiny models, `tokenizer.json` (HF `tokenizers`) for real ones.

The byte tokenizer maps UTF-8 bytes to ids 0..255 and reserves ids from 256 for special tokens
(BOS, EOS and the DeepSeek-V4 chat markers), so tiny models can serve the chat API too.
"""

from __future__ import annotations

import re
from pathlib import Path

BYTE_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                 "<think>", "</think>")


class ByteTokenizer:
    def __init__(self, vocab_size: int):
        if vocab_size < 256 + len(BYTE_SPECIALS):
            raise ValueError(f"byte tokenizer needs vocab_size >= {256 + len(BYTE_SPECIALS)}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.special = {tok: 256 + i for i, tok in enumerate(BYTE_SPECIALS)}
        self._special_by_id = {i: t for t, i in self.special.items()}
        self.bos_id, self.eos_id = 256, 257
        self._split = re.compile("(" + "|".join(map(re.escape, self.special)) + ")")

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes; special-token strings embedded in `text` map to their ids."""
        ids: list[int] = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:  # odd parts are the captured special tokens
                ids.append(self.special[part])
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: list[int]) -> str:
        out, buf = [], bytearray()
        for t in ids:
            if t < 256:
                buf.append(t)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            out.append(self._special_by_id.get(t, ""))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def to_json(self) -> str:
        """The same tokenizer as a Hugging Face `tokenizer.json` (for libraries that index a vocabulary)."""
        from model.tokenizer_tiny import tiny_tokenizer_json  # it builds on this module's specials

        return tiny_tokenizer_json(self.vocab_size)


class HFTokenizer:
    """`tokenizer.json` of a real checkpoint through the `tokenizers` library."""

    def __init__(self, path: Path, bos_id: int | None, eos_id: int | None):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def to_json(self) -> str:
        return self._tok.to_str()


def load_tokenizer(model_dir: str | Path, vocab_size: int, bos_id: int | None, eos_id: int | None):
    path = Path(model_dir) / "tokenizer.json"
    if path.exists():
        return HFTokenizer(path, bos_id, eos_id)
    return ByteTokenizer(vocab_size)
