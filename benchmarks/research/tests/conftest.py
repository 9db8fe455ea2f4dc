"""The probes' own tests, run by hand (`python -m pytest benchmarks/research/tests`), outside the
CI suite: the repository root on sys.path and, without a GPU, the Triton kernels in the
interpreter, as tests/conftest.py sets them up for the product's tests."""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    from tests.triton_interpreter import install as _install_interpreter_shim  # noqa: E402

    _install_interpreter_shim()
