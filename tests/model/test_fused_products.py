"""`Attention.fuse_products` (device format): products of one input run as one launch — wq_a | wkv
and wq_b | indexer.wq_b as one FP8 product each, the compressors' wkv | wgate and the indexer's
weights_proj as one bf16 product — with the parts' weights turned into row views of the fused
ones. On the CPU through the reference ops: each fused product gives its parts' outputs, the
state dict is unchanged, no weight is held twice, and the model's logits stay those of the
unfused model (tests/gpu/test_model_gpu.py compares the kernels' paths)."""

import copy

import pytest
import torch

from model.batch import ForwardBatch
from model.checkpoint import load_checkpoint
from model.kv_pool import KVPools, SeqKV
from model.quantized import Fp8Linear, quantize_model
from tests.model.kernel_cases import rel_err


def device_format(ckpt, act_fp8: bool, fuse: bool):
    _, model = load_checkpoint(ckpt)
    return quantize_model(model, "torch", act_fp8=act_fp8, fuse=fuse)


def attentions(model):
    return [m for m in model.modules() if hasattr(m, "fuse_products")]


@pytest.fixture(scope="module", params=[False, True], ids=["w8a16", "w8a8"])
def pair(request, tiny_official_ckpt):
    """(unfused, fused) device-format models of the tiny checkpoint."""
    return (device_format(tiny_official_ckpt, request.param, fuse=False),
            device_format(tiny_official_ckpt, request.param, fuse=True))


def test_each_fused_product_gives_its_parts_outputs(pair):
    plain, fused = pair
    g = torch.Generator().manual_seed(3)
    layers = list(zip(attentions(plain), attentions(fused)))
    assert sum(b.fused_qr is not None for _, b in layers) == 2  # the tiny model's two CSA layers
    for a, b in layers:
        x = torch.randn(5, a.cfg.hidden_size, generator=g).bfloat16()
        assert isinstance(b.fused_x, Fp8Linear)
        # the tiny wq_a has 32 rows: wkv starts on the next 128-row scale block
        assert b.fused_firsts["fused_x"] == [0, 128]
        for got, want in zip(b._products("fused_x", (b.wq_a, b.wkv), x), (a.wq_a(x), a.wkv(x))):
            assert torch.equal(got, want)
        qr = torch.randn(5, a.cfg.q_lora_rank, generator=g).bfloat16()
        if b.indexer is not None:
            got = b._products("fused_qr", (b.wq_b, b.indexer.wq_b), qr)
            for g_, w_ in zip(got, (a.wq_b(qr), a.indexer.wq_b(qr))):
                assert torch.equal(g_, w_)
        else:
            assert b.fused_qr is None
        got, want = b._bf16_products(x), a._bf16_products(x)
        assert [t is None for t in got] == [t is None for t in want] == [a.compressor is None, a.indexer is None,
                                                                         a.indexer is None]
        for i, (g_, w_) in enumerate(zip(got, want)):
            if g_ is None:
                continue
            assert g_.dtype == torch.float32 and g_.shape == w_.shape
            # the indexer's head weights were rounded to bf16 unfused; fused they stay fp32
            tol = 1e-2 if i == 2 else 1e-6
            assert rel_err(g_, w_) < tol, i


def test_fusion_keeps_the_state_and_adds_no_memory(pair):
    plain, fused = pair
    a, b = plain.state_dict(), fused.state_dict()
    assert a.keys() == b.keys()
    assert not [k for k in b if "fused" in k or "x_products" in k]
    for k in a:
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
                           b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k]), k
    for attn in attentions(fused):
        parts = [attn.wq_a, attn.wkv] + ([attn.wq_b, attn.indexer.wq_b] if attn.indexer is not None else [])
        parts_bf16 = [p for group in attn._bf16_linears() for p in group]
        for p in parts:
            owner = attn.fused_x if p in (attn.wq_a, attn.wkv) else attn.fused_qr
            for name in ("weight", "scale"):
                assert getattr(p, name).untyped_storage().data_ptr() == getattr(owner, name).untyped_storage().data_ptr()
        for p in parts_bf16:
            assert p.weight.untyped_storage().data_ptr() == attn.x_products.untyped_storage().data_ptr()

    def held(model):
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in list(model.parameters()) + list(model.buffers())}
        return sum(storages.values())

    # new: only the zero rows that put wkv on a scale block of its own (tiny widths; none at V4's)
    # and the fused modules' split-K arrival counters
    extra = 0
    for attn in attentions(fused):
        for f, parts in ((attn.fused_x, (attn.wq_a, attn.wkv)), (attn.fused_qr, (attn.wq_b, attn.indexer and attn.indexer.wq_b))):
            if f is not None:
                padding = f.weight.shape[0] - sum(p.weight.shape[0] for p in parts)
                extra += padding * f.weight.shape[1] + f.arrivals.nbytes
    assert held(fused) - held(plain) == extra


def test_fused_model_gives_the_unfused_logits(pair):
    plain, fused = pair
    cfg = plain.cfg

    def logits(model):
        pools = KVPools(cfg, "fp8_pack", max_tokens=256, max_seqs=1)
        seq = SeqKV()
        pools.reserve(seq, 200)
        out = []
        for tokens in (list(range(3, 150)), [7], [11], [13]):
            batch = ForwardBatch.build([(seq, tokens)])
            out.append(model(batch, pools).float())
            batch.commit()
        return torch.cat(out)

    # a copy of a fused model (tests compare impls on copies) runs too: its views are leaf tensors
    got, want = logits(copy.deepcopy(fused)), logits(plain)
    # fused, the indexer's head weights keep fp32 instead of bf16: picks may change at ties
    assert rel_err(got, want) < 2e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
