"""Parity of the MoE Triton paths (fused decode, grouped) with the torch reference, in the interpreter.

Every scratch and output tensor the kernels get from `torch.empty` is poisoned (NaN, -1) so an
unwritten element or an unzeroed arrival counter shows. Two tolerances, relative Frobenius norm:

* against `emulate` — the reference with the kernels' two roundings (x and h to bf16) and fp32
  everywhere else: 1e-4. Only fp32 summation order differs, which can flip an h element's bf16
  rounding by one ulp (2^-9 of that element), far below 1e-4 of the whole output;
* against `moe_grouped.reference` (fp32 throughout): 1e-2. bf16 keeps 8 significant bits, so
  rounding x and h costs ~2^-9/√3 ≈ 1e-3 rms each; measured ~3e-3 on these shapes.

Shapes are the tiny model's (D 64, I 32, 8 experts, top-2) plus a skewed routing that gives one
expert three token tiles and leaves others empty; real shapes run in tests/gpu/test_moe_kernels_cuda.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from model.kernels.gemm import fp8_gemm
from model.kernels.moe import moe_combine, moe_fused, moe_grouped, moe_prefill, moe_shared
from model.kernels.moe.packed_experts import PackedExperts
from model.moe import MoE
from model.tiny import tiny_config

# Triton-interpreter parity at many shapes: minutes on 2 cores, so CI runs it and the fast tier does not
pytestmark = pytest.mark.slow

EMULATED_TOL = 1e-4
REFERENCE_TOL = 1e-2
# bf16 outputs (the GPU model's): the emulation is rounded to bf16 too; fp32 summation order then
# flips the last bit of outputs near a rounding boundary (2^-8 each), and the grouped path also
# rounds each slot's row to bf16 before the fp32 sum over the k + 1 slots (measured on H100:
# fused ~1.7e-3, grouped ~2.7e-3)
EMULATED_TOL_BF16 = 4e-3
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU-only machines


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.fixture
def poisoned(monkeypatch):
    # torch's device context (`with torch.device(...)`) caches its set of factory functions on first
    # use: fill that cache with the real torch.empty before patching it, or every later
    # `with torch.device("cuda")` in the session would stop placing nn.Module parameters
    with torch.device("cpu"):
        torch.zeros(1)
    real = torch.empty

    def empty(*size, **kw):
        t = real(*size, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty", empty)


def emulate(x, weights, ids, experts, shared, limit):
    """The kernels' arithmetic in torch: x and h rounded to bf16, dequantised weights, fp32 dots."""
    xb = x.bfloat16().float()

    def expert(pk, e, rows):
        w1, w3, w2 = pk.dequantize(e)
        g, u = rows @ w1.T, rows @ w3.T
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return (F.silu(g) * u).bfloat16().float() @ w2.T

    y = moe_grouped.expert_outputs(xb, ids, lambda e, rows: expert(experts, e, rows))
    return moe_grouped.combine(y, weights, expert(shared, 0, xb) if shared is not None else None)


def routed(moe: MoE, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, moe.cfg.hidden_size, generator=g).to(DEVICE)
    weights, ids = moe.gate(x, torch.randint(0, moe.cfg.vocab_size, (T,), generator=g).to(DEVICE))
    return x, weights, ids


