"""mHC kernels (hc_pre with Sinkhorn, hc_post, hc_head) against the torch reference."""

import pytest
import torch

from model.kernels import mhc
from tests.model.kernel_cases import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _params(hc, D, mix, g):
    fn = (torch.randn(mix, hc * D, generator=g) / (hc * D) ** 0.5).to(DEVICE)
    base = (0.5 * torch.randn(mix, generator=g)).to(DEVICE)
    scale = (0.5 + torch.rand(3 if mix > hc else 1, generator=g)).to(DEVICE)
    return fn, base, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 21])
def test_hc_pre_matches_reference(dtype, T):
    g = torch.Generator().manual_seed(40 + T)
    hc, D = 4, 192
    x = torch.randn(T, hc, D, generator=g).to(DEVICE, dtype)
    fn, base, scale = _params(hc, D, (2 + hc) * hc, g)
    ref = mhc.hc_pre(x, fn, base, scale, hc, 20, 1e-6, 1e-6, impl="torch")
    out = mhc.hc_pre(x, fn, base, scale, hc, 20, 1e-6, 1e-6, impl="triton")
    for a, b in zip(out, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert rel_err(out[1], ref[1]) < 1e-5 and rel_err(out[2], ref[2]) < 1e-5
    assert rel_err(out[0], ref[0]) < (1e-5 if dtype == torch.float32 else 5e-3)
    # Sinkhorn output is (nearly) doubly stochastic
    assert torch.allclose(out[2].sum(-2), torch.ones_like(out[2].sum(-2)), atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", [mhc.MixTiles(bt=64), mhc.MixTiles(bt=32, bk=64, split=3),
                                   mhc.MixTiles(bt=16, split=2, num_warps=8, collapse_split=3)], ids=str)
def test_hc_pre_launch_shapes_agree(dtype, tiles):
    """Every launch shape (tokens per program, K per step, K splits, warps, D splits of the
    collapse) computes the same outputs: 70 tokens leave a partial token block, D = 200 a partial
    K step; 3 collapse splits of D = 200 give a full chunk, a partial one and an empty one."""
    g = torch.Generator().manual_seed(45)
    hc, D, T = 4, 200, 70
    x = torch.randn(T, hc, D, generator=g).to(DEVICE, dtype)
    fn, base, scale = _params(hc, D, (2 + hc) * hc, g)
    ref = mhc.hc_pre(x, fn, base, scale, hc, 20, 1e-6, 1e-6, impl="torch")
    out = mhc.hc_pre(x, fn, base, scale, hc, 20, 1e-6, 1e-6, impl="triton", tiles=tiles)
    assert rel_err(out[1], ref[1]) < 1e-5 and rel_err(out[2], ref[2]) < 1e-5
    assert rel_err(out[0], ref[0]) < (1e-5 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_matches_reference(dtype):
    g = torch.Generator().manual_seed(50)
    T, hc, D = 9, 4, 300
    x = torch.randn(T, hc, D, generator=g).to(DEVICE, dtype)
    out = torch.randn(T, D, generator=g).to(DEVICE, dtype)
    post = (2 * torch.rand(T, hc, generator=g)).to(DEVICE)
    comb = torch.rand(T, hc, hc, generator=g).to(DEVICE)
    ref = mhc.hc_post(out, x, post, comb, impl="torch")
    got = mhc.hc_post(out, x, post, comb, impl="triton")
    assert got.dtype == dtype
    assert rel_err(got, ref) < (1e-6 if dtype == torch.float32 else 5e-3)


def test_hc_head_matches_reference():
    g = torch.Generator().manual_seed(60)
    T, hc, D = 5, 4, 64
    x = torch.randn(T, hc, D, generator=g).to(DEVICE, torch.bfloat16)
    fn, base, scale = _params(hc, D, hc, g)
    ref = mhc.hc_head(x, fn, base, scale, 1e-6, 1e-6, impl="torch")
    got = mhc.hc_head(x, fn, base, scale, 1e-6, 1e-6, impl="triton")
    assert rel_err(got, ref) < 5e-3

