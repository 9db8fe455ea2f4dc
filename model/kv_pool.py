"""Paged KV pools of DeepSeek-V4 (ARCHITECTURE.md §4, seed 000 "KV Cache Pool").

One contiguous uint8 buffer per pool kind, shape [num_pages, page_bytes], page-major:
a page holds every layer of its kind, laid out [layer][entry][entry_bytes]. The transfer layer
registers each buffer once and moves whole pages (or one layer's slice of them) without copies.

One exception to [entry][entry_bytes] inside a layer: `fp8_pack` indexer keys are stored as in
DeepGEMM's paged indexer cache (seed 001), a page's c-byte FP8 values of all its entries first,
then their 4-byte scales ([entry][c] then [entry][4]; `PoolSpec.split_at`). A block of keys is
then one contiguous, 16-byte aligned read, where 132-byte entries allowed only 4-byte loads.

Kinds (P = page_size tokens, d = head_dim, c = index_head_dim):

| kind               | layers      | entries / page     | entry                               |
|--------------------|-------------|--------------------|-------------------------------------|
| `swa`              | all         | P tokens           | KV entry (format dependent)         |
| `c4`               | ratio 4     | P/4 compressed     | KV entry                            |
| `c128`             | ratio 128   | P/128 compressed   | KV entry                            |
| `c4_indexer`       | ratio 4     | P/4 compressed     | indexer key (format dependent)      |
| `state_c4`         | ratio 4     | 8 ring rows        | fp32 [kv 2d | score 2d]             |
| `state_c4_indexer` | ratio 4     | 8 ring rows        | fp32 [kv 2c | score 2c]             |
| `state_c128`       | ratio 128   | 128 ring rows      | fp32 [kv d | score d]               |
| `state_mtp`        | MTP block   | 1 row              | fp32 main streams [hc, D]           |

A state "page" is one request's slot. Ring row of token t is `t % rows`; rows hold the raw
compressor projections (before `ape`), so a ring is resumable from any token boundary.

With the MTP block (`with_mtp`), its layer (index `num_hidden_layers`) is one more layer of the
pools of its kind. MTP position t fuses the main streams at t with token t+1, so it lags the main
layers by one: a request with n cached tokens holds MTP positions 0..n-2, and `state_mtp` holds
the main streams at n-1, which the next forward pairs with token n. Its window therefore reaches
one token further back (`first_live_swa_page`).

Storage formats: `fp32` and `bf16` (exact up to the dtype) and `fp8_pack` (584-byte
NopeFp8RopeBf16Pack KV entries, FP8 + FP32-scale indexer keys). Compress state is always fp32.
`KVPools.page_encoding` names format and byte layout together for the transfer handshake.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from model import low_precision
from model.config import ModelConfig

STORAGE_FORMATS = ("fp32", "bf16", "fp8_pack")
KV_KINDS = ("swa", "c4", "c128")
STATE_KINDS = ("state_c4", "state_c4_indexer", "state_c128", "state_mtp")
ALL_KINDS = ("swa", "c4", "c128", "c4_indexer") + STATE_KINDS
RATIO_OF_KIND = {"c4": 4, "c128": 128, "c4_indexer": 4}


class PoolExhausted(RuntimeError):
    """Not enough free pages in a pool to satisfy an allocation."""


@dataclass(frozen=True)
class PoolSpec:
    """Geometry of one pool kind."""

    kind: str
    layers: tuple[int, ...]  # model layer ids stored in this pool, in page order
    entries_per_page: int
    entry_bytes: int
    num_pages: int
    # 0: each entry's bytes are contiguous. Otherwise an entry's first `split_at` bytes sit in a
    # block of all the layer's entries' first parts, and its remaining bytes in a block after it.
    split_at: int = 0

    @property
    def layer_bytes(self) -> int:
        return self.entries_per_page * self.entry_bytes

    @property
    def page_bytes(self) -> int:
        return len(self.layers) * self.layer_bytes

    @property
    def entry_stride(self) -> int:
        """Bytes from one slot's first byte to the next slot's (the first block's when split)."""
        return self.split_at or self.entry_bytes

    def slab_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """Entry slots within a page [n] (int64) → [n, entry_bytes]: where each byte of the
        entry's encoding lies, counted from the start of its layer's part of the page."""
        cols = torch.arange(self.entry_bytes, device=slots.device)
        if not self.split_at:
            return slots.unsqueeze(1) * self.entry_bytes + cols
        head, tail = self.split_at, self.entry_bytes - self.split_at
        return torch.cat([slots.unsqueeze(1) * head + cols[:head],
                          self.entries_per_page * head + slots.unsqueeze(1) * tail + cols[:tail]], dim=1)

    def page_order(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """[page_bytes] int64: where in a page each byte lies of its entries' encodings laid end
        to end (layer by layer, slot by slot); the identity unless `split_at`."""
        slab = self.slab_offsets(torch.arange(self.entries_per_page, device=device)).reshape(-1)
        starts = torch.arange(len(self.layers), device=device) * self.layer_bytes
        return (starts.unsqueeze(1) + slab).reshape(-1)


class PageAllocator:
    """Free list with reference counts; `num_free` returns to `num_pages` when all is released."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages

    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"need {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"incref of free page {p}"
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p < 0:
                continue
            assert self._refs[p] > 0, f"double free of page {p}"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)


@dataclass(eq=False)
class SeqKV:
    """One request's view of the pools: page ids per kind and how many tokens are cached.
    Compared by identity: two requests never hold the same pages, whatever their lists say.

    `pages["swa"][i]` covers tokens [i*P, (i+1)*P); -1 marks a page released because it fell out
    of the sliding window. Compressed kinds index pages by compressed entry; state kinds hold one
    slot id.
    """

    pages: dict[str, list[int]] = field(default_factory=lambda: {k: [] for k in ALL_KINDS})
    num_tokens: int = 0


class KVPools:
    """All pools of one model replica, their allocators and typed entry access."""

    def __init__(self, cfg: ModelConfig, storage_format: str = "fp32", page_size: int = 256,
                 max_tokens: int = 8192, max_seqs: int = 16, device: str | torch.device = "cpu",
                 with_mtp: bool = False, swa_pages: int | None = None):
        if storage_format not in STORAGE_FORMATS:
            raise ValueError(f"storage format must be one of {STORAGE_FORMATS}, got {storage_format!r}")
        if page_size % 128 or page_size <= 0:
            raise ValueError(f"page_size must be a positive multiple of 128 tokens, got {page_size}")
        if storage_format == "fp8_pack" and cfg.nope_head_dim % low_precision.KV_SCALE_BLOCK:
            raise ValueError(f"fp8_pack needs head_dim - qk_rope_head_dim divisible by "
                             f"{low_precision.KV_SCALE_BLOCK}, got {cfg.nope_head_dim}")
        self.cfg, self.format, self.page_size, self.device = cfg, storage_format, page_size, device
        self.with_mtp = with_mtp and cfg.num_nextn_predict_layers > 0
        with_mtp = self.with_mtp
        d, c = cfg.head_dim, cfg.index_head_dim
        kv_bytes = {"fp32": 4 * d, "bf16": 2 * d, "fp8_pack": low_precision.kv_pack_bytes(d, cfg.qk_rope_head_dim)}
        idx_bytes = {"fp32": 4 * c, "bf16": 2 * c, "fp8_pack": low_precision.index_pack_bytes(c)}
        c4, c128 = cfg.layers_with_ratio(4, with_mtp), cfg.layers_with_ratio(128, with_mtp)
        n_attn = len(cfg.attention_ratios(with_mtp))
        token_pages = -(-max_tokens // page_size) * max_seqs
        # SWA keeps one window (+1 page of slack for the page being filled) per running request,
        # plus full-length pages for prefixes held by a cache; by default sized like the compressed
        # pools, `swa_pages` when the caller trims windows (decode-only replicas, benchmarks).
        geometry = {
            "swa": (tuple(range(n_attn)), page_size, kv_bytes[storage_format], swa_pages or token_pages),
            "c4": (c4, page_size // 4, kv_bytes[storage_format], token_pages),
            "c128": (c128, page_size // 128, kv_bytes[storage_format], token_pages),
            "c4_indexer": (c4, page_size // 4, idx_bytes[storage_format], token_pages),
            "state_c4": (c4, 8, 4 * 4 * d, max_seqs),
            "state_c4_indexer": (c4, 8, 4 * 4 * c, max_seqs),
            "state_c128": (c128, 128, 4 * 2 * d, max_seqs),
            "state_mtp": ((n_attn - 1,) if with_mtp else (), 1, 4 * cfg.hc_mult * cfg.hidden_size, max_seqs),
        }
        self.specs = {k: PoolSpec(k, *g) for k, g in geometry.items()}
        if storage_format == "fp8_pack":
            self.specs["c4_indexer"] = replace(self.specs["c4_indexer"], split_at=c)
        self.buffers = {k: torch.zeros(s.num_pages, max(s.page_bytes, 1), dtype=torch.uint8, device=device)
                        for k, s in self.specs.items()}
        self.allocators = {k: PageAllocator(s.num_pages) for k, s in self.specs.items()}
        self._local = {k: {layer: i for i, layer in enumerate(s.layers)} for k, s in self.specs.items()}

    # --- accounting -----------------------------------------------------------------------
    def num_free(self, kind: str | None = None):
        """Free pages of one kind (int), or of every kind (dict) when `kind` is None."""
        if kind is not None:
            return self.allocators[kind].num_free()
        return {k: a.num_free() for k, a in self.allocators.items()}

    def idle_free(self) -> dict[str, int]:
        return {k: s.num_pages for k, s in self.specs.items()}

    @property
    def page_encoding(self) -> str:
        """The storage format with its page layout: peers exchange pages only when these match
        (an `fp8_pack` page of the whole-entry indexer layout reads as garbage in this one)."""
        return f"{self.format}/index-split" if self.specs["c4_indexer"].split_at else self.format

    def kinds_for(self) -> tuple[str, ...]:
        """Kinds that actually hold layers for this model (others stay empty)."""
        return tuple(k for k, s in self.specs.items() if s.layers)

    def pages_needed(self, seq: SeqKV, total_tokens: int) -> dict[str, int]:
        """New pages `seq` needs so that tokens [0, total_tokens) fit."""
        need = {}
        for kind in self.kinds_for():
            if kind in STATE_KINDS:
                need[kind] = 0 if seq.pages[kind] else 1
                continue
            ratio = RATIO_OF_KIND.get(kind, 1)
            entries = total_tokens // ratio
            per_page = self.specs[kind].entries_per_page
            need[kind] = max(0, -(-entries // per_page) - len(seq.pages[kind]))
        return need

    def reserve(self, seq: SeqKV, total_tokens: int) -> None:
        """Allocate what `seq` needs to hold `total_tokens`; all or nothing."""
        need = self.pages_needed(seq, total_tokens)
        short = {k: (n, self.allocators[k].num_free()) for k, n in need.items() if n > self.allocators[k].num_free()}
        if short:
            raise PoolExhausted(", ".join(f"{k}: need {n}, free {f}" for k, (n, f) in short.items()))
        for kind, n in need.items():
            seq.pages[kind].extend(self.allocators[kind].alloc(n))

    def release(self, seq: SeqKV) -> None:
        for kind in ALL_KINDS:
            self.allocators[kind].free(seq.pages[kind])
            seq.pages[kind] = []

    def trim_window(self, seq: SeqKV, pinned: frozenset[int] = frozenset()) -> int:
        """Free SWA pages no future query can see (all tokens < num_tokens - window + 1), except
        the page indices in `pinned` (kept e.g. for a prefix cache). Returns pages freed.

        The live pages below the window are counted in C, then found walking down from it: in a
        decode step that is the one page just left behind (or none), where a Python scan of the
        whole list cost 128 pages a request and step at 32K tokens."""
        first_needed = self.first_live_swa_page(seq.num_tokens)
        pages, freed, i = seq.pages["swa"], 0, first_needed
        live = first_needed - pages[:first_needed].count(-1)
        while live:
            i -= 1
            if pages[i] < 0:
                continue
            live -= 1
            if i not in pinned:
                self.allocators["swa"].free([pages[i]])
                pages[i] = -1
                freed += 1
        return freed

    def fork(self, seq: SeqKV) -> SeqKV:
        """A new sequence sharing `seq`'s full pages (refcounted) with private copies of the
        partially filled last pages and of the compress-state slots (copy-on-write at fork)."""
        child = SeqKV(num_tokens=seq.num_tokens)
        for kind in self.kinds_for():
            pages = seq.pages[kind]
            if kind in STATE_KINDS:
                shared, private = [], pages
            else:
                ratio = RATIO_OF_KIND.get(kind, 1)
                full = (seq.num_tokens // ratio) // self.specs[kind].entries_per_page
                shared, private = pages[:full], pages[full:]
            self.allocators[kind].incref([p for p in shared if p >= 0])
            copies = self.allocators[kind].alloc(len(private))
            for src, dst in zip(private, copies):
                self.buffers[kind][dst] = self.buffers[kind][src]
            child.pages[kind] = list(shared) + copies
        return child

    # --- allocator interface (kvtransfer's receiver reserves through it) --------------------
    def alloc(self, kind: str, n: int) -> list[int]:
        return self.allocators[kind].alloc(n)

    def free(self, kind: str, page_ids: list[int]) -> None:
        self.allocators[kind].free(page_ids)

    # --- moving a request between replicas -------------------------------------------------
    @property
    def mtp_layer(self) -> int | None:
        """The MTP block's layer id in these pools, None without it."""
        return self.cfg.num_hidden_layers if self.with_mtp else None

    def first_live_swa_page(self, num_tokens: int) -> int:
        """Index of the first SWA page a request at `num_tokens` cached tokens still reads (the MTP
        layer's next query is at num_tokens - 1, one behind the main layers')."""
        lag = 1 if self.with_mtp else 0
        return max(0, num_tokens - lag - self.cfg.sliding_window + 1) // self.page_size

    def resume_pages(self, seq: SeqKV) -> dict[str, list[int]]:
        """The pages another replica needs to continue `seq` (in order, per kind): the SWA
        pages of the last window, every compressed page written so far, the state slots."""
        out = {}
        for kind in self.kinds_for():
            pages = seq.pages[kind]
            if kind == "swa":
                used = -(-seq.num_tokens // self.page_size)
                out[kind] = pages[self.first_live_swa_page(seq.num_tokens):used]
            elif kind in STATE_KINDS:
                out[kind] = list(pages)
            else:
                entries = seq.num_tokens // RATIO_OF_KIND[kind]
                out[kind] = pages[: -(-entries // self.specs[kind].entries_per_page)]
        return out

    def resume_page_counts(self, num_tokens: int) -> dict[str, int]:
        """Page counts of `resume_pages` for a request with `num_tokens` cached tokens."""
        probe = SeqKV(num_tokens=num_tokens)
        for kind, n in self.pages_needed(SeqKV(), num_tokens).items():
            probe.pages[kind] = [0] * n
        return {k: len(v) for k, v in self.resume_pages(probe).items()}

    def adopt(self, num_tokens: int, pages: dict[str, list[int] | tuple[int, ...]]) -> SeqKV:
        """A SeqKV over pages received for a request at `num_tokens` (see `resume_pages`)."""
        seq = SeqKV(num_tokens=num_tokens)
        for kind in self.kinds_for():
            got = list(pages.get(kind, ()))
            seq.pages[kind] = [-1] * self.first_live_swa_page(num_tokens) + got if kind == "swa" else got
        return seq

    # --- typed entry access ---------------------------------------------------------------
    def read_slots(self, kind: str, pages: torch.Tensor) -> torch.Tensor:
        """The single entries of the one-layer, one-entry-a-page state kind `kind` (the MTP slot)
        in `pages` [n] (a device tensor) → float32 [n, dim]: one gather, no host sync (unlike
        `read`), so it can run inside a CUDA graph."""
        return self._slot_view(kind)[pages.long()]

    def write_slots(self, kind: str, pages: torch.Tensor, values: torch.Tensor) -> None:
        """Store float `values` [n, dim] into the entries of `pages` [n] (see `read_slots`)."""
        self._slot_view(kind)[pages.long()] = values.reshape(values.shape[0], -1).float()

    def _slot_view(self, kind: str) -> torch.Tensor:
        spec = self.specs[kind]
        if kind not in STATE_KINDS or len(spec.layers) != 1 or spec.entries_per_page != 1:
            raise ValueError(f"{kind}: slot access is for state kinds of one layer and one entry a page")
        return self.buffers[kind].view(torch.float32)

    def _rows(self, kind: str, layer: int, pages: list[int], idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries idx [n] → (page [n, 1], byte offsets in the page [n, entry_bytes])."""
        spec = self.specs[kind]
        table = torch.tensor(pages, dtype=torch.long, device=idx.device)
        page = table[idx // spec.entries_per_page]
        if bool((page < 0).any()):
            raise RuntimeError(f"{kind}: read of a released page (entries {idx.tolist()[:8]}...)")
        offsets = self._local[kind][layer] * spec.layer_bytes + spec.slab_offsets(idx % spec.entries_per_page)
        return page.unsqueeze(1), offsets

    def write(self, kind: str, layer: int, pages: list[int], idx: torch.Tensor, values: torch.Tensor) -> None:
        """Store entries `idx` [n] of `layer` from float `values` [n, dim], encoding per format."""
        if idx.numel() == 0:
            return
        rows, cols = self._rows(kind, layer, pages, idx)
        self.buffers[kind][rows, cols] = self._encode(kind, values)

    def read(self, kind: str, layer: int, pages: list[int], idx: torch.Tensor) -> torch.Tensor:
        """Load entries `idx` [n] of `layer` → float32 [n, dim]."""
        rows, cols = self._rows(kind, layer, pages, idx)
        return self._decode(kind, self.buffers[kind][rows, cols])

    def _encode(self, kind: str, values: torch.Tensor) -> torch.Tensor:
        fmt = "fp32" if kind in STATE_KINDS else self.format
        if fmt == "fp32":
            return values.float().contiguous().view(torch.uint8)
        if fmt == "bf16":
            return values.to(torch.bfloat16).contiguous().view(torch.uint8)
        if kind == "c4_indexer":
            return low_precision.pack_index_key(values)
        return low_precision.pack_kv(values, self.cfg.qk_rope_head_dim)

    def _decode(self, kind: str, raw: torch.Tensor) -> torch.Tensor:
        fmt = "fp32" if kind in STATE_KINDS else self.format
        if fmt == "fp32":
            return raw.contiguous().view(torch.float32)
        if fmt == "bf16":
            return raw.contiguous().view(torch.bfloat16).float()
        if kind == "c4_indexer":
            return low_precision.unpack_index_key(raw, self.cfg.index_head_dim)
        return low_precision.unpack_kv(raw, self.cfg.head_dim, self.cfg.qk_rope_head_dim)
