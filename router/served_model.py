"""What the router serves a checkpoint as: its names and its tokenizer's location.

- Names: `--served-model-name` (repeatable; the first is the one responses report), by default
  the checkpoint's own name (`_name_or_path` of its config.json, e.g.
  "deepseek-ai/DeepSeek-V4-Flash", else the directory's name). "v4serve" is always accepted
  too, so clients written against earlier versions keep working.
- Tokenizer: the checkpoint directory's `tokenizer.json`, or `--tokenizer` (a tokenizer.json or
  a directory holding one) to override it. The workers detokenize with the checkpoint
  directory's own tokenizer, so an override must give the same text for the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path

LEGACY_NAME = "v4serve"


def served_names(model_dir: str | Path, requested: list[str] | tuple[str, ...] = ()) -> tuple[str, ...]:
    """The names to serve `model_dir` under, the reported one first."""
    if any(not n.strip() for n in requested):
        raise ValueError("--served-model-name must not be empty")
    names = list(requested)
    if not names:
        try:
            raw = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{Path(model_dir) / 'config.json'}: {e}") from None
        own = raw.get("_name_or_path") if isinstance(raw, dict) else None
        names = [own if isinstance(own, str) and own.strip() else Path(model_dir).resolve().name]
    return tuple(dict.fromkeys([*names, LEGACY_NAME]))


def tokenizer_dir(model_dir: str | Path, override: str | Path | None) -> Path:
    """The directory whose tokenizer.json the router loads (the checkpoint's unless overridden)."""
    if override is None:
        return Path(model_dir)
    path = Path(override)
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.name != "tokenizer.json" or not path.is_file():
        raise ValueError(f"--tokenizer {override}: no tokenizer.json there")
    return path.parent