def skewed(moe: MoE, T: int, seed: int):
    """Slot 0 of every token → expert 1 (T rows: several tiles), slot 1 → experts 2..4; 0, 5..7 idle."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, moe.cfg.hidden_size, generator=g)
    ids = torch.stack([torch.ones(T, dtype=torch.long), 2 + torch.randint(0, 3, (T,), generator=g)], dim=1)
    return x.to(DEVICE), (torch.rand(T, 2, generator=g) + 0.1).to(DEVICE), ids.to(DEVICE)


def check(out, x, weights, ids, moe):
    args = (x, weights, ids, moe.experts, moe.shared_experts, moe.cfg.swiglu_limit)
    assert torch.isfinite(out).all(), "unwritten (poisoned) output elements"
    tol = EMULATED_TOL_BF16 if out.dtype == torch.bfloat16 else EMULATED_TOL
    assert rel(out, emulate(*args).to(out.dtype)) < tol
    assert rel(out, moe_grouped.reference(*args)) < REFERENCE_TOL


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("path", ["fused", "grouped", "grouped_decode_tiles"])
def test_paths_match_reference(poisoned, fmt, path):
    moe = MoE.random_packed(tiny_config(), layer=3, fmt=fmt, seed=hash((fmt, path)) % 1000, device=DEVICE)
    x, weights, ids = routed(moe, T=5, seed=7)
    run = moe_fused.fused_moe if path == "fused" else moe_grouped.grouped_moe
    extra = {"fused": (), "grouped": ("triton",), "grouped_decode_tiles": ("triton", *moe_fused.decode_tiles(5))}[path]
    out = run(x, weights, ids, moe.experts, moe.shared_experts, moe.cfg.swiglu_limit, *extra)
    check(out, x, weights, ids, moe)


# the grouped path's case adds ~8 s on a 2-core CI machine (its tile kernels are the fused path's)
@pytest.mark.parametrize("path", ["fused", pytest.param("grouped", marks=pytest.mark.exhaustive)])
def test_skewed_routing_multi_tile_experts_and_idle_experts(poisoned, path):
    moe = MoE.random_packed(tiny_config(), layer=3, fmt="fp4", seed=31, device=DEVICE)
    x, weights, ids = skewed(moe, T=40, seed=8)  # expert 1: 40 rows = 3 tiles of 16
    tiles = moe_grouped.Tiles(BT=16, BN=16, BK=32)
    if path == "fused":
        out = moe_fused.fused_moe(x, weights, ids, moe.experts, moe.shared_experts, 10.0, tiles, tiles)
    else:
        out = moe_grouped.grouped_moe(x, weights, ids, moe.experts, moe.shared_experts, 10.0, "triton", tiles, tiles)
    check(out, x, weights, ids, moe)


def test_single_token(poisoned):
    moe = MoE.random_packed(tiny_config(), layer=3, fmt="fp4", seed=41, device=DEVICE)
    x, weights, ids = routed(moe, T=1, seed=9)
    out = moe_fused.fused_moe(x, weights, ids, moe.experts, moe.shared_experts, 10.0)
    check(out, x, weights, ids, moe)


def test_no_shared_expert_and_no_tokens():
    moe = MoE.random_packed(tiny_config(n_shared_experts=0), layer=3, fmt="fp4", seed=51, device=DEVICE)
    x, weights, ids = routed(moe, T=3, seed=10)
    out = moe_fused.fused_moe(x, weights, ids, moe.experts, None, 10.0)
    check(out, x, weights, ids, moe)
    empty = moe_fused.fused_moe(x[:0], weights[:0], ids[:0], moe.experts, None, 10.0)
    assert empty.shape == (0, moe.cfg.hidden_size)


def test_grouped_path_counting_sort_gives_the_torch_sorts_bits(poisoned, monkeypatch):
    """Up to `COUNT_SORT_MAX` assignments the grouped path sorts with the counting-sort launch (a
    batch-1 hash layer's five torch sort launches were ~24 µs of its chain); past it, with torch's
    stable sort. Rows are computed independently of their order within an expert: same bits."""
    moe = MoE.random_packed(tiny_config(), layer=0, fmt="fp4", seed=19, device=DEVICE)
    x, weights, ids = routed(moe, T=5, seed=21)
    gateup, down = moe_fused.decode_tiles(5)
    args = (x, weights, ids, moe.experts, moe.shared_experts, moe.cfg.swiglu_limit)
    D, I = moe.cfg.hidden_size, moe.cfg.moe_intermediate_size
    tiles = (moe_grouped.fit(gateup, I, D), moe_grouped.fit(down, D, I))

    def sorts() -> list[str]:
        launches, _ = moe_grouped.plan_kernels(*args, *tiles, fuse_combine=False)
        return [launch.kernel.__name__ for launch in launches]

    assert sorts()[0] == "_count_sort_kernel"
    counted = moe_grouped.grouped_moe(*args, "triton", gateup, down)
    check(counted, x, weights, ids, moe)
    monkeypatch.setattr(moe_grouped, "COUNT_SORT_MAX", 5 * 2)  # below A = 5·(2 + 1): the torch sort
    assert "_count_sort_kernel" not in sorts()
    assert torch.equal(moe_grouped.grouped_moe(*args, "triton", gateup, down), counted)


def test_sort_by_expert_is_stable_and_counts():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2]])
    perm, counts = moe_grouped.sort_by_expert(ids, 4, with_shared=True)
    assert perm.tolist() == [3, 1, 2, 5, 0, 4, 6, 7, 8]  # expert 0, 1, 1, 2, 3, 3, shared ×3
    assert counts.tolist() == [1, 2, 1, 2, 3]
    assert moe_grouped.max_tiles(9, 5, 16) >= 5


def test_model_picks_fused_only_where_seed_000_allows(monkeypatch):
    """Fused: score-routed layers (the MTP block's too) up to fused_max_tokens; grouped: hash layers, larger T,
    on the decode tiles up to DECODE_MAX_TOKENS tokens and on its own (prefill) tiles past them."""
    calls = []
    monkeypatch.setattr(moe_fused, "fused_moe", lambda *a, **k: calls.append("fused") or moe_grouped.reference(*a))
    real = moe_grouped.grouped_moe
    monkeypatch.setattr(moe_grouped, "grouped_moe", lambda *a, **k: calls.append(("grouped", a[7:]))
                        or real(*a[:6], "torch"))
    cfg = tiny_config()
    big = moe_fused.DECODE_MAX_TOKENS + 1
    for layer, T, want in ((3, 4, "fused"), (0, 4, ("grouped", moe_fused.decode_tiles(4))),
                           (cfg.num_hidden_layers, 4, "fused"),
                           (3, 9, ("grouped", moe_fused.decode_tiles(9))), (0, big, ("grouped", ()))):
        moe = MoE.random_packed(cfg, layer=layer, impl="triton", seed=layer, device=DEVICE)
        moe.fused_max_tokens = 8
        x, tok = torch.randn(T, cfg.hidden_size, device=DEVICE), torch.randint(0, cfg.vocab_size, (T,), device=DEVICE)
        calls.clear()
        moe(x, tok)
        assert calls == [want], (layer, T)
    assert moe_fused.decode_tiles(4) != moe_fused.decode_tiles(9)  # the small-step table is its own


@pytest.mark.parametrize("with_add", [False, True])
def test_sum_slots_matches_reference(poisoned, with_add):
    """Σ over slots (+ the fp32 shared output) in fp32, rounded once; a partial D block (1100)."""
    g = torch.Generator().manual_seed(81)
    y = torch.randn(9, 7, 1100, generator=g).to(DEVICE, torch.bfloat16)
    add = torch.randn(9, 1100, generator=g).to(DEVICE) if with_add else None
    for dtype in (torch.float32, torch.bfloat16):
        got = moe_combine.sum_slots(y, add, dtype)
        ref = moe_combine.reference(y, add, dtype)
        assert got.dtype == dtype and got.shape == (9, 1100)
        assert torch.isfinite(got).all()
        # fp32 sums of 7-8 terms in another order: last-bit differences at most
        assert rel(got, ref) < (1e-6 if dtype == torch.float32 else 4e-3)
    with pytest.raises(ValueError, match="add has shape"):
        moe_combine.sum_slots(y, torch.zeros(9, 1000, device=DEVICE))


@pytest.mark.parametrize("limit", [0.0, 3.0])
def test_swiglu_bf16_matches_torch(poisoned, limit):
    """The shared expert's activation: values past ±limit (clamped) and a partial block (I = 1100)."""
    g = torch.Generator().manual_seed(83)
    gu = (4 * torch.randn(5, 2200, generator=g)).to(DEVICE)
    gate, up = gu.chunk(2, dim=-1)
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    ref = (F.silu(gate) * up).bfloat16()
    got = moe_shared.swiglu_bf16(gu, limit)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 1100)
    # an ulp of the GPU's exp may flip a bf16 rounding: at most one bf16 ulp apart, and rarely
    diff = (got.float() - ref.float()).abs()
    assert (diff <= ref.float().abs() * 2 ** -7 + 1e-30).all() and (diff > 0).float().mean() < 0.01


def test_preorder_layout():
    """Row t → [even K | odd K], each half in mma_order (16i + 4q + 2h + r → 16i + 8h + 2q + r)."""
    x = torch.randn(3, 64)
    got = moe_grouped.preorder(x)
    for parity in (0, 1):
        half = x[:, parity::2]
        for src in range(32):
            i, q, h, r = src // 16, (src % 16) // 4, (src // 2) % 2, src % 2
            assert torch.equal(got[:, parity * 32 + 16 * i + 8 * h + 2 * q + r], half[:, src])


@pytest.mark.parametrize("T, K", [(1, 4096), (21, 1056)])
def test_count_sort_launch_copies_x_in_preorder(T, K):
    """The counting-sort launch's other programs copy x into `preorder`'s layout tile by tile: the
    copy equals `preorder(x)` bit for bit, over a partial row tile and a partial column tile
    (1056 = 2 × 512 + 32), and leaves nothing of the output unwritten."""
    import triton

    from model.kernels.moe.moe_tile_kernels import _count_sort_kernel

    g = torch.Generator().manual_seed(T + K)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16).to(DEVICE)
    xr = torch.full_like(x, float("nan"))
    ids = torch.randint(0, 8, (T, 2), generator=g).to(DEVICE)
    perm, counts, cursor, cnt13 = (torch.empty(n, dtype=torch.int32, device=DEVICE) for n in (2 * T, 16, 16, 1))
    bt, bc = moe_grouped.PREORDER_TILE
    tiles = triton.cdiv(T, bt) * triton.cdiv(K, bc)
    _count_sort_kernel[(1 + tiles,)](ids, perm, counts, cursor, 2 * T, 2 * T, cnt13, 1, x, xr, T, K,
                                     A_PAD=triton.next_power_of_2(2 * T), E_PAD=16, E=8, ZERO13=False, BT=bt, BC=bc)
    assert torch.equal(xr.cpu(), moe_grouped.preorder(x.cpu()))
    assert torch.equal(counts[:8].cpu(), torch.bincount(ids.cpu().flatten(), minlength=8).to(torch.int32))


