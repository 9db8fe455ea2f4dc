"""Per-pool checksums of a request's pages, computed on the device that holds them.

checksum(pages) = sum over 32-bit words w at position (p, k) of  w * a_k * b_p   (mod 2^64)

where p is the page's index in the request's ordered page list, k the word index inside the page,
and a_k = (2k+1)*G1, b_p = (2p+1)*G2 are odd (G1, G2 odd constants), so every multiplier is odd
and therefore invertible mod 2^64. Consequences:
- a single changed byte changes w by d*256^j with 0 < |d| < 256, and d*256^j * (odd) is never
  0 mod 2^64: a flipped byte is always detected;
- pages swapped or written to the wrong slot change the sum (multipliers depend on position);
- a truncated (partially written) transfer leaves stale bytes behind and is detected unless the
  stale bytes equal the new ones (then the data is right anyway) or by a 2^-64-ish coincidence.

Two implementations with identical results (two's-complement wraparound is the same everywhere):
- torch ops (index_select, int64 multiply, sum), on CPU or CUDA; pages are processed in chunks
  so temporaries stay bounded (~2-3x the chunk's bytes); runs of consecutive page ids are read in
  place. On a GPU this costs ~15 kernel launches per pool, which dominate small hand-offs;
- one fused Triton kernel per pool (CUDA, page_bytes a multiple of 4, triton importable): reads
  each word once and writes one partial sum per block; used automatically where it applies.
No host copy of the data is made either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

_G1 = -7046029254386353131   # 0x9E3779B97F4A7C15 as signed int64 (odd)
_G2 = -4658895280553007687   # 0xBF58476D1CE4E5B9 as signed int64 (odd)
_CHUNK_WORDS = 1 << 22       # words per chunk: 16 MiB of page data, ~48 MiB of temporaries
_BLOCK = 4096                # words per Triton program

try:                         # optional: the GPU fast path
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs
    triton = None

if triton is not None:
    @triton.jit
    def _checksum_kernel(words_ptr, ids_ptr, partial_ptr, words_per_page, blocks_per_page,
                         g1, g2, BLOCK: tl.constexpr):
        """Program (p, blk): sum of w * a_k * b_p over words [blk*BLOCK, +BLOCK) of page ids[p]."""
        p = tl.program_id(0)
        blk = tl.program_id(1)
        page = tl.load(ids_ptr + p)                                   # int64
        k = blk * BLOCK + tl.arange(0, BLOCK)
        mask = k < words_per_page
        w = tl.load(words_ptr + page * words_per_page + k, mask=mask, other=0)
        a = (k.to(tl.int64) * 2 + 1) * g1
        b = (p.to(tl.int64) * 2 + 1) * g2
        term = w.to(tl.int64) * a * b
        tl.store(partial_ptr + p * blocks_per_page + blk, tl.sum(term, axis=0))


def page_checksum(pool: torch.Tensor, page_ids: Sequence[int]) -> int:
    """Checksum of pool[page_ids[0]], pool[page_ids[1]], ... in that order.

    pool: uint8 tensor [num_pages, page_bytes] on CPU or CUDA. Returns a signed 64-bit int.
    Pages whose size is a multiple of 4 are read as int32 words, others byte by byte.
    """
    return int(page_checksum_tensor(pool, page_ids).item())


def page_checksum_tensor(pool: torch.Tensor, page_ids: Sequence[int]) -> torch.Tensor:
    """As page_checksum, but returns a 0-d int64 tensor on pool.device (no synchronisation)."""
    if triton is not None and pool.is_cuda and pool.shape[1] % 4 == 0 and len(page_ids):
        return _checksum_triton(pool, page_ids)
    return checksum_torch(pool, page_ids)


def _page_index(page_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    ids = [int(i) for i in page_ids]
    if ids == list(range(ids[0], ids[0] + len(ids))):     # a run: no host-to-device copy
        return torch.arange(ids[0], ids[0] + len(ids), dtype=torch.int64, device=device)
    return torch.as_tensor(ids, dtype=torch.int64, device=device)


def _checksum_triton(pool: torch.Tensor, page_ids: Sequence[int]) -> torch.Tensor:
    n = len(page_ids)
    words = pool.view(torch.int32)                                   # [num_pages, W]
    width = words.shape[1]
    blocks = triton.cdiv(width, _BLOCK)
    partial = torch.empty(n * blocks, dtype=torch.int64, device=pool.device)
    with torch.cuda.device(pool.device):
        _checksum_kernel[(n, blocks)](words, _page_index(page_ids, pool.device), partial,
                                      width, blocks, _G1, _G2, BLOCK=_BLOCK, num_warps=8)
    return partial.sum()


def checksum_torch(pool: torch.Tensor, page_ids: Sequence[int],
                   chunk_words: int = _CHUNK_WORDS) -> torch.Tensor:
    """The torch-ops implementation (any device); see the module docstring."""
    dev = pool.device
    acc = torch.zeros((), dtype=torch.int64, device=dev)
    n = len(page_ids)
    if n == 0:
        return acc
    page_bytes = pool.shape[1]
    as_words = page_bytes % 4 == 0
    width = page_bytes // 4 if as_words else page_bytes
    a = (torch.arange(width, dtype=torch.int64, device=dev) * 2 + 1) * _G1       # [W], odd
    b = (torch.arange(n, dtype=torch.int64, device=dev) * 2 + 1) * _G2           # [n], odd
    step = max(1, chunk_words // width)
    ids = list(page_ids)
    for i in range(0, n, step):
        part = ids[i:i + step]
        if part[-1] - part[0] == len(part) - 1 and sorted(part) == part:
            rows = pool[part[0]:part[-1] + 1]                 # consecutive ids: a view, no copy
        else:
            rows = pool.index_select(0, _page_index(part, dev))   # [c, page_bytes]
        w = (rows.view(torch.int32) if as_words else rows).to(torch.int64)     # [c, W]
        w.mul_(a).mul_(b[i:i + step, None])   # in place: one temporary per chunk
        acc += w.sum()
    return acc


def range_checksum_tensor(pool: torch.Tensor, page_ids: Sequence[int], first_index: int = 0,
                          byte_range: tuple[int, int] | None = None) -> torch.Tensor:
    """The terms of page_checksum that lie in `byte_range` (offset, length) of every page, for
    pages page_ids[i] at position first_index + i of the request's page list: a 0-d int64 tensor
    on pool.device, computed there with torch ops (no synchronisation, no host copy).

    page_checksum is a sum over (position, word), so the checksum of a request's pages is the sum
    of these over any ranges and runs that cover each (page, word) once: a sender can checksum
    each layer's slice as the layer is computed and add them up at the end. On pages read as
    int32 words the range must be word-aligned (ValueError otherwise)."""
    page_bytes = pool.shape[1]
    off, length = (0, page_bytes) if byte_range is None else byte_range
    if off < 0 or length < 0 or off + length > page_bytes:
        raise ValueError(f"byte range ({off}, {length}) outside a page of {page_bytes} bytes")
    dev = pool.device
    if not len(page_ids) or not length:
        return torch.zeros((), dtype=torch.int64, device=dev)
    as_words = page_bytes % 4 == 0
    if as_words and (off % 4 or length % 4):
        raise ValueError(f"byte range ({off}, {length}) not word-aligned on pages read as 32-bit words")
    unit = 4 if as_words else 1
    k0, width = off // unit, length // unit
    rows = pool.index_select(0, _page_index(page_ids, dev))[:, off:off + length]       # [n, length]
    w = (rows.contiguous().view(torch.int32) if as_words else rows).to(torch.int64)     # [n, width]
    a = ((torch.arange(width, dtype=torch.int64, device=dev) + k0) * 2 + 1) * _G1
    b = ((torch.arange(len(page_ids), dtype=torch.int64, device=dev) + first_index) * 2 + 1) * _G2
    return w.mul_(a).mul_(b[:, None]).sum()


def pool_checksums(pools: Mapping[str, torch.Tensor], pages: Mapping[str, Sequence[int]],
                   given: Mapping[str, torch.Tensor] | None = None) -> dict[str, int]:
    """Checksum per kind of `pages[kind]` in `pools[kind]`, or `given[kind]` where the caller
    computed it already (a 0-d int64 tensor, e.g. summed from range_checksum_tensor); one device
    sync at the end."""
    given = given or {}
    partial = {k: given[k] if k in given else page_checksum_tensor(pools[k], ids) for k, ids in pages.items()}
    if not partial:
        return {}
    first = next(iter(partial.values()))
    values = torch.stack([v.to(first.device) for v in partial.values()]).tolist()
    return {k: int(v) for k, v in zip(partial, values)}
