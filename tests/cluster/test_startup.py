"""Start-up fails fast and reads as one line: a port in use is refused before anything starts,
naming the port; a bad config.json prints one line and exits non-zero (the traceback only with
--log-level debug); workers Ray cannot place (no GPU) fail within --start-timeout with the
reason; a worker whose checkpoint is broken fails with the worker and the exception; --version
and the defaults in --help."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest


def v4serve(*args: str, env: dict | None = None, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "cluster.cli", *args], check=False, capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, **(env or {})})
    return out, time.monotonic() - start


def one_error_line(out: subprocess.CompletedProcess) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in out.stderr and "\x1b[" not in out.stderr, out.stderr
    return errors[0]


@pytest.fixture
def listening():
    """A port some other server listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


@pytest.fixture(scope="module")
def cli_start_s() -> float:
    """What the command line takes to start and exit at all (its imports: torch among them)."""
    return v4serve("--version")[1]


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
@pytest.mark.parametrize("command", ["up", "router"])
def test_port_in_use_fails_at_once_naming_it(tiny_official_ckpt, listening, flag, command, tmp_path, cli_start_s):
    other = "--grpc-port" if flag == "--http-port" else "--http-port"
    # the router would need RAY_ADDRESS / REDIS_URL: the port is checked before them
    out, seconds = v4serve(command, "--model", str(tiny_official_ckpt), flag, str(listening), other, "0",
                           env={"XDG_CACHE_HOME": str(tmp_path)})
    line = one_error_line(out)
    # ~2.5 s in all on an idle machine: the CLI's start, then the check (the bound allows for a loaded
    # one, where one interpreter start varies twofold; starting Ray alone takes 20 s there)
    assert out.returncode == 1 and seconds < max(5.0, 2 * cli_start_s + 3.0), (out.returncode, seconds, cli_start_s)
    assert f"{flag} {listening}" in line and "already in use" in line and f"pick a free one with {flag}" in line
    assert "ray" not in out.stderr.lower()  # nothing was started


@pytest.fixture
def bad_config(tiny_official_ckpt, tmp_path):
    ckpt = tmp_path / "bad"
    shutil.copytree(tiny_official_ckpt, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_hidden_layers"] = "four"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt


def test_bad_config_is_one_line(bad_config):
    out, seconds = v4serve("up", "--model", str(bad_config), "--http-port", "0", "--grpc-port", "0")
    line = one_error_line(out)
    assert out.returncode == 2 and "num_hidden_layers" in line and "must be an integer" in line
    assert seconds < 10  # before Ray starts
    debug, _ = v4serve("up", "--model", str(bad_config), "--http-port", "0", "--grpc-port", "0",
                       "--log-level", "debug")
    assert debug.returncode == 2 and "Traceback" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1] == line


def parse(*args: str) -> tuple[int, str, str]:
    """What the real parser prints for `args` and exits with (in this process: no start-up cost)."""
    from cluster.cli import build_parser

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as code:
        build_parser().parse_args(list(args))
    return code.value.code, out.getvalue(), err.getvalue()


def test_version_and_defaults_in_help():
    code, out, _ = parse("--version")
    assert code == 0 and out.startswith("v4serve ") and len(out.split()) == 2
    code, out, _ = parse("up", "--help")
    text = " ".join(out.split())  # argparse wraps lines
    for shown in ("--http-port HTTP_PORT OpenAI HTTP API and /metrics (0: any free) (default: 8000)",
                  "(default: 120)", "--log-level {debug,info,warning,error}", "(default: info)",
                  "--stats-interval STATS_INTERVAL", "(default: 10.0)", "(default: tiny)"):
        assert shown in text, shown
    assert "(default: None)" not in text and "(default: False)" not in text


def test_negative_stats_interval_refused():
    code, _, err = parse("up", "--stats-interval", "-1")
    assert code == 2 and "expected seconds >= 0" in err


@pytest.mark.cluster
@pytest.mark.exhaustive  # ~22 s waiting out a start timeout
def test_no_gpu_fails_within_start_timeout_with_the_reason(tiny_official_ckpt, tmp_path):
    pytest.importorskip("nixl")
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine may have a GPU")
    out, seconds = v4serve("up", "--model", str(tiny_official_ckpt), "--device", "cuda", "--gpus-per-worker", "1",
                           "--http-port", "0", "--grpc-port", "0", "--start-timeout", "3",
                           env={"XDG_CACHE_HOME": str(tmp_path)}, timeout=120)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 1 and len(errors) == 1, out.stderr[-3000:]
    assert "--start-timeout 3" in errors[0], errors
    assert "no GPU visible to Ray; pass --device cpu or run on a GPU node" in errors[0]
    assert "prefill-0" in errors[0] and "decode-0" in errors[0]
    assert "Traceback" not in out.stderr
    assert seconds < 60  # Ray's start and stop on a loaded 2-core machine, plus the 3 s


@pytest.mark.cluster
@pytest.mark.exhaustive  # ~30 s of Ray start-up (CI: the unplaceable workers above fail through the same wait)
def test_broken_checkpoint_names_the_worker_and_the_error(tiny_official_ckpt, tmp_path):
    """config.json is fine (checked up front), the weights are not: each worker's load fails,
    and the first failure is printed as one line instead of Ray's traceback."""
    pytest.importorskip("nixl")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_official_ckpt, ckpt)
    for weights in ckpt.glob("*.safetensors"):
        weights.write_bytes(b"not safetensors")
    out, _ = v4serve("up", "--model", str(ckpt), "--prefill", "0", "--http-port", "0", "--grpc-port", "0",
                     "--start-timeout", "60", env={"XDG_CACHE_HOME": str(tmp_path)}, timeout=180)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 1 and len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith("error: worker decode-0 failed to start: ") and "\x1b[" not in errors[0], errors
    assert "CheckpointError" in errors[0] and "Traceback" not in out.stderr  # nor the worker's, through Ray
