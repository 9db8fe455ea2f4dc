"""Indexer kernel against the torch reference: scores within bf16 tolerance and picks that are
a valid causal top-k (tie- and rounding-tolerant: every kernel pick scores, by the reference,
within tolerance of the reference's k-th best; -1 exactly where a query has fewer entries)."""

import pytest
import torch

from model.kernels.attention import indexer, rope as rope_ops
from model.kv_pool import KVPools
from model.rope import Rope
from model.tiny import tiny_config
from tests.model.kernel_cases import fill_random, random_batch, rel_err

# Triton-interpreter parity at many shapes: minutes on 2 cores, so CI runs it and the fast tier does not
pytestmark = pytest.mark.slow

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(0, 37), (300, 1), (517, 9), (3, 1), (1, 1)]


def reference_scores(q, w, batch, pools, layer, fp8_query=False):
    """Full [T, N] reference scores, -inf past each query's causal end."""
    n_max = max(s.end for s in batch.segments) // 4
    out = torch.full((q.shape[0], n_max), float("-inf"), device=q.device)
    qs = indexer.scoring_query(q, pools, fp8_query)
    for seg in batch.segments:
        n = seg.end // 4
        keys = pools.read("c4_indexer", layer, seg.seq.pages["c4_indexer"], torch.arange(n, device=q.device))
        s = (torch.einsum("shc,tc->sht", qs[seg.rows], keys).relu() * q.shape[2] ** -0.5)
        s = (s * w[seg.rows].float().unsqueeze(-1)).sum(1)
        vis = (batch.positions[seg.rows] + 1) // 4
        s = s.masked_fill(torch.arange(n, device=q.device) >= vis.unsqueeze(1), float("-inf"))
        out[seg.rows, :n] = s
    return out


