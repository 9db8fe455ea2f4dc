"""Weight-loading progress: a checkpoint written as several shards reports shards and bytes read,
rising to 100% with the checkpoint's own totals; shown as log lines (at most one per interval,
plus the first and the last) or as a tqdm bar."""

from __future__ import annotations

import io
import itertools
import json
import logging
import re

import pytest

from model.checkpoint import INDEX_FILE, load_checkpoint, write_checkpoint
from model.load_progress import CHECKPOINT, LoadProgress, LoadTracker, ProgressReporter, describe

LOGGER = "model.load_progress"
LINE = re.compile(r"^Loading safetensors checkpoint shards: (\d+)% \| (\d+)/(\d+) shards, [\d.]+ (B|KiB|MiB) ?/"
                  r"[\d.]+ (B|KiB|MiB) \[\d\d:\d\d<(\d\d:\d\d|\?), [\d.]+ (B|KiB|MiB|GiB)/s\]$")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tiny_ckpt_cfg, tiny_ckpt_weights):
    """The tiny checkpoint in the official format as 7 shards."""
    return write_checkpoint(tmp_path_factory.mktemp("sharded"), tiny_ckpt_cfg, tiny_ckpt_weights, "official",
                            shard_bytes=200_000)


def _reports(caplog) -> list[LoadProgress]:
    return [r.load_progress for r in caplog.records if r.name == LOGGER]


@pytest.mark.parametrize("fmt", ["official", "hf"])
def test_sharded_checkpoint_reports_rising_progress_to_its_totals(tmp_path, caplog, fmt, sharded, tiny_ckpt_cfg,
                                                                  tiny_ckpt_weights):
    ckpt = sharded if fmt == "official" else write_checkpoint(tmp_path, tiny_ckpt_cfg, tiny_ckpt_weights, fmt,
                                                                shard_bytes=200_000)
    index = json.loads((ckpt / INDEX_FILE).read_text())
    shards = len(set(index["weight_map"].values()))
    assert shards >= 5
    with caplog.at_level(logging.INFO, logger=LOGGER):
        load_checkpoint(ckpt, with_mtp=fmt == "official", progress=ProgressReporter(bar=False, interval_s=0))
    got = _reports(caplog)
    assert {(p.what, p.unit, p.total, p.bytes_total) for p in got} == {
        (CHECKPOINT, "shards", shards, index["metadata"]["total_size"])}
    assert (got[0].done, got[0].bytes_done) == (0, 0)
    assert all(b.done >= a.done and b.bytes_done > a.bytes_done and b.elapsed_s >= a.elapsed_s
               for a, b in itertools.pairwise(got))
    assert sorted({p.done for p in got}) == list(range(shards + 1))  # shards finish one at a time
    last = got[-1]
    assert last.finished and last.done == shards and last.bytes_done == last.bytes_total and last.fraction == 1
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert all(LINE.match(m) for m in messages), messages[-1]
    assert LINE.match(messages[-1]).group(1) == "100" and f"| {shards}/{shards} shards" in messages[-1]


def test_lines_at_most_one_per_interval_plus_the_last(sharded, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        load_checkpoint(sharded, progress=ProgressReporter(bar=False, interval_s=3600, label="decode-3"))
    got = _reports(caplog)
    assert [p.done for p in got] == [0, got[-1].total] and got[-1].finished
    assert all(r.getMessage().startswith(f"decode-3: {CHECKPOINT}: ") for r in caplog.records if r.name == LOGGER)


def test_bar_on_a_terminal_draws_and_logs_nothing(sharded, caplog):
    out = io.StringIO()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        load_checkpoint(sharded, progress=ProgressReporter(bar=True, stream=out))
    assert _reports(caplog) == []
    shards = len(list(sharded.glob("model-*.safetensors")))
    final = out.getvalue().split("\r")[-1]
    assert final.startswith(f"{CHECKPOINT}: 100%") and f"{shards}/{shards}" in final
    assert re.search(r", ([\d.]+ MiB)/\1, [\d.]+ (KiB|MiB)/s\]", final), final


def test_progress_figures():
    p = LoadProgress(CHECKPOINT, "shards", 5, 11, 3 << 30, 6 << 30, 4.0)
    assert p.fraction == 0.5 and p.eta_s == 4.0 and p.bytes_per_s == 0.75 * (1 << 30) and not p.finished
    assert describe(p) == f"{CHECKPOINT}: 50% | 5/11 shards, 3.0 GiB/6.0 GiB [00:04<00:04, 768.0 MiB/s]"
    unknown = LoadProgress("Making dummy weights", "layers", 0, 4, 0, 0, 0.0)
    assert unknown.fraction == 0 and unknown.eta_s is None and "0/4 layers, 0 B [00:00<?, 0 B/s]" in describe(unknown)
    with pytest.raises(ValueError, match="totals must be >= 0"):
        LoadTracker(None, CHECKPOINT, "shards", -1)
    with pytest.raises(ValueError, match="interval must be >= 0"):
        ProgressReporter(bar=False, interval_s=-1)
