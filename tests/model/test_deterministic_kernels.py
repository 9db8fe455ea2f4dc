"""The kernels' `--deterministic` paths under the Triton interpreter: a row computed alone is the
same bits as inside batches of other sizes and companions (`torch.equal`), for every kernel whose
choice the flag fixes: the fixed-tile matmul, the FP8 GEMM (W8A16 and W8A8, plain and grouped,
in row slices past `KERNEL_MAX_M`), the sparse attention (fixed KV splits through the combine,
a batch's wider -1-padded picks, row slices), the indexer's logits and picks, the mHC entry, and
the MoE gate and experts (fused tiles of one K order at every size, the shared expert's dense
products); and the device-format tiny model composed of them."""

from __future__ import annotations

import pytest
import torch

from model import low_precision
from model.batch import ForwardBatch
from model.kernels.attention import indexer, sparse_attention
from model.kernels.gemm import fixed_matmul, fp8_gemm
from model.kernels.mhc import mhc
from model.kernels.moe import moe_fused
from model.kv_pool import KVPools, SeqKV
from model.moe import MoE, experts_forward
from model.rope import Rope
from model.tiny import tiny_config
from tests.model.kernel_cases import block_weights, fill_random, mhc_inputs, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# 14-38 s each under the interpreter on 2 cores (the MoE and the composed model: ~5-20 min): outside CI's budget;
# tests/gpu/test_deterministic_gpu.py runs the same paths compiled, composed into full-width layers
COSTLY = pytest.mark.exhaustive


def _rows_alone_match(run, x: torch.Tensor, sizes=(1, 2, 5)) -> None:
    """run(x[rows]) row for row equals run(x) for leading slices and a shifted slice of x."""
    full = run(x)
    for n in sizes:
        assert torch.equal(run(x[:n]), full[:n]), n
    assert torch.equal(run(x[3:4]), full[3:4])  # a row from the middle, alone


@pytest.mark.parametrize("dtype, N", [(torch.bfloat16, 200), (torch.float32, 200),
                                      pytest.param(torch.bfloat16, 4100, marks=COSTLY)])
def test_fixed_matmul_rows_do_not_depend_on_the_batch(dtype, N):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, 150, generator=g).to(DEVICE, dtype)
    x = torch.randn(70, 150, generator=g).to(DEVICE, dtype)
    _rows_alone_match(lambda a: fixed_matmul.linear(a, w), x, sizes=(1, 7, 64))
    ref = x.double() @ w.double().T
    assert rel_err(fixed_matmul.linear(x, w, torch.float32), ref) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_fixed_matmul_ranges_split_or_walked_give_the_same_bits():
    """K over `RANGE_K` (three ranges, the last short of a whole step): its ranges over programs of
    their own and walked in one give the same bits, and a row's bits do not depend on which of
    the two its step takes (`splits`: a few rows split, 70 rows walk, on the interpreter's 4 SMs)."""
    g = torch.Generator().manual_seed(2)
    K = 2 * fixed_matmul.RANGE_K + 76
    w = torch.randn(40, K, generator=g).to(DEVICE, torch.bfloat16)
    x = torch.randn(70, K, generator=g).to(DEVICE, torch.bfloat16)
    sms = 132 if DEVICE == "cuda" else 4
    assert fixed_matmul.ranges(K) == 3 and fixed_matmul.splits(5, 40, K, sms) and not fixed_matmul.splits(70, 40, K, 4)
    walked = fixed_matmul.linear(x, w, torch.float32, split=False)
    assert torch.equal(fixed_matmul.linear(x, w, torch.float32, split=True), walked)
    _rows_alone_match(lambda a: fixed_matmul.linear(a, w, torch.float32), x, sizes=(1, 7, 64))
    assert rel_err(walked, x.double() @ w.double().T) < 1e-2
    # another tile shape, the K order unchanged (on the GPU, deterministic_kernels_probe.py --tiles)
    other = fixed_matmul.linear(x, w, torch.float32, split=False, tiles={"BLOCK_M": 16, "BLOCK_N": 64})
    assert torch.equal(other, walked)
    with pytest.raises(ValueError, match="tiles may set"):
        fixed_matmul.linear(x, w, tiles={"BLOCK_K": 32})  # the K order is not a tile's to change


