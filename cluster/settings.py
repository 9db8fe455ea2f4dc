"""The only place v4serve reads environment variables.

The launcher calls `from_env()` once and passes the result down explicitly. `ray_log_defaults()`
sets what Ray reads from the environment about the worker lines it forwards, before Ray is imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Environment:
    redis_url: str | None  # REDIS_URL: use this Redis; unset → start a local Valkey server
    ray_address: str | None  # RAY_ADDRESS: join this Ray cluster; unset → start a local one
    cache_dir: Path  # XDG_CACHE_HOME/v4serve (default ~/.cache/v4serve): the cached tiny model


def from_env() -> Environment:
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Environment(redis_url=os.environ.get("REDIS_URL") or None,
                       ray_address=os.environ.get("RAY_ADDRESS") or None,
                       cache_dir=cache_root / "v4serve")


def ray_log_defaults() -> None:
    """Forward every worker line as it is: Ray folds lines that differ only in numbers into
    "[repeated Nx across cluster]", which would swallow the workers' periodic stats lines. An
    explicit RAY_DEDUP_LOGS in the environment wins."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
