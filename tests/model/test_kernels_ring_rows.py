"""The ring-row kernels of speculative steps (`kernels/attention/ring_rows.py`) against their torch
references: a snapshot taken, the ring overwritten as a step's writes would, then put back from
each row's keep on (one position earlier in the MTP block's layer), bit for bit (interpreter on
CPU, compiled on a GPU)."""

import pytest
import torch

from model.kernels.attention import ring_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("entry_bytes", [24, 6], ids=["words", "bytes"])
def test_take_and_restore_match_the_reference(entry_bytes):
    g = torch.Generator().manual_seed(entry_bytes)
    pages_total, layers, entries, width = 6, 3, 8, 5
    raw = torch.randint(0, 256, (pages_total, layers, entries, entry_bytes), generator=g, dtype=torch.uint8)
    view = ring_rows.words(raw.to(DEVICE))
    assert view.dtype == (torch.int32 if entry_bytes % 4 == 0 else torch.uint8)
    pages = torch.tensor([4, 1, 2], device=DEVICE)
    positions = torch.tensor([5, 30, 0], device=DEVICE)[:, None] + torch.arange(width, device=DEVICE)  # 5..9 wraps
    saved = ring_rows.take(view, pages, positions, "triton")
    assert torch.equal(saved, ring_rows.reference_take(view, pages, positions))
    assert saved.shape == (3, layers, width, view.shape[-1])

    original = view.clone()
    scribbled = torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8).to(DEVICE)
    rows, keep, mtp = torch.tensor([2, 0], device=DEVICE), torch.tensor([2, 7], device=DEVICE), 1
    got, want = ring_rows.words(scribbled.clone()), ring_rows.words(scribbled.clone())
    ring_rows.restore(got, pages, positions, saved, rows, keep, mtp, "triton")
    ring_rows.reference_restore(want, pages, positions, saved, rows, keep, mtp)
    assert torch.equal(got, want)
    # row 2 (page 2, positions 0..4) back from 2 (from 1 in layer 1), row 0 (page 4, 5..9) from 7
    # (6 in layer 1); row 1's page and every other entry keep the step's writes
    for page, first, positions_of_row in ((2, 2, range(0, 5)), (4, 7, range(5, 10))):
        for layer in range(layers):
            for p in positions_of_row:
                back = p >= first - (layer == mtp)
                source = original if back else ring_rows.words(scribbled)
                assert torch.equal(got[page, layer, p % entries], source[page, layer, p % entries]), (page, layer, p)
    assert torch.equal(got[1], ring_rows.words(scribbled)[1])
    assert not torch.equal(got, ring_rows.words(scribbled))


def test_a_snapshot_takes_and_restores_the_same_bytes_on_the_kernels_and_the_reference():
    """`speculation.Snapshot` over real pools (every ring kind, the MTP layer's rows among them):
    taken and restored on the kernels, the pools end byte for byte where the reference leaves
    them, and the restore put back what the step overwrote."""
    import copy

    from model.kv_pool import KVPools, SeqKV
    from model.speculation import RING_KINDS, Snapshot
    from model.tiny import tiny_config

    cfg = tiny_config()
    pools = KVPools(cfg, "fp8_pack", max_tokens=256, max_seqs=3, device=DEVICE, with_mtp=True)
    g = torch.Generator().manual_seed(9)
    for buf in pools.buffers.values():
        buf.copy_(torch.randint(0, 256, buf.shape, generator=g, dtype=torch.uint8))
    seqs = [SeqKV(), SeqKV()]
    for seq, n in zip(seqs, (40, 77)):
        pools.reserve(seq, n + 8)
        seq.num_tokens = n
    kinds = [k for k in RING_KINDS if k in pools.buffers]
    assert kinds, "the tiny config has compress-state rings"
    streams = torch.randn(8, cfg.hc_mult, cfg.hidden_size, generator=g).to(DEVICE)
    scribbles = {k: torch.randint(0, 256, pools.buffers[k].shape, generator=g, dtype=torch.uint8) for k in kinds}
    ends = {}
    for impl in ("torch", "triton"):
        twin = copy.deepcopy(pools)
        snap = Snapshot.take(twin, seqs, 5, impl=impl)
        before = {k: twin.buffers[k].clone() for k in kinds}
        for k in kinds:  # the step's writes
            twin.buffers[k].copy_(scribbles[k])
        rows = torch.tensor([1, 0], device=DEVICE)
        snap.restore_rows(twin, rows, torch.tensor([79, 41], device=DEVICE), torch.tensor([3, 6], device=DEVICE),
                          streams)
        ends[impl] = {k: twin.buffers[k].clone() for k in (*kinds, "state_mtp")}
        assert any(not torch.equal(ends[impl][k], scribbles[k].to(DEVICE)) for k in kinds)  # something put back
        assert all(not torch.equal(ends[impl][k], before[k]) for k in kinds)  # not everything
    for k in ends["torch"]:
        assert torch.equal(ends["triton"][k], ends["torch"][k]), k
