"""Multi-host tests: a cluster of several Ray nodes, each in its own network namespace
(tests/multihost/hosts.py). They need root; without it, or without iproute2, they are skipped
with the reason. Marker `multihost` (pyproject.toml)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    chosen = [item for item in items if item.get_closest_marker("multihost") is not None]
    if not chosen:
        return
    from tests.multihost.hosts import unavailable

    why = unavailable()
    if why is not None:
        for item in chosen:
            item.add_marker(pytest.mark.skip(reason=f"multi-host test skipped: {why}"))


@pytest.fixture(scope="module")
def reference(tiny_official_ckpt):
    from tests.multihost.work import reference

    return reference(tiny_official_ckpt)
