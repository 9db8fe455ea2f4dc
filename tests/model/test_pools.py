"""Pool geometry, storage formats and exact page accounting."""

import random

import pytest
import torch

from model import low_precision
from model.kv_pool import KVPools, PoolExhausted, SeqKV
from model.tiny import tiny_config


@pytest.fixture
def cfg():
    return tiny_config()


def test_geometry_page_major(cfg):
    pools = KVPools(cfg, "fp8_pack", page_size=256, max_tokens=1024, max_seqs=2)
    c4, c128 = cfg.layers_with_ratio(4), cfg.layers_with_ratio(128)
    entry = low_precision.kv_pack_bytes(cfg.head_dim, cfg.qk_rope_head_dim)
    assert pools.specs["swa"].page_bytes == cfg.num_hidden_layers * 256 * entry
    assert pools.specs["c4"].page_bytes == len(c4) * 64 * entry
    assert pools.specs["c128"].page_bytes == len(c128) * 2 * entry
    assert pools.specs["c4_indexer"].entry_bytes == cfg.index_head_dim + 4
    assert "state_mtp" not in pools.kinds_for()  # no MTP layer asked for
    for kind in pools.kinds_for():
        buf = pools.buffers[kind]
        assert buf.is_contiguous() and buf.dtype == torch.uint8
        assert buf.shape == (pools.specs[kind].num_pages, pools.specs[kind].page_bytes)