@pytest.mark.parametrize("act_fp8, groups", [(False, 1), (True, 1), (False, 4), pytest.param(True, 4, marks=COSTLY)])
def test_fp8_gemm_rows_do_not_depend_on_the_batch(act_fp8, groups):
    g = torch.Generator().manual_seed(1)
    N, K = 96, 384
    q, s = low_precision.fp8_quantize_weight(block_weights(groups * N, K, g))
    q, s = q.to(DEVICE), s.float().to(DEVICE)
    shape = (18, groups, K) if groups > 1 else (18, K)
    x = torch.randn(*shape, generator=g).to(DEVICE, torch.bfloat16)

    def run(a):
        return fp8_gemm.fp8_linear(a, q, s, "triton", groups, act_fp8=act_fp8, deterministic=True)

    _rows_alone_match(run, x, sizes=(1, 16, 17))
    ref = fp8_gemm.fp8_linear(x.float(), q, s, "torch", groups, act_fp8=act_fp8)
    assert rel_err(run(x), ref) < 2e-2


def test_fp8_gemm_prefill_rows_run_in_slices_of_the_same_configuration(monkeypatch):
    monkeypatch.setattr(fp8_gemm, "KERNEL_MAX_M", 8)  # slices of 8 rows: three for 20
    g = torch.Generator().manual_seed(2)
    q, s = low_precision.fp8_quantize_weight(block_weights(64, 256, g))
    q, s = q.to(DEVICE), s.float().to(DEVICE)
    x = torch.randn(20, 256, generator=g).to(DEVICE, torch.bfloat16)
    _rows_alone_match(lambda a: fp8_gemm.fp8_linear(a, q, s, "triton", deterministic=True), x, sizes=(1, 9))


# ---------------------------------------------------------------------------------------
# attention and indexer: a request alone, then beside others (longer and shorter)
# ---------------------------------------------------------------------------------------