@pytest.mark.parametrize("skew", [False, True])
def test_prefill_path_matches_reference(poisoned, skew):
    moe = MoE.random_packed(tiny_config(), layer=3, fmt="fp4", seed=61 + skew, device=DEVICE)
    x, weights, ids = (skewed if skew else routed)(moe, T=40, seed=11)
    gateup = moe_grouped.Tiles(BT=16, BN=16, BK=64, swap_ab=True)  # expert 1 (skewed): 3 token tiles
    down = moe_grouped.Tiles(BT=16, BN=64, BK=32, swap_ab=True)  # (BK 32 needs BN 64 on GPUs: `plan_kernels`)
    out = moe_prefill.prefill_moe(x, weights, ids, moe.experts, moe.shared_experts, 10.0, gateup, down)
    check(out, x, weights, ids, moe)
    plain = moe_prefill.prefill_moe(x, weights, ids, moe.experts, moe.shared_experts, 10.0)  # default tiles, fitted
    check(plain, x, weights, ids, moe)


# the grouped path runs the fused path's tile kernels; its case adds ~13 s on a 2-core CI machine
@pytest.mark.parametrize("path", ["fused", pytest.param("grouped", marks=pytest.mark.exhaustive), "prefill"])
def test_experts_over_several_k_blocks(poisoned, path):
    """Packed FP4 experts are stored K block by K block (`PackedExperts`); the tiny model's rows fit
    in one block, so here w13 has 2 blocks of 64 code bytes a row and w2 3 of 16. The grouped
    path's BK = 64 reads half a block per step, the others a whole one."""
    moe = MoE.random_packed(tiny_config(hidden_size=256, moe_intermediate_size=96), layer=3, fmt="fp4", seed=91,
                            device=DEVICE)
    assert (moe.experts.w13.shape[1], moe.experts.kb13, moe.experts.w2.shape[1], moe.experts.kb2) == (2, 64, 3, 16)
    x, weights, ids = skewed(moe, T=20, seed=14)
    args = (x, weights, ids, moe.experts, moe.shared_experts, moe.cfg.swiglu_limit)
    out = {"fused": lambda: moe_fused.fused_moe(*args), "grouped": lambda: moe_grouped.grouped_moe(*args, "triton"),
           "prefill": lambda: moe_prefill.prefill_moe(*args)}[path]()
    check(out, x, weights, ids, moe)
    too_long = moe_grouped.Tiles(BT=16, BN=32, BK=256, swap_ab=True)  # 128 bytes a row: past a block
    with pytest.raises(ValueError, match="more than the 64 of one K block"):
        moe_grouped.plan_kernels(*args, too_long, moe_grouped.Tiles(BT=16, BN=32, BK=32, swap_ab=True),
                                 fuse_combine=True)


