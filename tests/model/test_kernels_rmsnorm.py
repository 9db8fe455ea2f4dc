"""RMSNorm kernel against the torch reference."""

import pytest
import torch

from model.kernels.common import rmsnorm
from tests.model.kernel_cases import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(dtype):
    g = torch.Generator().manual_seed(70)
    x = (3 * torch.randn(2, 7, 300, generator=g)).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(300, generator=g)).to(DEVICE)
    got = rmsnorm.rms_norm(x, w, 1e-6, "triton")
    ref = rmsnorm.rms_norm(x, w, 1e-6, "torch")
    assert got.shape == x.shape and got.dtype == dtype
    assert rel_err(got, ref) < (1e-6 if dtype == torch.float32 else 4e-3)
