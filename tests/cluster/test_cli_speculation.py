"""`--speculative-tokens` on `v4serve up` and `generate`: 0..3, into the workers' options, and
options that cannot serve it are refused with the reason."""

from __future__ import annotations

import pytest

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
