"""Sampling defaults for fields a request leaves unset: the checkpoint's `generation_config.json`
where it names them, else OpenAI's (temperature 1, top_p 1, no top-k).

Read once at startup (`GenerationDefaults.from_model_dir`); a value outside the range a request
could ask for is a startup error naming the file and the field, not a silent clamp.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_FIELDS = ("temperature", "top_p", "top_k")


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off

    def __post_init__(self):
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"default temperature must be in [0, 2], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"default top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"default top_k must be >= -1 (-1 or 0: off), got {self.top_k}")

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None) -> GenerationDefaults:
        """The defaults of `model_dir/generation_config.json`; OpenAI's when there is none."""
        if model_dir is None:
            return cls()
        path = Path(model_dir) / "generation_config.json"
        if not path.exists():
            return cls()
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object")  # noqa: TRY004 - a config error, reported as such
        values = {}
        for name in _FIELDS:
            v = raw.get(name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (name == "top_k" and not isinstance(v, int)):
                raise ValueError(f"{path}: '{name}' must be a number, got {v!r}")
            values[name] = max(v, 0) if name == "top_k" else float(v)
        if raw.get("do_sample") is False:  # greedy unless a request asks otherwise
            values["temperature"] = 0.0
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
