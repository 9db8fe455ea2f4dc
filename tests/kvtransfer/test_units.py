"""Unit tests without NIXL: layout, coalescing, checksums, wire types, fault plans."""

import random

import pytest
import torch

from kvtransfer import (Ack, FaultPlan, LayoutDescriptor, PoolLayout, TransferDone,
                        TransferTarget, coalesce, decode, decode_target, layer_byte_range,
                        page_checksum)
from kvtransfer.checksum import _G1, _G2, checksum_torch, pool_checksums, range_checksum_tensor
from kvtransfer.protocol import Begin, Fenced
from kvtransfer.regions import Span, total_bytes, truncate
from kvt_harness import make_layout


# --------------------------------------------------------------------------- layout

def test_layout_id_ignores_num_pages_and_order():
    a = make_layout(num_pages=32)
    b = make_layout(num_pages=7)
    assert a.layout_id == b.layout_id and a.mismatches(b) == []
    shuffled = LayoutDescriptor(a.model_hash, a.storage_format, a.page_tokens,
                                tuple(reversed(a.pools)), tuple(reversed(a.layer_map)))
    assert shuffled.layout_id == a.layout_id
    assert LayoutDescriptor.from_bytes(a.to_bytes()) == a


def test_layout_mismatches_name_each_field():
    a = make_layout()
    b = make_layout(page_bytes={"c4": 1168}, storage_format="fp32", model_hash="m1")
    diffs = a.mismatches(b)
    assert "pool 'c4' page_bytes 2336 != 1168" in diffs
    assert "storage_format 'fp8_pack' != 'fp32'" in diffs
    assert "model_hash 'm0' != 'm1'" in diffs
    assert a.layout_id != b.layout_id
    c = LayoutDescriptor("m0", "fp8_pack", 256, a.pools[:-1], a.layer_map[:-1])
    assert "pool 'state_c4' missing on peer" in a.mismatches(c)
    d = LayoutDescriptor("m0", "fp8_pack", 256, a.pools,
                         (("swa", (0, 1, 2, 3)), ("c4", (1, 2)), ("c128", (2,)),
                          ("state_c4", (1, 3))))
    assert a.mismatches(d) == ["layer_map 'c4' [1, 3] != [1, 2]"]


def test_layout_validates():
    with pytest.raises(ValueError):
        LayoutDescriptor("m", "f", 256, (PoolLayout("a", 8, 1), PoolLayout("a", 8, 1)))
    with pytest.raises(ValueError):
        PoolLayout("a", 0, 1)
    lay = make_layout(num_pages=4)
    pools = {p.kind: torch.zeros(p.num_pages, p.page_bytes, dtype=torch.uint8)
             for p in lay.pools}
    lay.check_pools(pools)
    pools["c4"] = torch.zeros(4, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="c4"):
        lay.check_pools(pools)


# --------------------------------------------------------------------------- regions

def _expand(spans, page_bytes):
    """Byte-level (src, dst) pairs covered by spans, to compare with the naive mapping."""
    out = []
    for s in spans:
        out += [(s.src_offset + i, s.dst_offset + i) for i in range(0, s.nbytes, page_bytes)]
    return out


def test_coalesce_runs_on_both_sides():
    spans = coalesce([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 5, 6], 100)
    assert spans == [Span(400, 0, 300), Span(900, 300, 100), Span(1000, 500, 100),
                     Span(200, 600, 100)]
    assert coalesce([], [], 100) == []
    assert coalesce(list(range(50)), list(range(10, 60)), 8) == [Span(0, 80, 400)]
    with pytest.raises(ValueError):
        coalesce([1, 2], [1], 8)


def test_coalesce_random_matches_naive():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(1, 40)
        src = rng.sample(range(64), n) if rng.random() < 0.5 else list(range(3, 3 + n))
        dst = sorted(rng.sample(range(64), n)) if rng.random() < 0.5 else list(range(n))
        spans = coalesce(src, dst, 16)
        assert _expand(spans, 16) == [(s * 16, d * 16) for s, d in zip(src, dst)]
        runs = 1 + sum(1 for i in range(1, n)
                       if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1)
        assert len(spans) == runs
        assert total_bytes(spans) == n * 16


def test_byte_range_and_layers():
    assert layer_byte_range(600, 3, 1) == (200, 200)
    assert layer_byte_range(600, 3, 1, count=2) == (200, 400)
    spans = coalesce([1, 2], [5, 6], 600, byte_range=(200, 200))
    assert spans == [Span(800, 3200, 200), Span(1400, 3800, 200)]
    assert coalesce([1, 2], [5, 6], 600, byte_range=(0, 600)) == [Span(600, 3000, 1200)]
    with pytest.raises(ValueError):
        coalesce([1], [1], 600, byte_range=(500, 200))
    with pytest.raises(ValueError):
        layer_byte_range(600, 7, 0)
    assert truncate([Span(0, 0, 10), Span(20, 30, 10)], 15) == [Span(0, 0, 10), Span(20, 30, 5)]


# --------------------------------------------------------------------------- checksum

def _reference(pool, ids):
    """Pure-Python checksum mod 2^64 (what the torch version must equal, wraparound included)."""
    m, s = 1 << 64, 0
    for p, i in enumerate(ids):
        words = pool[i].view(torch.int32).tolist()
        bp = (2 * p + 1) * _G2
        for k, w in enumerate(words):
            s = (s + w * ((2 * k + 1) * _G1) * bp) % m
    return s - m if s >= 1 << 63 else s