def test_preordered_launch_needs_fp4_and_swap_tiles():
    swap = moe_grouped.Tiles(BT=16, BN=32, BK=64, swap_ab=True)
    for fmt, tiles in (("fp8", swap), ("fp4", moe_grouped.Tiles(BT=16, BN=32, BK=64))):
        moe = MoE.random_packed(tiny_config(), layer=3, fmt=fmt, seed=71, device=DEVICE)
        x, weights, ids = routed(moe, T=4, seed=12)
        with pytest.raises(ValueError, match="preordered"):
            moe_grouped.plan_kernels(x, weights, ids, moe.experts, moe.shared_experts, 10.0, tiles, tiles,
                                     fuse_combine=False, preordered=True)


@pytest.mark.parametrize("preordered", [False, True])
def test_fused_with_shared_expert_in_either_activation_order(poisoned, preordered):
    """The fused path reads x in `preorder`'s layout for the routed experts and in natural order
    for the shared expert (h likewise, per row): both orders give the reference's result."""
    moe = MoE.random_packed(tiny_config(hidden_size=256, moe_intermediate_size=128), layer=3, fmt="fp4", seed=72,
                            device=DEVICE)
    x, weights, ids = skewed(moe, T=20, seed=16)
    gateup, down = moe_fused.decode_tiles(20)
    gateup, down = moe_grouped.fit(gateup, 128, 256), moe_grouped.fit(down, 256, 128)
    out = moe_grouped.run_kernels(x, weights, ids, moe.experts, moe.shared_experts, 10.0, gateup, down,
                                  fuse_combine=True, preordered=preordered)
    check(out, x, weights, ids, moe)


