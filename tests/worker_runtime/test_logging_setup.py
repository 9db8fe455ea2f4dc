"""Logging setup of every v4serve process (worker_runtime/logging_setup.py): text or JSON lines at
the asked level, Ray's own worker tracebacks only at debug, bad options refused."""

from __future__ import annotations

import json
import logging

import pytest

from worker_runtime.logging_setup import LogOptions, configure, configure_worker, worker_setup


@pytest.fixture
def root():
    """The root logger as pytest set it up, restored afterwards."""
    r = logging.getLogger()
    handlers, level = list(r.handlers), r.level
    ray_level = logging.getLogger("ray").level
    yield r
    for h in list(r.handlers):
        r.removeHandler(h)
    for h in handlers:
        r.addHandler(h)
    r.setLevel(level)
    logging.getLogger("ray").setLevel(ray_level)


def test_json_lines_at_the_level(root, capsys):
    configure(LogOptions(level="warning", format="json"))
    log = logging.getLogger("v4serve.test")
    log.info("not shown")
    log.warning("port %d taken", 8000)
    try:
        raise ValueError("bad")
    except ValueError:
        log.exception("failed")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert (first["level"], first["logger"], first["msg"]) == ("warning", "v4serve.test", "port 8000 taken")
    assert first["ts"].endswith("+00:00") and "exc" not in first
    assert second["msg"] == "failed" and "ValueError: bad" in second["exc"]
    assert len(root.handlers) == 1  # a second configure replaces, never stacks
    configure(LogOptions())
    assert len(root.handlers) == 1 and root.level == logging.INFO


def test_text_lines_and_workers(root, capsys):
    worker_setup(LogOptions(level="info"))()  # what Ray runs in a worker process
    logging.getLogger("worker_runtime.engine_metrics").info("decode-0: running 1, waiting 0")
    assert "INFO worker_runtime.engine_metrics: decode-0: running 1, waiting 0" in capsys.readouterr().err
    # Ray's logger (its own handler) would print the traceback of an actor's exception, which the
    # caller reports as one line: silent unless debug
    assert not logging.getLogger("ray").isEnabledFor(logging.ERROR)
    configure_worker(LogOptions(level="debug"))
    assert logging.getLogger("ray").isEnabledFor(logging.DEBUG)


@pytest.mark.parametrize("kwargs, message", [({"level": "verbose"}, "log level"), ({"format": "xml"}, "log format"),
                                             ({"stats_interval_s": -1}, "stats interval")])
def test_bad_options_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LogOptions(**kwargs)
