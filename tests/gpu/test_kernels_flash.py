"""Kernel parity at DeepSeek-V4-Flash shapes on the GPU (head 512 = 448 FP8 nope + 64 bf16 rope,
64 heads, window 128, indexer 64 × 128 with top-512, hidden 4096), random pools, fp8_pack and bf16.
The interpreter tests in tests/model/ cover the same kernels at tiny shapes on any machine."""

import copy

import pytest
import torch

from model import low_precision
from model.kernels.attention import compressor, indexer, rope as rope_ops, sparse_attention
from model.kernels.gemm import act_quant, fp8_cublas, fp8_gemm
from model.kernels.mhc import mhc
from model.kv_pool import KVPools
from model.rope import Rope
from model.tiny import flash_config
from tests.model.kernel_cases import (
    block_weights,
    fill_random,
    mhc_inputs,
    random_batch,
    random_picks,
    rel_err,
    unpack_all,
)
from tests.model.test_kernels_indexer import topk_in_entry_order

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"
CFG = flash_config(4)  # layers 0, 1: window only; 2: ratio 4; 3: ratio 128
DECODE = [(8191, 1)] * 6 + [(3000, 1), (129, 1)]
PREFILL = [(4096, 512), (0, 300)]


@pytest.fixture(scope="module", params=["fp8_pack", "bf16"])
def pools(request):
    p = KVPools(CFG, request.param, max_tokens=8192 + 256, max_seqs=len(DECODE) + len(PREFILL) + 1, device=DEV)
    fill_random(p, seed=1)
    return p


def attention_args(pools, shapes, layer, ratio, seeds):
    """`sparse_attention.attend`'s leading arguments on a copy of `pools`: a random batch (seed
    seeds[0]), random q [T, 64, 512] bf16 and sink (seed seeds[1]), picks on CSA layers."""
    pools_ = copy.deepcopy(pools)
    batch = random_batch(CFG, pools_, shapes, seed=seeds[0], device=DEV)
    g = torch.Generator(device=DEV).manual_seed(seeds[1])
    q = torch.randn(batch.input_ids.shape[0], 64, 512, device=DEV, generator=g).bfloat16()
    sink = torch.randn(64, device=DEV, generator=g)
    picks = random_picks(batch, 512, 4, DEV) if ratio == 4 else None
    return q, batch, pools_, layer, ratio, picks, sink, 128, Rope.for_layer(CFG, ratio > 0)


