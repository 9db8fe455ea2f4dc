"""`v4serve up --no-overlap` reaches the decode worker's engine, which then takes one step at a
time; by default its decode-only steps are queued ahead (decode_worker/overlap.py)."""

import dataclasses

import pytest

from cluster.cli import _router_config, _worker_options
from cluster.cli_parser import build_parser
from decode_worker.actor import DecodeWorker
from worker_runtime.in_process import InProcess


@pytest.mark.parametrize("flags, overlap", [([], True), (["--no-overlap"], False)])
def test_up_overlap_option_reaches_the_decode_engine(tiny_official_ckpt, registry_url, flags, overlap):
    args = build_parser().parse_args(["up", "--model", str(tiny_official_ckpt), *flags])
    options = _worker_options(args, tiny_official_ckpt, _router_config(args, tiny_official_ckpt))
    assert options.overlap is overlap
    worker = DecodeWorker("decode-o", dataclasses.replace(options, registry_url=registry_url, max_tokens=64,
                                                          max_seqs=2), InProcess())
    assert worker.engine.config.overlap is overlap
