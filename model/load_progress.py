"""How far loading a model's weights has got: checkpoint shards read, or layers of dummy weights made.

    LoadProgress                       one report: parts (shards or layers) and bytes done of total,
                                       seconds since the start; its fraction, rate and time left
    LoadTracker(report, ...)           what a loader calls as it goes (`step`), sending LoadProgress
    ProgressReporter(bar, interval_s,  a `report` that shows them: a tqdm bar on a terminal, else an
                     label=...)        INFO line (logger `model.load_progress`) at most every
                                       `interval_s` seconds, plus the first and the last; `label`
                                       (a worker id) leads each line

A bar redraws its line with carriage returns, which garbles output read as lines (a worker's stderr
reaches the console of `v4serve up` through Ray line by line) and JSON log lines: there the lines
take its place, `Loading safetensors checkpoint shards: 45% | 5/11 shards, 3.1 GiB/6.9 GiB
[00:03<00:04, 1.0 GiB/s]`.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from tqdm import tqdm

log = logging.getLogger(__name__)

CHECKPOINT = "Loading safetensors checkpoint shards"
DUMMY = "Making dummy weights"
_REDRAW_S = 0.1  # the bar's bytes move with every tensor; it redraws at most this often between parts


@dataclass(frozen=True)
class LoadProgress:
    what: str  # CHECKPOINT or DUMMY
    unit: str  # what the parts are: "shards" or "layers"
    done: int
    total: int
    bytes_done: int
    bytes_total: int  # 0: not known ahead (dummy weights)
    elapsed_s: float

    @property
    def finished(self) -> bool:
        return self.done >= self.total

    @property
    def fraction(self) -> float:
        """Of the bytes where their total is known, else of the parts."""
        if self.bytes_total:
            return self.bytes_done / self.bytes_total
        return self.done / self.total if self.total else 1.0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far (None before anything is done)."""
        f = self.fraction
        return self.elapsed_s * (1 - f) / f if f > 0 else None


class LoadTracker:
    """A loader's running count: `step(parts, nbytes)` after each piece, reporting the totals so far
    (the first report, at construction, says nothing is done yet)."""

    def __init__(self, report: Callable[[LoadProgress], None] | None, what: str, unit: str, total: int,
                 bytes_total: int = 0):
        if total < 0 or bytes_total < 0:
            raise ValueError(f"load progress totals must be >= 0, got {total} {unit} and {bytes_total} bytes")
        self.report, self.what, self.unit, self.total, self.bytes_total = report, what, unit, total, bytes_total
        self.done = self.bytes_done = 0
        self.start = time.perf_counter()
        self._send()

    def step(self, parts: int = 0, nbytes: int = 0) -> None:
        self.done += parts
        self.bytes_done += nbytes
        self._send()

    def _send(self) -> None:
        if self.report is not None:
            self.report(LoadProgress(self.what, self.unit, self.done, self.total, self.bytes_done, self.bytes_total,
                                     time.perf_counter() - self.start))


def size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def describe(p: LoadProgress) -> str:
    """`Loading safetensors checkpoint shards: 45% | 5/11 shards, 3.1 GiB/6.9 GiB [00:03<00:04, 1.0 GiB/s]`."""
    of = f"/{size(p.bytes_total)}" if p.bytes_total else ""
    eta = "?" if p.eta_s is None else tqdm.format_interval(p.eta_s)
    return (f"{p.what}: {p.fraction:.0%} | {p.done}/{p.total} {p.unit}, {size(p.bytes_done)}{of} "
            f"[{tqdm.format_interval(p.elapsed_s)}<{eta}, {size(p.bytes_per_s)}/s]")


class ProgressReporter:
    """Shows LoadProgress reports: as a tqdm bar on `stream` with `bar`, else as log lines (the record
    carries the report as `load_progress`), at most one per `interval_s` besides the first and the
    last. `label` leads the lines (`decode-0: Loading ...`), as the workers' stats lines."""

    def __init__(self, bar: bool, interval_s: float = 5.0, stream: TextIO | None = None, label: str = ""):
        if interval_s < 0:
            raise ValueError(f"progress interval must be >= 0 seconds, got {interval_s}")
        self.bar, self.interval_s, self.stream = bar, interval_s, stream
        self.prefix = f"{label}: " if label else ""
        self._tqdm: tqdm | None = None
        self._logged_at: float | None = None
        self._drawn_at = 0.0

    def __call__(self, p: LoadProgress) -> None:
        if self.bar:
            self._draw(p)
        elif p.finished or self._logged_at is None or p.elapsed_s - self._logged_at >= self.interval_s:
            self._logged_at = p.elapsed_s
            log.info("%s%s", self.prefix, describe(p), extra={"load_progress": p})

    def _draw(self, p: LoadProgress) -> None:
        if self._tqdm is None:
            self._tqdm = tqdm(total=p.total, desc=self.prefix + p.what, unit=p.unit.removesuffix("s"),
                              file=self.stream or sys.stderr, dynamic_ncols=True)
        elif p.done == self._tqdm.n and not p.finished and p.elapsed_s - self._drawn_at < _REDRAW_S:
            return  # a report per tensor: a checkpoint of 100k tensors would redraw 100k times
        self._drawn_at = p.elapsed_s
        self._tqdm.n = p.done
        of = f"/{size(p.bytes_total)}" if p.bytes_total else ""
        self._tqdm.set_postfix_str(f"{size(p.bytes_done)}{of}, {size(p.bytes_per_s)}/s", refresh=False)
        self._tqdm.refresh()
        if p.finished:
            self._tqdm.close()
            self._tqdm = None
