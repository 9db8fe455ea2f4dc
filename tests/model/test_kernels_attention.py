"""Sparse attention kernel against the torch reference on random pools (interpreter on CPU).

Window-only, HCA (every complete window) and CSA (random causal picks with -1 padding) layers,
prefill chunks at arbitrary starts mixed with decodes, every pool encoding, with and without the
KV split that decode uses to fill the GPU (split with every encoding where the kernels compile)."""

import pytest
import torch

from model.kernels.attention import sparse_attention
from model.kv_pool import KVPools
from model.rope import Rope
from model.tiny import tiny_config
from tests.model.kernel_cases import fill_random, random_batch, rel_err

# Triton-interpreter parity at many shapes: minutes on 2 cores, so CI runs it and the fast tier does not
pytestmark = pytest.mark.slow

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(0, 20), (300, 1), (517, 9), (129, 1)]


def random_picks(batch, k: int, seed: int) -> torch.Tensor:
    """[T, k] distinct causal entry ids per query, -1 where a query has fewer than k entries."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p in batch.positions.tolist():
        n = (p + 1) // 4
        perm = torch.randperm(n, generator=g)[:k].tolist()
        rows.append(perm + [-1] * (k - len(perm)))
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


# The KV split and the pool encoding are independent of the layer kind (each program decodes its
# own blocks; the kinds differ in which entries they gather), so the CPU suite runs every kind in
# the production encoding unsplit and the CSA layer (the most entries: window and picks) in the
# other encodings and split; each other case adds 6-19 s of interpreter time on a 2-core CI
# machine, and the GPU runs them all
LAYERS = [(0, 0), (2, 128), (1, 4)]
ENCODINGS_AND_SPLITS = [("fp8_pack", 1), ("bf16", 1), ("fp32", 1), ("fp8_pack", 3), ("bf16", 3), ("fp32", 3)]


def _in_ci(fmt: str, splits: int, ratio: int) -> bool:
    return (fmt, splits) == ("fp8_pack", 1) or (ratio == 4 and (splits == 1 or fmt == "fp8_pack"))


ATTENTION_CASES = [pytest.param(fmt, splits, layer, ratio, marks=() if _in_ci(fmt, splits, ratio) else pytest.mark.exhaustive)
                   for fmt, splits in ENCODINGS_AND_SPLITS for layer, ratio in LAYERS]


@pytest.mark.parametrize("fmt,splits,layer,ratio", ATTENTION_CASES)
def test_sparse_attention_matches_reference(fmt, layer, ratio, splits):
    cfg = tiny_config()
    pools = KVPools(cfg, fmt, max_tokens=1024, max_seqs=4, device=DEVICE)
    fill_random(pools, seed=10 + layer)
    batch = random_batch(cfg, pools, SHAPES, seed=11, device=DEVICE)
    g = torch.Generator().manual_seed(12)
    T = batch.input_ids.shape[0]
    q = torch.randn(T, cfg.num_attention_heads, cfg.head_dim, generator=g).to(DEVICE, torch.bfloat16)
    sink = torch.randn(cfg.num_attention_heads, generator=g).to(DEVICE)
    picks = random_picks(batch, 40, seed=13) if ratio == 4 else None
    rope = Rope.for_layer(cfg, compressed=ratio > 0)
    args = (q, batch, pools, layer, ratio, picks, sink, cfg.sliding_window, rope)
    ref = sparse_attention.attend(*args, impl="torch")
    out = sparse_attention.attend(*args, impl="triton", splits=splits)
    assert out.shape == ref.shape and bool(out.isfinite().all())
    # bf16 K (exact for bf16/fp8 pools, rounded for fp32) and bf16 probabilities in P·V
    assert rel_err(out, ref) < 1e-2
    # the model's bf16 output, stored by the kernel (one split) or after the combine (several)
    low = sparse_attention.attend(*args, impl="triton", splits=splits, out_dtype=torch.bfloat16)
    assert low.dtype == torch.bfloat16 and torch.equal(low, out.to(torch.bfloat16))


def test_sink_dominates_when_scores_are_low():
    """A huge sink takes all the mass: the output vanishes (the sink's value is zero)."""
    cfg = tiny_config()
    pools = KVPools(cfg, "bf16", max_tokens=512, max_seqs=2, device=DEVICE)
    fill_random(pools, seed=1)
    batch = random_batch(cfg, pools, [(100, 3)], seed=2, device=DEVICE)
    q = torch.randn(3, cfg.num_attention_heads, cfg.head_dim).to(DEVICE, torch.bfloat16)
    sink = torch.full((cfg.num_attention_heads,), 60.0, device=DEVICE)
    out = sparse_attention.attend(q, batch, pools, 0, 0, None, sink, cfg.sliding_window,
                                  Rope.for_layer(cfg, False), impl="triton")
    assert out.abs().max() < 1e-6


def test_wgmma_kernel_is_refused_where_it_does_not_apply():
    """`wgmma=True` outside what the Gluon kernel reads (sm_90, fp8_pack, 448 + 64 columns) is an
    error naming the conditions, never a launch over entries it would misread."""
    cfg = tiny_config()
    pools = KVPools(cfg, "bf16", max_tokens=512, max_seqs=2, device=DEVICE)
    batch = random_batch(cfg, pools, [(100, 1)], seed=2, device=DEVICE)
    q = torch.randn(1, cfg.num_attention_heads, cfg.head_dim).to(DEVICE, torch.bfloat16)
    sink = torch.zeros(cfg.num_attention_heads, device=DEVICE)
    with pytest.raises(ValueError, match="fp8_pack pools of 448 \\+ 64-column entries on sm_90; got bf16 pools"):
        sparse_attention.attend(q, batch, pools, 0, 0, None, sink, cfg.sliding_window, Rope.for_layer(cfg, False),
                                impl="triton", wgmma=True)


# V4's width (16 splits, 64 heads × 512) takes ~12 s in the interpreter: exhaustive (the GPU runs compile it)
@pytest.mark.parametrize("splits,heads,d", [(2, 4, 128), (5, 6, 96),
                                            pytest.param(16, 64, 512, marks=pytest.mark.exhaustive)])
def test_split_combine_matches_reference(splits, heads, d):
    """The merge of KV-split partials: random accumulators and (m, l) per split, one split per row
    left empty as a split past its last block leaves it (m = -1e30, l = 0, acc = 0), heads not a
    multiple of the kernel's head block, head dims below the power of two the kernel pads to."""
    cfg = tiny_config(head_dim=d, qk_rope_head_dim=64)
    rope = Rope.for_layer(cfg, compressed=True)
    g = torch.Generator().manual_seed(splits)
    T = 3
    partial = torch.randn(splits, T, heads, d, generator=g)
    m = 4 * torch.randn(splits, T, heads, generator=g)
    l = 0.5 + torch.rand(splits, T, heads, generator=g)
    empty = torch.randint(1, splits, (T, heads), generator=g)  # never split 0: it holds the sink
    hit = torch.nn.functional.one_hot(empty, splits).permute(2, 0, 1).bool()
    m, l = m.masked_fill(hit, -1e30), l.masked_fill(hit, 0.0)
    partial = partial.masked_fill(hit.unsqueeze(-1), 0.0)
    ml = torch.stack([m, l], dim=-1)
    positions = torch.tensor([0, 517, 4000])
    partial, ml, positions = partial.to(DEVICE), ml.to(DEVICE), positions.to(DEVICE)
    ref = sparse_attention.combine_reference(partial, ml, positions, rope)
    out = torch.empty(T, heads, d, device=DEVICE)
    sparse_attention.combine(partial, ml, positions, rope, out)
    assert rel_err(out, ref) < 1e-5
    low = torch.empty(T, heads, d, device=DEVICE, dtype=torch.bfloat16)
    sparse_attention.combine(partial, ml, positions, rope, low)
    assert torch.equal(low, out.to(torch.bfloat16))