def test_sort_launch_writes_the_preorder_copy():
    """The fused path's counting-sort launch also writes x in `preorder`'s layout, one [16, 512]
    tile per program after the first: the bits of `preorder(x)`, partial row tiles included."""
    moe = MoE.random_packed(tiny_config(hidden_size=1536, moe_intermediate_size=128), layer=3, fmt="fp4", seed=73,
                            device=DEVICE)
    x, weights, ids = skewed(moe, T=20, seed=17)
    gateup, down = moe_fused.decode_tiles(20)
    launches, _ = moe_grouped.plan_kernels(x, weights, ids, moe.experts, moe.shared_experts, 10.0,
                                           moe_grouped.fit(gateup, 128, 1536), moe_grouped.fit(down, 1536, 128),
                                           fuse_combine=True, preordered=True)
    sort = launches[0]
    assert sort.kernel.__name__ == "_count_sort_kernel" and sort.grid == (1 + 2 * 3,)
    sort()
    assert torch.equal(sort.args[9], moe_grouped.preorder(x))


@pytest.mark.parametrize("T, fmt", [
    # each pair adds 20-40 s of interpreter time on a 2-core CI machine; the GPU runs all four
    pytest.param(1, "fp4", marks=pytest.mark.exhaustive),
    pytest.param(4, "fp8", marks=pytest.mark.exhaustive),
    pytest.param(4, "fp4", marks=pytest.mark.exhaustive), pytest.param(1, "fp8", marks=pytest.mark.exhaustive),
])
def test_split_k_small_steps(poisoned, fmt, T):
    """Steps of a few tokens split the K loops (`Tiles.split_k`): gate/up over 4 programs, down
    over 2; the last program of a tile sums the partials in split order. Same result as unsplit
    up to fp32 summation order, and the arrival counters the sort zeroes are poisoned first."""
    moe = MoE.random_packed(tiny_config(hidden_size=512, moe_intermediate_size=256), layer=3, fmt=fmt, seed=93 + T,
                            device=DEVICE)
    x, weights, ids = routed(moe, T=T, seed=15)
    args = (x, weights, ids, moe.experts, moe.shared_experts, moe.cfg.swiglu_limit)
    gateup = moe_grouped.Tiles(BT=16, BN=64, BK=128, swap_ab=True, split_k=4)
    down = moe_grouped.Tiles(BT=16, BN=64, BK=128, swap_ab=True, split_k=2)
    assert (moe_grouped.fit(gateup, 256, 512).split_k, moe_grouped.fit(down, 512, 256).split_k) == (4, 2)
    out = moe_fused.fused_moe(*args, gateup, down)
    check(out, x, weights, ids, moe)
    whole = moe_fused.fused_moe(*args, dataclasses.replace(gateup, split_k=1), dataclasses.replace(down, split_k=1))
    assert rel(out, whole) < 1e-5
    again = moe_fused.fused_moe(*args, gateup, down)
    assert torch.equal(out, again)  # the split order, not the arrival order, sets the sums


