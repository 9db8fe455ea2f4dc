"""`--speculative-tokens` on `v4serve up` and `generate`: 0..3, into the workers' options with
`up`'s batch limit (`--speculative-max-batch`), and options that cannot serve it are refused with
the reason."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.cli import _worker_options
from cluster.cli_parser import build_parser
from worker_runtime.options import ExpertParallelOptions, WorkerOptions


@pytest.mark.parametrize("command", [["up"], ["generate", "--model", "m", "--prompt", "x", "--max-new-tokens", "1"]])
def test_the_flag_takes_0_to_3_and_defaults_to_off(command, capsys):
    parser = build_parser()
    assert parser.parse_args(command).speculative_tokens == 0
    assert parser.parse_args(command + ["--speculative-tokens", "3"]).speculative_tokens == 3
    with pytest.raises(SystemExit):
        parser.parse_args(command + ["--speculative-tokens", "4"])
    assert "--speculative-tokens" in capsys.readouterr().err


def test_worker_options_refuse_what_speculation_cannot_serve():
    with pytest.raises(ValueError, match="0..3"):
        WorkerOptions("m", "", speculative_tokens=4)
    with pytest.raises(ValueError, match="expert-parallel"):
        WorkerOptions("m", "", decode_ep=ExpertParallelOptions(size=2), speculative_tokens=1)
    with pytest.raises(ValueError, match="speculative_max_batch 12 must be one of decode_graphs"):
        WorkerOptions("m", "", device="cuda", kernels="triton", decode_graphs=(1, 8, 16), speculative_tokens=1,
                      speculative_max_batch=12)
    with pytest.raises(ValueError, match=">= 1"):
        WorkerOptions("m", "", speculative_tokens=1, speculative_max_batch=0)
    # a limit above every bucket: every graph verifies
    WorkerOptions("m", "", device="cuda", kernels="triton", decode_graphs=(1, 8), speculative_tokens=1,
                  speculative_max_batch=64)


def test_the_batch_limit_reaches_the_workers_options():
    router = SimpleNamespace(tokenizer_dir=None, model_name=None)
    args = build_parser().parse_args(["up", "--speculative-tokens", "2", "--speculative-max-batch", "8"])
    options = _worker_options(args, Path("m"), router)
    assert (options.speculative_tokens, options.speculative_max_batch) == (2, 8)
    assert _worker_options(build_parser().parse_args(["up"]), Path("m"), router).speculative_max_batch == 16