# the production encoding at both k, the others at one (each other case adds 8-14 s of interpreter
# time on a 2-core CI machine; the GPU runs them all)
def indexer_inputs(fmt: str, seed: int):
    """The tiny model's pools in `fmt` filled at random, a batch of SHAPES over them, and random
    indexer queries q [T, n_I, c] bf16 and head weights w [T, n_I] (seeds seed, seed + 1, seed + 2)."""
    cfg = tiny_config()
    pools = KVPools(cfg, fmt, max_tokens=1024, max_seqs=len(SHAPES), device=DEVICE)
    fill_random(pools, seed=seed)
    batch = random_batch(cfg, pools, SHAPES, seed=seed + 1, device=DEVICE)
    g = torch.Generator().manual_seed(seed + 2)
    T = batch.input_ids.shape[0]
    q = torch.randn(T, cfg.index_n_heads, cfg.index_head_dim, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(T, cfg.index_n_heads, generator=g).to(DEVICE)
    return cfg, pools, batch, q, w


@pytest.mark.parametrize("fmt,topk,fp8_query", [("fp8_pack", 16, True), ("fp8_pack", 64, False), ("bf16", 16, False),
                                                pytest.param("fp8_pack", 16, False, marks=pytest.mark.exhaustive),
                                                pytest.param("fp8_pack", 64, True, marks=pytest.mark.exhaustive),
                                                pytest.param("fp32", 16, False, marks=pytest.mark.exhaustive),
                                                pytest.param("bf16", 64, False, marks=pytest.mark.exhaustive),
                                                pytest.param("fp32", 64, False, marks=pytest.mark.exhaustive)])
def test_indexer_matches_reference(fmt, topk, fp8_query):
    _, pools, batch, q, w = indexer_inputs(fmt, seed=30)
    T = batch.input_ids.shape[0]
    layer = 1
    full = reference_scores(q, w, batch, pools, layer, fp8_query)
    n_max = full.shape[1]
    got = indexer.logits(q, w, batch, pools, layer, slice(0, T), n_max, fp8_query=fp8_query)
    finite = full.isfinite()
    assert torch.equal(got.isfinite(), finite)
    assert rel_err(got[finite], full[finite]) < 1e-2

    ref = indexer.indexer_topk(q, w, batch, pools, layer, topk, impl="torch", fp8_query=fp8_query)
    out = indexer.indexer_topk(q, w, batch, pools, layer, topk, impl="triton", fp8_query=fp8_query)
    assert out.shape == ref.shape == (T, min(topk, n_max))
    assert torch.equal(out < 0, ref < 0)  # same count of real picks per query
    for t in range(T):
        real = out[t][out[t] >= 0].long()
        assert len(set(real.tolist())) == len(real)  # distinct
        if len(real):
            kth = full[t][ref[t][ref[t] >= 0].long()].min()
            scale = full[t][finite[t]].abs().max()
            assert bool((full[t][real] >= kth - 2e-2 * scale).all())


def test_logits_rotate_the_queries_as_the_rope_kernel_does():
    """Given the layer's `Rope`, the logits kernel ropes each query itself (`Indexer.forward` leaves
    q unrotated): the scores of rope_ops.rotate's queries, bit for bit; the torch path likewise."""
    cfg, pools, batch, q, w = indexer_inputs("fp8_pack", seed=33)
    T = batch.input_ids.shape[0]
    rope = Rope.for_layer(cfg, compressed=True)
    roped = rope_ops.rotate(q, batch.positions, rope, "triton")
    n_max = max(s.end for s in batch.segments) // 4
    got = indexer.logits(q, w, batch, pools, 1, slice(0, T), n_max, rope=rope)
    assert torch.equal(got, indexer.logits(roped, w, batch, pools, 1, slice(0, T), n_max))
    assert not torch.equal(got, indexer.logits(q, w, batch, pools, 1, slice(0, T), n_max))  # rotation matters
    assert torch.equal(indexer.indexer_topk(q, w, batch, pools, 1, 16, "torch", rope=rope),
                       indexer.indexer_topk(rope.apply(q, batch.positions), w, batch, pools, 1, 16, "torch"))


@pytest.mark.exhaustive  # ~24 s under the interpreter; the GPU parity run compiles it
def test_head_weights_scaled_in_the_logits_launch():
    """`w_scale` (the indexer's n_I^-1/2, which `Indexer.forward` no longer applies in an
    element-wise launch of its own) gives the bits of scaling w first, also at a scale that is
    not a power of two; and the picks of queries in chunks equal those of one chunk."""
    cfg, pools, batch, q, w = indexer_inputs("fp8_pack", seed=36)
    T = batch.input_ids.shape[0]
    n_max = max(s.end for s in batch.segments) // 4
    for scale in (cfg.index_n_heads ** -0.5, 0.3):
        assert torch.equal(indexer.logits(q, w, batch, pools, 1, slice(0, T), n_max, w_scale=scale),
                           indexer.logits(q, w * scale, batch, pools, 1, slice(0, T), n_max))
        for impl in ("torch", "triton"):
            assert torch.equal(indexer.indexer_topk(q, w, batch, pools, 1, 16, impl, w_scale=scale),
                               indexer.indexer_topk(q, w * scale, batch, pools, 1, 16, impl)), impl
    whole = indexer.indexer_topk(q, w, batch, pools, 1, 16, "triton")
    chunked = indexer.indexer_topk(q, w, batch, pools, 1, 16, "triton", max_logit_bytes=4 * n_max * 2)
    assert T > 2 and torch.equal(chunked, whole)


def topk_in_entry_order(scores: torch.Tensor, K: int) -> torch.Tensor:
    """torch.topk's K best entries of each row, ascending, -1 after them for -inf scores."""
    values, idx = scores.topk(K, dim=-1)
    n = scores.shape[1]
    ordered = torch.where(values == float("-inf"), n, idx).sort(dim=-1).values
    return torch.where(ordered == n, -1, ordered).int()


# K = 100 (not a power of two: the -1 fill past K) in the CI subset; 64 adds ~8 s there
@pytest.mark.parametrize("K", [pytest.param(64, marks=pytest.mark.exhaustive), 100])
def test_top_k_kernel_matches_torch_topk(K):
    """The select kernel against torch.topk: the same entries, in entry order, negative scores
    ranked right, -1 exactly where a row has fewer than K finite scores."""
    g = torch.Generator().manual_seed(91)
    R, n = 24, 600
    scores = torch.randn(R, n, generator=g)
    visible = torch.randint(0, n + 1, (R,), generator=g)
    visible[:3] = torch.tensor([0, K // 2, n])  # none, fewer than K, all
    scores = scores.masked_fill(torch.arange(n) >= visible.unsqueeze(1), float("-inf")).to(DEVICE)
    got = indexer.top_k(scores, K)
    ref = topk_in_entry_order(scores, K)
    assert got.dtype == torch.int32 and got.shape == (R, K)
    assert torch.equal(got, ref)
    for bits in (1, 4, 8):  # by comparisons 1 bit a pass, by histograms 4 or 8 (2 by default here): the same ids
        assert torch.equal(indexer.top_k(scores, K, digit_bits=bits), ref), bits
    assert (got[0] == -1).all() and (got[1, K // 2:] == -1).all() and (got[1, :K // 2] >= 0).all()


def test_top_k_kernel_ties_at_the_kth_score_take_the_lowest_entries():
    """Scores equal to the K-th largest: the lowest entries of them, and only as many as K needs;
    a row of one value throughout, and scores that differ in their last bit only."""
    K, n = 8, 40
    base = torch.full((n,), -0.5)
    base[[3, 30]] = 2.0  # two clear winners
    tied = [1, 5, 9, 12, 17, 21, 26, 33, 38]  # nine entries tie for the last six places
    base[tied] = 1.0
    flat = torch.full((n,), 0.25)
    ulp = torch.full((n,), 1.0).nextafter(torch.tensor(2.0))
    ulp[::2] = 1.0  # odd entries one bit above the even ones
    for bits in (1, 2, 4, 8):  # a tie and a last-bit difference at every digit width
        got = indexer.top_k(torch.stack([base, flat, ulp]).to(DEVICE), K, digit_bits=bits).cpu()
        assert got[0].tolist() == sorted([3, 30] + tied[:6])
        assert got[1].tolist() == list(range(K))
        assert got[2].tolist() == list(range(1, 2 * K, 2))
    with pytest.raises(ValueError, match="digit_bits"):
        indexer.top_k(base[None].to(DEVICE), K, digit_bits=3)


def test_top_k_kernel_decides_the_kth_score_early_where_its_bucket_is_taken_whole():
    """The passes stop once every entry of the K-th's bucket is taken (indexer-like scores after
    5-6 of 8 four-bit passes): the K-th is then the bucket's smallest. Rows of 5000 entries (the
    histogram regime) over several binades, with the K-th score held by two entries that are both
    taken, by one, and a row where a tie crosses K (no early stop: 8 passes)."""
    g = torch.Generator().manual_seed(92)
    R, n, K = 4, 5000, 512
    scores = torch.randn(R, n, generator=g).exp() * 10.0 ** torch.randint(-3, 3, (R, n), generator=g)
    top = scores[1].topk(K).values
    scores[1, scores[1] == top[-2]] = top[-1]  # the K-1-th and K-th equal: both taken
    scores[2, :] = scores[2].clamp(max=scores[2].topk(K + 5).values[-1])  # K + 5 entries tie for K places
    scores = scores.to(DEVICE)
    # torch.topk leaves the order of ties open; a stable sort takes the lowest entries of a tie
    ref = torch.sort(-scores.cpu(), dim=-1, stable=True).indices[:, :K].sort(dim=-1).values.int().to(DEVICE)
    assert torch.equal(ref[2], torch.arange(n, device=DEVICE)[scores[2] == scores[2].max()][:K].int())
    for bits in (1, 2, 4, 8):  # the comparison passes stop early alike
        assert torch.equal(indexer.top_k(scores, K, digit_bits=bits), ref), bits


@pytest.mark.parametrize("fp8_query", [False, True])
def test_fp8_key_logits_hold_queries_outside_the_query_format_range(fp8_query):
    """FP8 keys multiply an fp16 query scaled by a power of two, or (`fp8_query`) an FP8 query with
    a UE8M0 scale per head: queries far above the format's largest value or below its smallest
    normal, and one whose heads span 2^-20..2^20, score as the reference does (an unscaled query
    would overflow to inf, saturate, or lose the small heads' bits), and a query's scores scale
    exactly with it. The FP8 query's products are exact, but Hopper's e4m3 MMA keeps about 14
    bits of its running sum (DeepSeek-V3 report, §3.3.2; 7.5e-5 measured on an H200), hence 2e-4
    there against fp32's order-of-summation bound."""
    _, pools, batch, q, w = indexer_inputs("fp8_pack", seed=39)
    T = batch.input_ids.shape[0]
    n_max = max(s.end for s in batch.segments) // 4
    spread = torch.exp2(torch.linspace(-20, 20, q.shape[1], device=q.device))[None, :, None]
    for qq in (q * 2.0 ** 20, q * 2.0 ** -30, (q.float() * spread).bfloat16()):
        full = reference_scores(qq, w, batch, pools, 1, fp8_query)
        got = indexer.logits(qq, w, batch, pools, 1, slice(0, T), n_max, fp8_query=fp8_query)
        finite = full.isfinite()
        assert torch.equal(got.isfinite(), finite)
        assert rel_err(got[finite], full[finite]) < (2e-4 if fp8_query else 1e-5)
    base = indexer.logits(q, w, batch, pools, 1, slice(0, T), n_max, fp8_query=fp8_query)
    assert torch.equal(indexer.logits(q * 2.0 ** 12, w, batch, pools, 1, slice(0, T), n_max, fp8_query=fp8_query),
                       base * 2.0 ** 12)


def test_fp8_query_is_the_codes_of_act_quant():
    """The FP8 query is each head's e4m3 codes and UE8M0 scale as the W8A8 activations get them
    (a block of c), and only against FP8 keys: other pools, or the flag off, keep q exact."""
    _, pools, batch, q, w = indexer_inputs("fp8_pack", seed=40)
    scale = torch.exp2(torch.ceil(torch.log2(q.float().abs().amax(-1, keepdim=True) / 448)))  # per head
    want = (q.float() / scale).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(indexer.scoring_query(q, pools, True), want)
    assert not torch.equal(want, q.float())
    assert torch.equal(indexer.scoring_query(q, pools, False), q.float())
    bf16_pools = KVPools(tiny_config(), "bf16", max_tokens=64, max_seqs=1, device=DEVICE)
    assert torch.equal(indexer.scoring_query(q, bf16_pools, True), q.float())