def test_k_ranges_walked_in_one_program_give_the_split_bits(poisoned):
    """`Tiles.k_ranges` walks the K ranges of `split_k` in one program, each summed from zero and
    added in order: the same bits as the split over programs (gate/up 4 ranges, down 2, the shared
    expert among the assignments), at another weight-row tile too. The deterministic mode's steps
    above `SMALL_T` tokens rely on it (`moe_fused.decode_tiles`)."""
    moe = MoE.random_packed(tiny_config(hidden_size=512, moe_intermediate_size=256), layer=3, fmt="fp4", seed=96,
                            device=DEVICE)
    x, weights, ids = routed(moe, T=1, seed=18)
    args = (x, weights, ids, moe.experts, moe.shared_experts, moe.cfg.swiglu_limit)
    gateup = moe_grouped.Tiles(BT=16, BN=64, BK=128, swap_ab=True, split_k=4)
    down = moe_grouped.Tiles(BT=16, BN=64, BK=128, swap_ab=True, split_k=2)
    split = moe_fused.fused_moe(*args, gateup, down, shared_dense=False)
    walked = moe_fused.fused_moe(*args, dataclasses.replace(gateup, split_k=1, k_ranges=4),
                                 dataclasses.replace(down, BN=128, split_k=1, k_ranges=2), shared_dense=False)
    assert torch.equal(split, walked)
    whole = moe_fused.fused_moe(*args, dataclasses.replace(gateup, split_k=1), dataclasses.replace(down, split_k=1),
                                shared_dense=False)
    assert not torch.equal(whole, walked) and rel(whole, walked) < 1e-5  # another order, the same sums
    with pytest.raises(ValueError, match="k_ranges=2 K ranges"):
        moe_fused.fused_moe(*args, gateup, dataclasses.replace(down, k_ranges=2))


@pytest.mark.exhaustive  # ~21 s under the interpreter; tests/gpu runs the split-K tiles compiled
def test_split_k_tiles_fit_and_need_their_arrival_counters(monkeypatch):
    small, _ = moe_fused.decode_tiles(1)
    assert moe_grouped.fit(small, 2048, 4096).split_k == small.split_k > 1  # V4-Flash gate/up: K = 4096
    assert moe_grouped.fit(small, 32, 64).split_k == 1  # one BK step: nothing to split
    moe = MoE.random_packed(tiny_config(hidden_size=512, moe_intermediate_size=256), layer=3, fmt="fp4", seed=95,
                            device=DEVICE)
    x, weights, ids = routed(moe, T=2, seed=16)
    split = moe_grouped.Tiles(BT=16, BN=64, BK=128, swap_ab=True, split_k=2)
    # the grouped path (hash layers) takes the small-step tiles with gate/up split, down unsplit
    args = (x, weights, ids, moe.experts, moe.shared_experts, moe.cfg.swiglu_limit)
    check(moe_grouped.grouped_moe(*args, "triton", split, split), x, weights, ids, moe)
    with pytest.raises(ValueError, match="down product in K ranges needs the fused path"):
        moe_grouped.plan_kernels(x, weights, ids, moe.experts, moe.shared_experts, 10.0, split, split,
                                 fuse_combine=False)
    unsplit = dataclasses.replace(split, split_k=1)
    launches, _ = moe_grouped.plan_kernels(*args, split, unsplit, fuse_combine=False)
    assert [launch.kernel.__name__ for launch in launches][:2] == ["_count_sort_kernel", "_gateup_kernel"]
    assert launches[1].grid[2] == 2  # gate/up over two K ranges: the sort zeroed their arrival counters
    monkeypatch.setattr(moe_grouped, "COUNT_SORT_MAX", 2)  # the torch sort: no zeroed counters
    with pytest.raises(ValueError, match="counting sort zeroes"):
        moe_grouped.plan_kernels(*args, split, unsplit, fuse_combine=False)
    check(moe_grouped.grouped_moe(*args, "triton", split, split), x, weights, ids, moe)  # unsplit there
    with pytest.raises(ValueError, match="split_k=3 K ranges"):
        moe_grouped.plan_kernels(x, weights, ids, moe.experts, moe.shared_experts, 10.0,
                                 dataclasses.replace(split, split_k=3), split, fuse_combine=True)