def _random_pool(pages, page_bytes, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8, generator=g)


def test_checksum_matches_reference_with_wraparound():
    pool = _random_pool(12, 64, 0)
    ids = [5, 0, 11, 3]
    assert page_checksum(pool, ids) == _reference(pool, ids)
    assert int(checksum_torch(pool, ids, chunk_words=16)) == page_checksum(pool, ids)  # 1/chunk
    assert page_checksum(pool, []) == 0


def test_checksum_detects_every_single_byte_flip():
    pool = _random_pool(3, 96, 1)
    ids = [2, 0, 1]
    base = page_checksum(pool, ids)
    for page in ids:
        for byte in range(96):
            for delta in (1, 0x80, 0xFF):
                bad = pool.clone()
                bad[page, byte] ^= delta
                assert page_checksum(bad, ids) != base, (page, byte, delta)


def test_checksum_detects_truncation_swap_and_misplacement():
    src = _random_pool(8, 4096, 2)
    dst = _random_pool(8, 4096, 3)          # stale, unrelated bytes
    ids = [1, 2, 3, 6]
    want = page_checksum(src, ids)
    full = dst.clone()
    full[ids] = src[ids]
    assert page_checksum(full, ids) == want
    for keep in (1, 4095, 4096 * 3 + 17):   # a partially written transfer: only a prefix
        landed = dst[ids].reshape(-1).clone()
        landed[:keep] = src[ids].reshape(-1)[:keep]
        part = dst.clone()
        part[ids] = landed.view(len(ids), 4096)
        assert page_checksum(part, ids) != want, keep
    assert page_checksum(src, [2, 1, 3, 6]) != want       # two pages swapped
    moved = src.clone()
    moved[7] = src[6]
    assert page_checksum(moved, [1, 2, 3, 7]) == want      # position in list, not page id
    assert page_checksum(src, [1, 2, 3, 6, 6]) != want


def test_checksum_odd_page_size_and_per_pool():
    pool = _random_pool(4, 37, 4)            # not a multiple of 4: byte-wise path
    base = page_checksum(pool, [3, 1])
    bad = pool.clone()
    bad[1, 36] ^= 1
    assert page_checksum(bad, [3, 1]) != base
    pools = {"a": _random_pool(4, 64, 5), "b": pool}
    sums = pool_checksums(pools, {"a": [0, 2], "b": [3, 1]})
    assert sums == {"a": page_checksum(pools["a"], [0, 2]), "b": base}


# --------------------------------------------------------------------------- protocol

def test_messages_roundtrip():
    t = TransferTarget("r1", "dec-0", "ab12", "ffee", (("c4", (3, 4, 9)), ("swa", (0,))),
                       1234.5)
    assert decode_target(t.to_bytes()) == t
    assert t.pages() == {"c4": (3, 4, 9), "swa": (0,)}
    msgs = [Begin("r1", "ab12"), Fenced("r1", "ab12"), Ack("r1", "ab12", "ok", 12.0),
            TransferDone("r1", "ab12", 2, (("c4", -5), ("swa", 1 << 62)), b"\x00\xffhdr", 99)]
    for m in msgs:
        assert decode(m.to_bytes()) == m
    with pytest.raises(ValueError):
        decode(b"Zjunk")
    with pytest.raises(ValueError):
        decode(b"D{}")
    with pytest.raises(ValueError):
        decode_target(Begin("r", "e").to_bytes())
    with pytest.raises(ValueError):
        Ack("r", "e", "maybe", 0.0)


def test_fault_plan_validates():
    FaultPlan(drop=frozenset({"TransferDone"}), kill_at="sender.before_done")
    with pytest.raises(ValueError):
        FaultPlan(drop=frozenset({"Done"}))
    with pytest.raises(ValueError):
        FaultPlan(kill_at="somewhere")
    with pytest.raises(ValueError):
        FaultPlan(truncate_write=1.0)


@pytest.mark.parametrize("page_bytes,layers", [(96, 4), (96, 3), (37 * 2, 2)])  # words; words; byte-wise pages
def test_layer_slices_sum_to_the_whole_page_checksum(page_bytes, layers):
    """A sender that checksums each layer's slice as it writes it, and the leading pages it wrote
    whole before, arrives at page_checksum of the whole pages: the receiver verifies as ever."""
    pool = _random_pool(10, page_bytes, 6)
    ids = [7, 2, 9, 0, 4]
    total = range_checksum_tensor(pool, ids[:2])  # written whole by an earlier chunk
    for layer in range(layers):
        total = total + range_checksum_tensor(pool, ids[2:], 2, layer_byte_range(page_bytes, layers, layer))
    assert int(total) == page_checksum(pool, ids)
    assert pool_checksums({"k": pool}, {"k": ids}, {"k": total}) == {"k": page_checksum(pool, ids)}
    part = range_checksum_tensor(pool, ids[2:], 2, layer_byte_range(page_bytes, layers, 0))
    bad = pool.clone()
    bad[ids[3], 0] ^= 1  # a flipped byte of the first layer's slice
    assert int(range_checksum_tensor(bad, ids[2:], 2, layer_byte_range(page_bytes, layers, 0))) != int(part)


def test_range_checksum_refuses_a_range_outside_the_page_or_off_the_words():
    pool = _random_pool(2, 64, 7)
    with pytest.raises(ValueError, match="outside"):
        range_checksum_tensor(pool, [0], 0, (60, 8))
    with pytest.raises(ValueError, match="word-aligned"):
        range_checksum_tensor(pool, [0], 0, (2, 8))
