"""Logging of every v4serve process: the CLI (`v4serve up`, `router`, ...) and the worker actors.

    LogOptions(level, format, stats_interval_s)   what `--log-level`, `--log-format` and
                                                  `--stats-interval` set, passed to the workers
    configure(options)                            the root logger: one stderr handler, text or JSON lines
    load_progress(options)                        how loading weights shows its progress: a bar or lines

Workers run in Ray's worker processes, whose stderr Ray forwards to the console of the process
that created them (`log_to_driver`), each line prefixed with the actor's repr: the worker's id
(`(decode-0 pid=123) ...`). `worker_setup(options)` is the hook Ray runs in each worker process
before any actor is created in it, so the workers log at the same level and in the same format.

JSON lines carry `ts` (ISO 8601, UTC), `level`, `logger`, `msg`, and `exc` when there is a
traceback: one object per line, for log collectors that parse JSON.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TextIO

from model.load_progress import ProgressReporter

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOAD_PROGRESS_INTERVAL_S = 5.0  # between two weight-loading progress lines (not the bar)


@dataclass(frozen=True)
class LogOptions:
    level: str = "info"  # LEVELS
    format: str = "text"  # FORMATS
    # every worker logs a stats line (running, waiting, KV use, tokens/s) this often; 0: never
    stats_interval_s: float = 10.0

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"log level must be one of {LEVELS}, got {self.level!r}")
        if self.format not in FORMATS:
            raise ValueError(f"log format must be one of {FORMATS}, got {self.format!r}")
        if self.stats_interval_s < 0:
            raise ValueError(f"stats interval must be >= 0 seconds (0: off), got {self.stats_interval_s}")

    @property
    def debug(self) -> bool:
        return self.level == "debug"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(options: LogOptions) -> None:
    """Send this process's log records at `options.level` and above to stderr, formatted as asked;
    replaces handlers configured before (a second call reconfigures). Chatty libraries stay at
    WARNING unless the level is debug."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if options.format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(options.level.upper())
    for name in ("httpx", "httpcore", "asyncio", "urllib3", "filelock"):
        logging.getLogger(name).setLevel(logging.DEBUG if options.debug else logging.WARNING)


def configure_worker(options: LogOptions) -> None:
    """`configure`, in a Ray worker process. Ray logs there the traceback of every exception an
    actor raises (its construction included) while the caller gets the same exception, which
    v4serve reports as one line: those tracebacks show only at level debug."""
    configure(options)
    logging.getLogger("ray").setLevel(logging.DEBUG if options.debug else logging.CRITICAL)


def worker_setup(options: LogOptions):
    """The callable Ray runs first in every worker process (runtime_env's
    `worker_process_setup_hook`, which wants a named function): `configure_worker`."""
    def v4serve_logging() -> None:
        configure_worker(options)
    return v4serve_logging


def load_progress(options: LogOptions, stream: TextIO | None = None, label: str = "") -> ProgressReporter:
    """Weight-loading progress as this process shows it: a tqdm bar when `stream` (stderr) is a
    terminal and logs are text; INFO lines every LOAD_PROGRESS_INTERVAL_S otherwise (a worker's
    stderr goes to Ray line by line; a bar would also break JSON lines). At level warning or
    error the lines are filtered out, and no bar is drawn either. `label` leads each line."""
    stream = stream or sys.stderr
    bar = options.format == "text" and options.level in ("debug", "info") and stream.isatty()
    return ProgressReporter(bar, LOAD_PROGRESS_INTERVAL_S, stream, label)
