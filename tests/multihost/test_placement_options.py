"""Placement by host, without Ray: `v4serve up --prefill-resources / --decode-resources` parse
into the custom resources each pool's actors request, and bad values are refused by name."""

from __future__ import annotations

import argparse

import pytest

from cluster.cli_parser import _resources, build_parser
from cluster.launcher import ClusterOptions
from worker_runtime.options import WorkerOptions


def test_flags_become_the_actors_resources():
    args = build_parser().parse_args(["up", "--prefill-resources", "v4serve_prefill=1", "--decode-resources",
                                      "v4serve_decode=1,rack.b-2=0.5"])
    options = ClusterOptions(WorkerOptions("m", ""), prefill_resources=args.prefill_resources,
                             decode_resources=args.decode_resources)
    assert options.resources("prefill") == {"prefill": 1, "v4serve_prefill": 1.0}
    assert options.resources("decode") == {"decode": 1, "v4serve_decode": 1.0, "rack.b-2": 0.5}
    assert ClusterOptions(WorkerOptions("m", "")).resources("decode") == {"decode": 1}  # the default: roles only


@pytest.mark.parametrize("text", ["v4serve_prefill", "x=0", "x=-1", "x=abc", "=1", "1x=1", "x=1,x=2", ","])
def test_malformed_resources_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        _resources(text)


@pytest.mark.parametrize("name", ["CPU", "GPU", "memory", "prefill", "decode", "node:10.0.0.1"])
def test_reserved_resources_are_refused(name):
    with pytest.raises(ValueError, match="not a custom resource"):
        ClusterOptions(WorkerOptions("m", ""), decode_resources=((name, 1.0),))
