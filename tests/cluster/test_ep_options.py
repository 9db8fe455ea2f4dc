"""Expert-parallel prefill and decode options: each invalid setting is refused where the options are built,
with a message naming the field; `v4serve up` reports it as one line, exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import cli
from cluster.launcher import ClusterOptions, LocalCluster
from cluster.settings import Environment
from cluster.up import UpOptions
from router.config import RouterConfig
from worker_runtime.options import ExpertParallelOptions, WorkerOptions


def ep_worker(ckpt, size: int) -> WorkerOptions:
    return WorkerOptions(str(ckpt), "", prefill_ep=ExpertParallelOptions(size=size))


@pytest.mark.parametrize("kwargs, message", [
    ({"size": 0}, "group size must be >= 1"),
    ({"idle_tick_s": 0.0}, "0 < idle_tick_s < timeout_s"),
    ({"idle_tick_s": 5.0, "timeout_s": 2.0}, "0 < idle_tick_s < timeout_s"),
])
def test_bad_group_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExpertParallelOptions(**kwargs)


def test_group_size_must_divide_the_routed_experts(tiny_official_ckpt):
    with pytest.raises(ValueError, match="prefill_ep.size 3 must divide the model's 8 routed experts"):
        ep_worker(tiny_official_ckpt, 3)
    assert ep_worker(tiny_official_ckpt, 4).prefill_ep.size == 4


def test_prefill_workers_come_in_whole_groups(tiny_official_ckpt):
    worker = ep_worker(tiny_official_ckpt, 2)
    with pytest.raises(ValueError, match=r"prefill \(3 workers\) must be a multiple of prefill_ep.size \(2\)"):
        ClusterOptions(worker, prefill=3)
    cluster = ClusterOptions(worker, prefill=4)
    with pytest.raises(ValueError, match="cannot be used with expert-parallel prefill"):
        UpOptions(cluster, RouterConfig(), autoscale="policy")
    with pytest.raises(ValueError, match="whole groups"):
        LocalCluster(cluster, Environment(None, None, Path("/tmp"))).add_worker("prefill")


@pytest.mark.parametrize("flags, message", [
    (["--prefill", "3", "--prefill-ep", "2"], "must be a multiple of prefill_ep.size"),
    (["--prefill", "3", "--prefill-ep", "3"], "must divide the model's 8 routed experts"),
    (["--prefill-ep", "0"], None),  # argparse: not a positive integer
])
def test_up_refuses_bad_prefill_ep_flags(tiny_official_ckpt, capsys, flags, message):
    try:
        status = cli.main(["up", "--model", str(tiny_official_ckpt), *flags])
    except SystemExit as e:  # argparse's own refusal
        status = e.code
    assert status == 2
    if message:
        assert message in capsys.readouterr().err


def test_decode_groups_are_checked_like_prefill_groups(tiny_official_ckpt):
    with pytest.raises(ValueError, match="decode_ep.size 3 must divide the model's 8 routed experts"):
        WorkerOptions(str(tiny_official_ckpt), "", decode_ep=ExpertParallelOptions(size=3))
    worker = WorkerOptions(str(tiny_official_ckpt), "", decode_ep=ExpertParallelOptions(size=2))
    with pytest.raises(ValueError, match=r"decode \(3 workers\) must be a multiple of decode_ep.size \(2\)"):
        ClusterOptions(worker, decode=3)
    cluster = ClusterOptions(worker, decode=4)
    with pytest.raises(ValueError, match="cannot be used with expert-parallel decode"):
        UpOptions(cluster, RouterConfig(), autoscale="policy")
    with pytest.raises(ValueError, match="expert-parallel decode workers come in whole groups"):
        LocalCluster(cluster, Environment(None, None, Path("/tmp"))).add_worker("decode")


@pytest.mark.parametrize("flags, message", [
    (["--decode", "3", "--decode-ep", "2"], "must be a multiple of decode_ep.size"),
    (["--decode", "3", "--decode-ep", "3"], "must divide the model's 8 routed experts"),
])
def test_up_refuses_bad_decode_ep_flags(tiny_official_ckpt, capsys, flags, message):
    assert cli.main(["up", "--model", str(tiny_official_ckpt), *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_group_runs_without_ray():
    """`worker_runtime.ep_group` needs Ray only in the actors' entry points (`listen`, `join`), so the group
    and the 2-GPU test that builds it directly (tests/gpu/test_ep_decode_group.py) run where Ray is
    not installed: import it with Ray's import refused."""
    import subprocess
    import sys

    code = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Refuse())
import worker_runtime.ep_group, decode_worker.engine, worker_runtime.model_loader
assert "ray" not in sys.modules
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