@pytest.mark.parametrize("shapes", [DECODE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("layer,ratio", [(0, 0), (2, 4), (3, 128)])
def test_sparse_attention(pools, shapes, layer, ratio):
    args = attention_args(pools, shapes, layer, ratio, seeds=(2, 3))
    ref = sparse_attention.attend(*args, impl="torch")
    out = sparse_attention.attend(*args, impl="triton")
    assert bool(out.isfinite().all()) and rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("shapes", [DECODE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("layer,ratio", [(0, 0), (2, 4), (3, 128)])
@pytest.mark.parametrize("splits", [None, 1, 2, 16])
def test_sparse_attention_wgmma_kernel_matches_the_triton_kernel(pools, shapes, layer, ratio, splits):
    """sparse_attention_wgmma (sm_90, fp8_pack) against the Triton kernel at the same split count:
    the same bf16 operands, so only the order of the fp32 sums differs."""
    if pools.format != "fp8_pack" or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel reads fp8_pack pools on sm_90")
    args = (*attention_args(pools, shapes, layer, ratio, seeds=(4, 5)), "triton")
    out = sparse_attention.attend(*args, splits=splits, wgmma=True)
    triton_kernel = sparse_attention.attend(*args, splits=splits, wgmma=False)
    ref = sparse_attention.attend(*args[:-1], impl="torch")
    assert bool(out.isfinite().all())
    assert rel_err(out, triton_kernel) < 1e-4 and rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("layer,ratio,kind", [(2, 4, "c4"), (3, 128, "c128"), (2, 4, "c4_indexer")])
def test_compressor(pools, layer, ratio, kind):
    base = copy.deepcopy(pools)
    batch = random_batch(CFG, base, [(4095, 1), (8063, 1), (1000, 300), (0, 256)], seed=5, device=DEV)
    h = 128 if kind == "c4_indexer" else 512
    coff = 2 if ratio == 4 else 1
    g = torch.Generator(device=DEV).manual_seed(6)
    proj = torch.randn(batch.input_ids.shape[0], 2 * coff * h, device=DEV, generator=g)
    ape = 0.5 * torch.randn(ratio, coff * h, device=DEV, generator=g)
    w = 1 + 0.1 * torch.randn(h, device=DEV, generator=g)
    rope = Rope.for_layer(CFG, True)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    compressor.compress(proj, batch, a, layer, ratio, kind, f"state_{kind}", ape, w, 1e-6, rope, "torch")
    compressor.compress(proj, batch, b, layer, ratio, kind, f"state_{kind}", ape, w, 1e-6, rope, "triton")
    assert torch.equal(a.buffers[f"state_{kind}"], b.buffers[f"state_{kind}"])
    ref, out = unpack_all(a, kind), unpack_all(b, kind)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("fp8_query", [False, True])
def test_indexer(pools, fp8_query):
    base = copy.deepcopy(pools)
    batch = random_batch(CFG, base, DECODE + [(2048, 512)], seed=7, device=DEV)
    T = batch.input_ids.shape[0]
    assert batch.meta.max_end // 4 <= indexer.TOPK_KERNEL_MAX_N  # the select kernel selects
    g = torch.Generator(device=DEV).manual_seed(8)
    q = torch.randn(T, 64, 128, device=DEV, generator=g).bfloat16()
    w = torch.randn(T, 64, device=DEV, generator=g) / 8
    ref = indexer.indexer_topk(q, w, batch, base, 2, 512, "torch", fp8_query=fp8_query)
    out = indexer.indexer_topk(q, w, batch, base, 2, 512, "triton", fp8_query=fp8_query)
    assert torch.equal(out < 0, ref < 0)
    # same selection up to near-ties: overlap of the two top-512 sets
    overlap = [len(set(o[o >= 0].tolist()) & set(r[r >= 0].tolist())) / max(1, int((r >= 0).sum()))
               for o, r in zip(out.cpu(), ref.cpu())]
    assert min(overlap) > 0.95


@pytest.mark.parametrize("R", [1, 64, 8192])
@pytest.mark.parametrize("n", [2048, 8192])
def test_top_k_rows(n, R):
    """Decode and 8K prefill rows (2048 entries at 8K tokens, 8192 at 32K): the kernel picks exactly
    what torch.topk picks, in entry order, causal tails -1."""
    g = torch.Generator(device=DEV).manual_seed(n + R)
    scores = torch.randn(R, n, device=DEV, generator=g)
    visible = n - (torch.arange(R, device=DEV) * n) // R  # row 0 sees all n
    scores = scores.masked_fill(torch.arange(n, device=DEV)[None, :] >= visible[:, None], float("-inf"))
    assert torch.equal(indexer.top_k(scores, 512), topk_in_entry_order(scores, 512))


def test_store_kv_and_q_rope(pools):
    base = copy.deepcopy(pools)
    batch = random_batch(CFG, base, PREFILL + DECODE, seed=9, device=DEV)
    T = batch.input_ids.shape[0]
    g = torch.Generator(device=DEV).manual_seed(10)
    kv = torch.randn(T, 512, device=DEV, generator=g).bfloat16()
    w = 1 + 0.1 * torch.randn(512, device=DEV, generator=g)
    rope = Rope.for_layer(CFG, True)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    rope_ops.store_kv(kv, batch, a, 2, w, 1e-6, rope, "torch")
    rope_ops.store_kv(kv, batch, b, 2, w, 1e-6, rope, "triton")
    assert (a.buffers["swa"] != b.buffers["swa"]).float().mean() < 1e-6
    q = torch.randn(T, 64, 512, device=DEV, generator=g).bfloat16()
    assert rel_err(rope_ops.q_rms_rope(q, batch.positions, rope, 1e-6, "triton"),
                   rope_ops.q_rms_rope(q, batch.positions, rope, 1e-6, "torch")) < 4e-3


@pytest.mark.parametrize("M", [1, 16, 17, 64, 200, 256, 4096])
@pytest.mark.parametrize("N,K,G", [(32768, 1024, 1), (4096, 8192, 1), (1024, 4096, 8), (512, 4096, 1)])
def test_fp8_gemm(M, N, K, G):
    g = torch.Generator(device=DEV).manual_seed(M + N)
    q, s = low_precision.fp8_quantize_weight(block_weights(G * N, K, g, DEV) / K ** 0.5)
    s = s.float()
    x = torch.randn(*((M, G, K) if G > 1 else (M, K)), device=DEV, generator=g).bfloat16()
    ref = fp8_gemm.fp8_linear(x.float(), q, s, "torch", G)
    out = fp8_gemm.fp8_linear(x, q, s, "triton", G)
    assert rel_err(out, ref) < 6e-3


@pytest.mark.parametrize("M,N,K,G", [(128, 40960, 1024, 1), (256, 40960, 1024, 1), (128, 4096, 8192, 1),
                                     (254, 4096, 8192, 1), (1024, 512, 4096, 1), (1021, 4096, 8192, 1),
                                     (1024, 1024, 4096, 8), (1023, 1024, 4096, 8)])
def test_w8a8_large_batch_on_cublas_blockwise(M, N, K, G):
    """A decode batch's large W8A8 products and prefill's (the grouped wo_a too) go to cuBLAS's
    blockwise FP8 GEMM (rows not a multiple of 4 padded): the reference of the same codes within one
    bf16 rounding, the W8A8 kernel's result (decode sizes) within the two sum orders, the same bits
    again and in a CUDA graph's replay."""
    assert fp8_cublas.applies(M, N, K, torch.device(DEV), G, prefill=M > fp8_gemm.KERNEL_MAX_M)
    g = torch.Generator(device=DEV).manual_seed(M + K + G)
    q, s = low_precision.fp8_quantize_weight(block_weights(G * N, K, g, DEV) / K ** 0.5)
    s = s.float()
    x = torch.randn(*((M, G, K) if G > 1 else (M, K)), device=DEV, generator=g).bfloat16()
    out = fp8_gemm.fp8_linear(x, q, s, "triton", G, act_fp8=True)
    ref = fp8_gemm.fp8_linear(x.float(), q, s, "torch", G, act_fp8=True)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert rel_err(out, ref) < 6e-3
    if M <= fp8_gemm.KERNEL_MAX_M:
        codes, x_scale = act_quant.quantize(x[:, None], "triton")
        kernel = fp8_gemm.decode_product(codes, q, s, None, out_dtype=torch.float32, x_scale=x_scale)[:, 0]
        assert rel_err(out, kernel) < 6e-3
    assert torch.equal(fp8_gemm.fp8_linear(x, q, s, "triton", G, act_fp8=True), out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fp8_gemm.fp8_linear(x, q, s, "triton", G, act_fp8=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)


@pytest.mark.parametrize("T", [1, 256, 4096])
def test_mhc(T):
    x, fn, base, scale = mhc_inputs(T, DEV)
    g = torch.Generator(device=DEV).manual_seed(T + 1)
    ref = mhc.hc_pre(x, fn, base, scale, 4, 20, 1e-6, 1e-6, "torch")
    out = mhc.hc_pre(x, fn, base, scale, 4, 20, 1e-6, 1e-6, "triton")
    assert rel_err(out[0], ref[0]) < 5e-3 and rel_err(out[1], ref[1]) < 1e-4 and rel_err(out[2], ref[2]) < 1e-4
    o = torch.randn(T, 4096, device=DEV, generator=g).bfloat16()
    assert rel_err(mhc.hc_post(o, x, out[1], out[2], "triton"), mhc.hc_post(o, x, out[1], out[2], "torch")) < 5e-3
