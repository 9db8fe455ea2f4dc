"""Codecs: the 584-byte KV pack decodes to the official fake-quantised values; weight codecs."""

import torch

from model import low_precision


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_kv_pack_is_584_bytes_for_v4_shapes():
    assert low_precision.kv_pack_bytes(512, 64) == 584
    assert low_precision.index_pack_bytes(128) == 132


def test_packed_kv_decodes_to_official_fake_quant():
    x = randn(257, 512, seed=1, scale=3.0)
    x[5, :64] *= 1000  # one block with a large dynamic range
    packed = low_precision.pack_kv(x, 64)
    assert packed.shape == (257, 584) and packed.dtype == torch.uint8
    assert torch.equal(low_precision.unpack_kv(packed, 512, 64), low_precision.fake_quant_kv(x, 64))
    assert (packed[:, 583] == 0).all()  # pad byte


def test_fake_quant_semantics():
    x = randn(64, 512, seed=2)
    fq = low_precision.fake_quant_kv(x, 64)
    # rope dims are exactly bf16-rounded
    assert torch.equal(fq[:, -64:], x[:, -64:].to(torch.bfloat16).float())
    # nope dims: per-64 power-of-two scale, values within e4m3 relative precision
    blocks = x[:, :448].unflatten(-1, (7, 64))
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1) / 448)))
    assert torch.equal(scale, torch.exp2(torch.round(torch.log2(scale))))
    err = (fq[:, :448] - x[:, :448]).abs().unflatten(-1, (7, 64))
    assert (err <= blocks.abs() * 2 ** -4 + scale.unsqueeze(-1) * 2 ** -9).all()


def test_index_key_pack_round_trip():
    x = randn(100, 128, seed=3)
    packed = low_precision.pack_index_key(x)
    assert packed.shape == (100, 132)
    y = low_precision.unpack_index_key(packed, 128)
    assert ((y - x).abs() <= x.abs().amax(-1, keepdim=True) * 2 ** -4).all()


def test_fp8_weight_round_trip_and_scales_are_ue8m0():
    w = randn(300, 200, seed=4, scale=0.05)
    q, s = low_precision.fp8_quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (3, 2)
    back = low_precision.fp8_dequantize_weight(q, s)
    rel = (back - w).norm() / w.norm()
    assert 0 < rel < 0.05


def test_fp4_pack_low_nibble_first_and_round_trip():
    w = torch.tensor([[0.5, 6.0] + [0.0] * 30])
    packed, s = low_precision.fp4_quantize_weight(w)
    assert packed.shape == (1, 16) and s.shape == (1, 1)
    assert packed.view(torch.uint8)[0, 0].item() == (1 | (7 << 4))  # 0.5 -> code 1 low, 6.0 -> code 7 high
    w = randn(64, 128, seed=5)
    packed, s = low_precision.fp4_quantize_weight(w)
    back = low_precision.fp4_dequantize_weight(packed, s)
    blocks = w.unflatten(-1, (-1, 32))
    # every value is within half a grid step (≤ 1.0 × scale at the top of the e2m1 range)
    assert ((back - w).abs().unflatten(-1, (-1, 32)) <= s.float().unsqueeze(-1) * 1.0 + 1e-6).all()
    assert torch.allclose(low_precision.fp4_dequantize_weight(*low_precision.fp4_quantize_weight(back)), back)