def _requests(cfg, pools, lengths: list[tuple[int, int]], seed: int) -> list[tuple[SeqKV, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for cached, new in lengths:
        seq = SeqKV()
        pools.reserve(seq, cached + new)
        seq.num_tokens = cached
        items.append((seq, torch.randint(0, cfg.vocab_size, (new,), generator=g).tolist()))
    return items


def _target_rows(batch: ForwardBatch, seq: SeqKV) -> slice:
    seg = next(s for s in batch.segments if s.seq is seq)
    return slice(seg.offset, seg.offset + seg.length)


@COSTLY
@pytest.mark.parametrize("layer, ratio", [(1, 4), (2, 128)])
def test_sparse_attention_rows_do_not_depend_on_the_batch(layer, ratio, monkeypatch):
    cfg = tiny_config()
    pools = KVPools(cfg, "fp8_pack", max_tokens=1024, max_seqs=4, device=DEVICE)
    fill_random(pools, seed=20)
    items = _requests(cfg, pools, [(300, 3), (517, 1), (40, 6)], seed=21)  # the target first: 3 tokens
    target = items[0][0]
    g = torch.Generator().manual_seed(22)
    H, d = cfg.num_attention_heads, cfg.head_dim
    sink = torch.randn(H, generator=g).to(DEVICE)
    rope = Rope.for_layer(cfg, compressed=True)
    q_target = torch.randn(3, H, d, generator=g).to(DEVICE, torch.bfloat16)
    picks_target = torch.tensor([[5, 70, 3, -1, -1], [71, 0, 9, 40, -1], [1, 2, 74, 50, 60]], dtype=torch.int32)

    def run(batch_items, rows_cap=None):
        if rows_cap is not None:
            monkeypatch.setattr(sparse_attention, "DETERMINISTIC_ROWS", rows_cap)
        batch = ForwardBatch.build(batch_items, device=DEVICE)
        T = batch.input_ids.shape[0]
        rows = _target_rows(batch, target)
        q = torch.randn(T, H, d, generator=torch.Generator().manual_seed(T)).to(DEVICE, torch.bfloat16)
        q[rows] = q_target
        picks = None
        if ratio == 4:  # the batch's picks are wider (three blocks of 64, the target's one): -1 beyond the target's
            picks = torch.full((T, 5 if len(batch_items) == 1 else 140), -1, dtype=torch.int32)
            picks[rows, :5] = picks_target
            picks = picks.to(DEVICE)
        out = sparse_attention.attend(q, batch, pools, layer, ratio, picks, sink, cfg.sliding_window, rope,
                                      "triton", out_dtype=torch.bfloat16, deterministic=True)
        return out[rows]

    alone = run(items[:1])
    assert torch.equal(run(items), alone)
    assert torch.equal(run([items[2], items[0]], rows_cap=2), alone)  # row slices of 2 queries


def test_indexer_logits_and_picks_do_not_depend_on_the_batch():
    cfg = tiny_config()
    pools = KVPools(cfg, "fp8_pack", max_tokens=2048, max_seqs=3, device=DEVICE)
    fill_random(pools, seed=30)
    items = _requests(cfg, pools, [(200, 2), (1500, 1), (30, 4)], seed=31)
    target = items[0][0]
    g = torch.Generator().manual_seed(32)
    q_t = torch.randn(2, cfg.index_n_heads, cfg.index_head_dim, generator=g).to(DEVICE, torch.bfloat16)
    w_t = torch.randn(2, cfg.index_n_heads, generator=g).to(DEVICE)

    def run(batch_items):
        batch = ForwardBatch.build(batch_items, device=DEVICE)
        T = batch.input_ids.shape[0]
        rows = _target_rows(batch, target)
        q = torch.randn(T, cfg.index_n_heads, cfg.index_head_dim, generator=torch.Generator().manual_seed(T))
        q = q.to(DEVICE, torch.bfloat16)
        w = torch.rand(T, cfg.index_n_heads).to(DEVICE)
        q[rows], w[rows] = q_t, w_t
        n_max = batch.meta.max_end // 4
        scores = indexer.logits(q, w, batch, pools, 1, rows, n_max, deterministic=True)
        picks = indexer.indexer_topk(q, w, batch, pools, 1, cfg.index_topk, "triton", deterministic=True)[rows]
        return scores, picks

    scores_alone, picks_alone = run(items[:1])
    scores, picks = run(items)
    n = scores_alone.shape[1]
    assert torch.equal(scores[:, :n], scores_alone) and bool((scores[:, n:] == float("-inf")).all())
    k = picks_alone.shape[1]
    assert torch.equal(picks[:, :k], picks_alone) and bool((picks[:, k:] == -1).all())


# ---------------------------------------------------------------------------------------
# mHC entry, MoE gate and experts
# ---------------------------------------------------------------------------------------

@COSTLY
def test_mhc_entry_rows_do_not_depend_on_the_batch():
    x, fn, base, scale = mhc_inputs(20, DEVICE, D=256)
    norm = torch.rand(256, generator=torch.Generator().manual_seed(3)).to(DEVICE) + 0.5

    def run(rows: torch.Tensor) -> torch.Tensor:
        _, out, post, comb = mhc.sublayer_input(mhc.Residual(rows), fn, base, scale, norm, 1e-6, 4, 20, 1e-6, 1e-6,
                                                "triton", deterministic=True)
        head = mhc.head_input(mhc.Residual(rows), fn[:4], base[:4], scale[:1], norm, 1e-6, 1e-6, 1e-6, "triton",
                              deterministic=True)
        return torch.cat([out.float(), post, comb.flatten(1), head.float()], dim=1)

    _rows_alone_match(run, x, sizes=(1, 2, 3, 17))


@COSTLY
@pytest.mark.parametrize("layer", [1, 3])  # hash-routed, score-routed
def test_moe_rows_do_not_depend_on_the_batch(layer, monkeypatch):
    # wide enough for the one-token tiles' K split (gate/up 4 × 128 of D, down 2 × 128 of I)
    cfg = tiny_config(hidden_size=512, moe_intermediate_size=256)
    moe = MoE.random_packed(cfg, layer=layer, fmt="fp4", seed=4, impl="triton", device=DEVICE)
    moe.gate.deterministic = True
    g = torch.Generator().manual_seed(5)
    x = torch.randn(24, moe.cfg.hidden_size, generator=g).to(DEVICE, torch.bfloat16)
    ids_in = torch.randint(0, moe.cfg.vocab_size, (24,), generator=g).to(DEVICE)
    packed = torch.cat([x.float(), ids_in[:, None].float()], dim=1)  # bf16 values and token ids: exact in fp32
    _rows_alone_match(lambda a: _split(a, moe), packed, sizes=(1, 4, 5))
    monkeypatch.setattr(moe_fused, "DECODE_MAX_TOKENS", 8)  # a step of 24 in slices of 8
    full = _split(packed, moe)
    assert torch.equal(full[:5], _split(packed[:5], moe))


def _split(packed: torch.Tensor, moe: MoE) -> torch.Tensor:
    """The gate's (weights, ids) and the MoE's output of the rows and token ids packed side by side."""
    rows, ids = packed[:, :-1].to(torch.bfloat16).contiguous(), packed[:, -1].long()
    weights, experts = moe.gate(rows, ids)
    out = experts_forward(rows, weights, experts, moe.experts, moe.shared_experts, moe.cfg.swiglu_limit, "triton",
                          deterministic=True)
    return torch.cat([weights, experts.float(), out.float()], dim=1)


# ---------------------------------------------------------------------------------------
# the composed model
# ---------------------------------------------------------------------------------------

def _request_logits(model, pools, prompt: list[int], fed: list[int], others: list[list[int]], chunk: int):
    """The logits of `prompt`'s last token and of each token of `fed` decoded after it, the prompt
    prefilled in chunks of `chunk` beside `others` (each decoding a token a step once prefilled)."""
    seqs = [SeqKV() for _ in range(len(others) + 1)]
    prompts = [prompt] + others
    for s, p in zip(seqs, prompts):
        pools.reserve(s, len(p) + len(fed))
    out = []
    for start in range(0, max(map(len, prompts)), chunk):
        items = [(s, p[start:start + chunk]) for s, p in zip(seqs, prompts) if p[start:start + chunk]]
        batch = ForwardBatch.build(items, device=DEVICE)
        logits = model(batch, pools, all_logits=True)
        if start < len(prompt) <= start + chunk:
            out.append(logits[_target_rows(batch, seqs[0])][-1:])
        batch.commit()
    for token in fed:
        batch = ForwardBatch.build([(s, [token]) for s in seqs], device=DEVICE)
        out.append(model(batch, pools)[:1])
        batch.commit()
    for s in seqs:
        pools.release(s)
    return torch.cat(out).float()


@COSTLY
def test_model_logits_do_not_depend_on_the_batch(tiny_official_ckpt):
    """The device-format tiny model (W8A8, packed experts, fp8_pack pools) through the kernels: a
    request alone in one prefill step, then chunked beside two others, gives the same logits."""
    from model.checkpoint import load_checkpoint
    from model.kernels import set_deterministic
    from model.quantized import quantize_model

    cfg, model = load_checkpoint(tiny_official_ckpt, device=DEVICE)
    quantize_model(model, "triton", act_fp8=True)
    set_deterministic(model, True)
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 256, (37,), generator=g).tolist()
    others = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 9)]
    pools = KVPools(cfg, "fp8_pack", max_tokens=128, max_seqs=3, device=DEVICE)
    alone = _request_logits(model, pools, prompt, [5, 6], [], chunk=64)
    assert alone.isfinite().all()
    assert torch.equal(_request_logits(model, pools, prompt, [5, 6], others, chunk=16), alone)