@pytest.mark.parametrize("path", ["fused", "grouped_decode_tiles"])
@pytest.mark.parametrize("dense", [None, False])
def test_shared_expert_dense_or_in_the_kernels(poisoned, path, dense):
    """From `DENSE_MIN_TOKENS` tokens the shared expert runs as dense FP8 products before the expert
    kernels and its fp32 output joins their combine (dense None: the default there); in the
    kernels (False) it is the virtual expert E. Both are the reference's arithmetic."""
    T = moe_shared.DENSE_MIN_TOKENS + 1
    moe = MoE.random_packed(tiny_config(), layer=3, fmt="fp4", seed=61, device=DEVICE)
    x, weights, ids = routed(moe, T=T, seed=11)
    args = (x, weights, ids, moe.experts, moe.shared_experts, moe.cfg.swiglu_limit)
    if path == "fused":
        out = moe_fused.fused_moe(*args, shared_dense=dense)
    else:
        out = moe_grouped.grouped_moe(*args, "triton", *moe_fused.decode_tiles(T), shared_dense=dense)
    check(out, x, weights, ids, moe)


def test_shared_expert_goes_dense_from_the_threshold():
    moe = MoE.random_packed(tiny_config(), layer=3, fmt="fp4", seed=62, device=DEVICE)
    x = torch.randn(moe_shared.DENSE_MIN_TOKENS, moe.cfg.hidden_size, device=DEVICE)
    shared = moe.shared_experts
    assert moe_shared.split_shared(x[:-1], shared, 10.0, None)[:2] == (shared, None)
    kept, add, _ = moe_shared.split_shared(x, shared, 10.0, None)
    assert kept is None and add.shape == x.shape and add.dtype == torch.float32
    assert moe_shared.split_shared(x, None, 10.0, True)[:2] == (None, None)
    # beside the routed kernels, on a side stream (a GPU's, so only the decision is tested here)
    assert moe_shared.DENSE_MIN_TOKENS_BESIDE == 1
    assert moe_shared.runs_dense(x[:1], shared, None, beside=True)
    assert not moe_shared.runs_dense(x[:1], shared, None) and not moe_shared.runs_dense(x[:1], shared, False, True)


@pytest.mark.parametrize("tokens", [40, fp8_gemm.KERNEL_MAX_M + 1])  # FP8 decode kernels / cuBLAS
@pytest.mark.parametrize("inter", [128, 32])  # w3's scale rows continue w1's / start a block row of their own
def test_dense_shared_expert_matches_emulation(poisoned, inter, tokens):
    """The dense shared expert with every 128×128 block scaled differently, on either path: a
    product, or a dequantisation, that took w1's scale for w3's rows (or a neighbour block's) would
    be off by a power of two."""
    g = torch.Generator().manual_seed(inter)
    shared = PackedExperts.random("fp8", 1, 256, inter, "cpu", g).to(DEVICE)
    shared.w13_scale.copy_(119 + torch.randperm(shared.w13_scale.numel(), generator=g).view_as(shared.w13_scale))
    shared.w2_scale.copy_(121 + torch.randperm(shared.w2_scale.numel(), generator=g).view_as(shared.w2_scale))
    x = torch.randn(tokens, 256, generator=g).to(DEVICE)
    out = moe_shared.shared_expert(x, shared, 10.0)
    xb = x.bfloat16().float()
    w1, w3, w2 = shared.dequantize(0)
    h = (F.silu((xb @ w1.T).clamp(max=10.0)) * (xb @ w3.T).clamp(-10.0, 10.0)).bfloat16().float()
    # cuBLAS sums gate/up in another order than the emulation, which flips the bf16 rounding of
    # some h (2^-8 each: rel 1.9e-4 on an H200); a block scaled by a wrong power of two moves it by
    # more than 0.1
    tol = EMULATED_TOL if tokens <= fp8_gemm.KERNEL_MAX_M else 1e-3
    assert out.dtype == torch.float32 and rel(out, h @ w2.T) < tol
    assert not shared.arrivals.any()  # split-K counters left zeroed for the next product
