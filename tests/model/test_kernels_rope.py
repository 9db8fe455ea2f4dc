"""Fused RoPE kernels against the torch reference (interpreter on CPU, compiled on a GPU)."""

import copy

import pytest
import torch

from model.kernels.attention import rope as rope_ops
from model.kv_pool import KVPools
from model.rope import Rope
from model.tiny import tiny_config
from tests.model.kernel_cases import fill_random, random_batch, rel_err, unpack_all

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotate_matches_reference(dtype, inverse):
    g = torch.Generator().manual_seed(1)
    rope = Rope(64, 160000.0, tiny_config().rope_scaling)
    x = torch.randn(7, 5, 128, generator=g).to(DEVICE, dtype)
    pos = torch.randint(0, 5000, (7,), generator=g).to(DEVICE)
    ref = rope_ops.rotate(x, pos, rope, "torch", inverse=inverse)
    out = rope_ops.rotate(x, pos, rope, "triton", inverse=inverse)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 4e-3)
    assert torch.equal(out[..., :64], x[..., :64])  # nope channels untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_rms_rope_matches_reference(dtype):
    g = torch.Generator().manual_seed(2)
    rope = Rope(64, 10000.0, None)
    q = (3 * torch.randn(9, 4, 128, generator=g)).to(DEVICE, dtype)
    pos = torch.randint(0, 300, (9,), generator=g).to(DEVICE)
    ref = rope_ops.q_rms_rope(q, pos, rope, 1e-6, "torch")
    out = rope_ops.q_rms_rope(q, pos, rope, 1e-6, "triton")
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8_pack"])
def test_store_kv_writes_what_the_reference_writes(fmt):
    cfg = tiny_config()
    pools = KVPools(cfg, fmt, max_tokens=1024, max_seqs=4, device=DEVICE)
    fill_random(pools, seed=3)
    batch = random_batch(cfg, pools, [(0, 40), (300, 1), (517, 30)], seed=4, device=DEVICE)
    before, twin = copy.deepcopy(pools), copy.deepcopy(pools)
    g = torch.Generator().manual_seed(5)
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    kv = torch.randn(batch.input_ids.shape[0], cfg.head_dim, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(cfg.head_dim, generator=g)).to(DEVICE)
    rope = Rope.for_layer(cfg, compressed=True)
    rope_ops.store_kv(kv, batch, pools, 2, w, 1e-6, rope, "torch")
    rope_ops.store_kv(kv, batch, twin, 2, w, 1e-6, rope, "triton")
    ref, out, old = unpack_all(pools, "swa"), unpack_all(twin, "swa"), unpack_all(before, "swa")
    written = (ref != old).any(1)
    assert written.sum() == batch.input_ids.shape[0]  # one entry per token, nothing else
    assert torch.equal(out[~written], old[~written])
    assert rel_err(out, ref) < 1e-6
    if fmt != "fp32":  # rounded formats: bit-exact but for an ulp of cos/sin flipping a rounding
        assert (pools.buffers["swa"] != twin.buffers["swa"]).sum().item() <= 8


@pytest.mark.parametrize("fmt", ["bf16", "fp8_pack"])
def test_q_rope_and_kv_store_in_one_launch_equal_the_two_launches(fmt):
    """`q_rms_rope_store_kv` (the KV store as one more program column of the query grid) gives the
    bits of `q_rms_rope` and `store_kv` launched apart: the rotated q and every pool byte; q a column
    slice of a wider product, as the fused wq_b | indexer.wq_b hands it over."""
    cfg = tiny_config()
    pools = KVPools(cfg, fmt, max_tokens=1024, max_seqs=4, device=DEVICE)
    fill_random(pools, seed=6)
    batch = random_batch(cfg, pools, [(0, 40), (300, 1), (517, 30)], seed=7, device=DEVICE)
    twin = copy.deepcopy(pools)
    g = torch.Generator().manual_seed(8)
    T, H, d = batch.input_ids.shape[0], cfg.num_attention_heads, cfg.head_dim
    wide = (3 * torch.randn(T, H * d + 96, generator=g)).to(DEVICE, torch.bfloat16)
    q = wide[:, :H * d].view(T, H, d)
    kv = torch.randn(T, d, generator=g).to(DEVICE, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE)
    rope = Rope.for_layer(cfg, compressed=True)
    want = rope_ops.q_rms_rope(q, batch.positions, rope, 1e-6, "triton")
    rope_ops.store_kv(kv, batch, pools, 2, w, 1e-6, rope, "triton")
    got = rope_ops.q_rms_rope_store_kv(q, kv, batch, twin, 2, w, 1e-6, rope, "triton")
    assert torch.equal(got, want)
    assert torch.equal(twin.buffers["swa"], pools.buffers["swa"])
    ref = rope_ops.q_rms_rope_store_kv(q, kv, batch, copy.deepcopy(pools), 2, w, 1e-6, rope, "torch")
    assert rel_err(got, ref) < 4e-3
