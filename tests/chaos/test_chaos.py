"""The chaos matrix as tests: the short subset (`ci=True` scenarios) runs with the CPU suite, the
rest is marked `exhaustive` (`pytest -m exhaustive tests/chaos`, or `python -m tests.chaos.run_matrix` for the
whole matrix and its report). The host and network faults (host_scenarios.py) share one set of
hosts (hosts_bed.HostsRig) for the module."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")

import ray  # noqa: E402

from tests.chaos.harness import make_load, references  # noqa: E402
from tests.chaos.host_scenarios import HOST_SCENARIOS  # noqa: E402
from tests.chaos.hosts_bed import HostsRig  # noqa: E402
from tests.chaos.run_matrix import LONG_SHARE, REQUESTS, run_scenario  # noqa: E402
from tests.chaos.scenarios import SCENARIOS  # noqa: E402

pytestmark = pytest.mark.cluster  # starts Ray

CI = [s for s in SCENARIOS if s.ci]
FULL = [s for s in SCENARIOS if not s.ci]


@pytest.fixture(scope="module", autouse=True)
def own_ray():
    yield
    if ray.is_initialized():  # the suite's Ray (harness.ensure_ray): later modules start their own
        ray.shutdown()


@pytest.fixture(scope="module")
def small_load(tiny_official_ckpt):
    """The CI subset's load: fewer, shorter requests (their references are most of its time)."""
    load = make_load(0, 8, max_tokens=(12, 28), long_share=0.75)
    return load, references(tiny_official_ckpt, load)


@pytest.fixture(scope="module")
def full_load(tiny_official_ckpt):
    load = make_load(0, REQUESTS, long_share=LONG_SHARE)
    return load, references(tiny_official_ckpt, load)


@pytest.fixture(scope="module")
def rig(tiny_official_ckpt):
    rig = HostsRig(tiny_official_ckpt)
    yield rig
    rig.down()


def _run(scenario, ckpt, load_and_refs, rig=None):
    load, refs = load_and_refs
    row = run_scenario(ckpt, scenario, load, refs, rig=rig)
    if row.skipped:
        pytest.skip(row.skipped)
    assert not row.problems, (row.observed.note, row.problems)
    assert row.counted[0], f"fault not counted: {row.counted[1]} ({row.observed.note})"


@pytest.mark.parametrize("scenario", CI, ids=[s.name for s in CI])
def test_chaos_subset(scenario, tiny_official_ckpt, small_load):
    _run(scenario, tiny_official_ckpt, small_load)


@pytest.mark.exhaustive
@pytest.mark.parametrize("scenario", FULL, ids=[s.name for s in FULL])
def test_chaos_matrix(scenario, tiny_official_ckpt, full_load):
    _run(scenario, tiny_official_ckpt, full_load)


@pytest.mark.exhaustive
@pytest.mark.multihost
@pytest.mark.parametrize("scenario", HOST_SCENARIOS, ids=[s.name for s in HOST_SCENARIOS])
def test_host_faults(scenario, tiny_official_ckpt, full_load, rig):
    _run(scenario, tiny_official_ckpt, full_load, rig)