def test_the_mtp_layer_is_one_more_layer_of_its_kind_and_its_window_reaches_one_token_further(cfg):
    plain = KVPools(cfg, "fp32", page_size=128, max_tokens=1024, max_seqs=2)
    pools = KVPools(cfg, "fp32", page_size=128, max_tokens=1024, max_seqs=2, with_mtp=True)
    n = cfg.num_hidden_layers
    assert pools.mtp_layer == n and plain.mtp_layer is None
    assert pools.specs["swa"].layers == tuple(range(n + 1))
    assert pools.specs["state_mtp"].layers == (n,)
    assert pools.specs["state_mtp"].page_bytes == 4 * cfg.hc_mult * cfg.hidden_size
    seq = SeqKV()
    pools.reserve(seq, 300)
    assert len(seq.pages["state_mtp"]) == 1
    assert pools.resume_pages(seq)["state_mtp"] == seq.pages["state_mtp"]
    # the MTP query at num_tokens - 1 reads from num_tokens - window on
    at = 127 + cfg.sliding_window
    assert plain.first_live_swa_page(at) == 1 and pools.first_live_swa_page(at) == 0
    assert pools.first_live_swa_page(at + 1) == 1


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8_pack"])
def test_write_read_round_trip(cfg, fmt):
    pools = KVPools(cfg, fmt, page_size=128, max_tokens=512, max_seqs=2)
    seq = SeqKV()
    pools.reserve(seq, 300)
    x = torch.randn(300, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    idx = torch.randperm(300, generator=torch.Generator().manual_seed(1))
    pools.write("swa", 2, seq.pages["swa"], idx, x[idx])
    got = pools.read("swa", 2, seq.pages["swa"], torch.arange(300))
    expected = {"fp32": x, "bf16": x.to(torch.bfloat16).float(), "fp8_pack": low_precision.fake_quant_kv(x, cfg.qk_rope_head_dim)}[fmt]
    assert torch.equal(got, expected)
    # other layers of the same pages are untouched
    assert (pools.read("swa", 1, seq.pages["swa"], torch.arange(300)) == 0).all()


def test_fp8_indexer_keys_keep_values_and_scales_in_separate_blocks(cfg):
    """A page's layer part holds the indexer keys' FP8 values back to back, then their scales
    (seed 001's paged indexer layout): entry e's values at e·c, its scale at EPP·c + 4e."""
    pools = KVPools(cfg, "fp8_pack", page_size=256, max_tokens=1024, max_seqs=1)
    spec, c = pools.specs["c4_indexer"], cfg.index_head_dim
    assert spec.split_at == c and spec.entry_stride == c and spec.layer_bytes == spec.entries_per_page * (c + 4)
    seq = SeqKV()
    pools.reserve(seq, 1024)
    layer = cfg.layers_with_ratio(4)[-1]
    idx = torch.tensor([0, 5, 64 + 63, 3 * 64 + 17])  # slots 0, 5, 63, 17 of pages 0, 0, 1, 3
    x = torch.randn(len(idx), c, generator=torch.Generator().manual_seed(2)) * torch.tensor([[1.0], [8.0], [0.25], [3.0]])
    pools.write("c4_indexer", layer, seq.pages["c4_indexer"], idx, x)
    packed = low_precision.pack_index_key(x)
    part = pools._local["c4_indexer"][layer] * spec.layer_bytes
    for i, j in enumerate(idx.tolist()):
        page = pools.buffers["c4_indexer"][seq.pages["c4_indexer"][j // 64]]
        slot = j % 64
        assert torch.equal(page[part + slot * c:part + (slot + 1) * c], packed[i, :c])
        scale_at = part + 64 * c + 4 * slot
        assert torch.equal(page[scale_at:scale_at + 4], packed[i, c:])
    got = pools.read("c4_indexer", layer, seq.pages["c4_indexer"], idx)
    assert torch.equal(got, low_precision.unpack_index_key(packed, c))
    # page_order lays a whole page's entries out the same way
    order = spec.page_order()
    assert sorted(order.tolist()) == list(range(spec.page_bytes))
    page = pools.buffers["c4_indexer"][seq.pages["c4_indexer"][0]]
    logical = page[order].reshape(-1, c + 4)
    assert torch.equal(logical[pools._local["c4_indexer"][layer] * 64 + 5], packed[1])
    # other kinds and formats keep whole entries
    assert pools.specs["c4"].split_at == 0
    assert KVPools(cfg, "bf16", page_size=256, max_tokens=256, max_seqs=1).specs["c4_indexer"].split_at == 0


def test_page_encoding_names_the_indexer_layout(cfg):
    """Peers compare it in the transfer handshake: pages of the whole-entry layout must not mix in."""
    from worker_runtime.kv_link import layout_of
    fp8 = KVPools(cfg, "fp8_pack", page_size=256, max_tokens=256, max_seqs=1)
    assert layout_of(fp8).storage_format == "fp8_pack/index-split"
    assert layout_of(KVPools(cfg, "bf16", page_size=256, max_tokens=256, max_seqs=1)).storage_format == "bf16"


def test_accounting_returns_to_idle(cfg):
    pools = KVPools(cfg, "fp32", page_size=128, max_tokens=1024, max_seqs=4)
    idle = pools.idle_free()
    seqs = [SeqKV() for _ in range(3)]
    for i, s in enumerate(seqs):
        pools.reserve(s, 100 + 300 * i)
    assert pools.num_free()["swa"] == idle["swa"] - (1 + 4 + 6)
    assert pools.num_free()["state_c4"] == idle["state_c4"] - 3
    child = pools.fork(seqs[2])
    for s in seqs + [child]:
        pools.release(s)
    assert pools.num_free() == idle


def test_reserve_is_all_or_nothing(cfg):
    pools = KVPools(cfg, "fp32", page_size=128, max_tokens=256, max_seqs=1)
    a = SeqKV()
    pools.reserve(a, 200)
    before = pools.num_free()
    with pytest.raises(PoolExhausted, match="state_c4"):
        pools.reserve(SeqKV(), 10)  # the single state slot is taken
    assert pools.num_free() == before


def test_trim_window_frees_pages_no_query_can_see(cfg):
    pools = KVPools(cfg, "fp32", page_size=128, max_tokens=1024, max_seqs=1)
    seq = SeqKV()
    pools.reserve(seq, 600)
    seq.num_tokens = 400  # window 16: tokens < 385 are invisible from now on
    assert pools.trim_window(seq) == 3
    assert seq.pages["swa"][:3] == [-1, -1, -1] and seq.pages["swa"][3] >= 0
    with pytest.raises(RuntimeError, match="released page"):
        pools.read("swa", 0, seq.pages["swa"], torch.tensor([10]))
    pools.release(seq)
    assert pools.num_free() == pools.idle_free()


def test_fork_shares_full_pages_and_copies_partial(cfg):
    pools = KVPools(cfg, "fp32", page_size=128, max_tokens=512, max_seqs=2)
    a = SeqKV()
    pools.reserve(a, 300)
    a.num_tokens = 300
    b = pools.fork(a)
    assert b.pages["swa"][:2] == a.pages["swa"][:2]  # tokens 0..255 shared
    assert b.pages["swa"][2] != a.pages["swa"][2]  # partial page copied
    assert torch.equal(pools.buffers["swa"][a.pages["swa"][2]], pools.buffers["swa"][b.pages["swa"][2]])
    pools.release(a)
    assert pools.allocators["swa"]._refs[b.pages["swa"][0]] == 1  # still held by b
    pools.release(b)
    assert pools.num_free() == pools.idle_free()


def test_bad_storage_format_and_page_size(cfg):
    with pytest.raises(ValueError, match="storage format"):
        KVPools(cfg, "fp16")
    with pytest.raises(ValueError, match="multiple of 128"):
        KVPools(cfg, "fp32", page_size=100)


def test_resume_pages_move_a_request_between_replicas(cfg):
    """Copy the resume pages of a request into a second pool set: decoding continues there
    with logits identical to continuing in place."""
    from model.batch import ForwardBatch
    from model.tiny import random_weights
    from model.transformer import Transformer

    model = Transformer(cfg)
    model.load_state_dict(random_weights({k: v.shape for k, v in model.state_dict().items()}, cfg, 0))
    src = KVPools(cfg, "fp8_pack", page_size=128, max_tokens=512, max_seqs=2)
    dst = KVPools(cfg, "fp8_pack", page_size=128, max_tokens=512, max_seqs=2)
    ids = torch.randint(0, cfg.vocab_size, (301,), generator=torch.Generator().manual_seed(2)).tolist()
    seq = SeqKV()
    src.reserve(seq, 301)
    b = ForwardBatch.build([(seq, ids[:300])])
    model(b, src)
    b.commit()
    src.trim_window(seq)
    pages = src.resume_pages(seq)
    assert {k: len(v) for k, v in pages.items()} == dst.resume_page_counts(300)
    assert all(p >= 0 for v in pages.values() for p in v)
    got = {k: dst.alloc(k, len(v)) for k, v in pages.items()}
    for kind in pages:
        dst.buffers[kind][got[kind]] = src.buffers[kind][pages[kind]]
    moved = dst.adopt(300, got)
    dst.reserve(moved, 301)
    here = model(ForwardBatch.build([(seq, ids[300:])]), src)
    there = model(ForwardBatch.build([(moved, ids[300:])]), dst)
    assert torch.equal(here, there)
    src.release(seq)
    dst.release(moved)
    assert src.num_free() == src.idle_free() and dst.num_free() == dst.idle_free()


def test_trim_window_frees_what_a_full_scan_frees(cfg):
    """Trims at random token counts over SWA lists with pages already freed here and there and
    with pinned pages: the pages freed, and the lists left, are those of freeing every live,
    unpinned page below the window."""
    rng = random.Random(3)
    pools = KVPools(cfg, "fp32", page_size=128, max_tokens=4096, max_seqs=2)
    for trial in range(60):
        seq = SeqKV()
        pools.reserve(seq, 4096)
        for i in rng.sample(range(32), rng.randrange(8)):  # freed earlier (trims, adopt, a cache)
            pools.allocators["swa"].free([seq.pages["swa"][i]])
            seq.pages["swa"][i] = -1
        pinned = frozenset(rng.sample(range(32), rng.randrange(4)))
        for tokens in sorted(rng.sample(range(4096), 5)):
            seq.num_tokens = tokens
            first = max(0, tokens - cfg.sliding_window + 1) // pools.page_size
            want = [-1 if i < first and i not in pinned else p for i, p in enumerate(seq.pages["swa"])]
            expect = sum(p >= 0 for p, w in zip(seq.pages["swa"], want) if w < 0)
            free = pools.num_free()["swa"]
            assert pools.trim_window(seq, pinned) == expect, trial
            assert seq.pages["swa"] == want and pools.num_free()["swa"] == free + expect
        pools.release(seq)
    assert pools.num_free() == pools.idle_free()
