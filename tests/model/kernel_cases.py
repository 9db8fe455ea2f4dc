"""Shared builders for kernel parity tests: random pools holding random requests.

`random_batch` makes a batch of segments (prefill chunks at any start and decodes) over fresh
pools whose every page is filled with random entries of the pool's encoding, so kernels are never
checked against zeros. Used by the interpreter tests here and the GPU tests in tests/gpu/.
"""

from __future__ import annotations

import torch

from model import low_precision
from model.batch import ForwardBatch
from model.config import ModelConfig
from model.kv_pool import STATE_KINDS, KVPools, SeqKV


def fill_random(pools: KVPools, seed: int) -> None:
    """Every entry of every pool := a valid random encoding (values ~N(0,1), state rows too)."""
    g = torch.Generator().manual_seed(seed)
    for kind, spec in pools.specs.items():
        if not spec.layers:
            continue
        n = spec.num_pages * len(spec.layers) * spec.entries_per_page
        if kind in STATE_KINDS:
            width = spec.entry_bytes // 4
        elif kind == "c4_indexer":
            width = pools.cfg.index_head_dim
        else:
            width = pools.cfg.head_dim
        values = torch.randn(n, width, generator=g).to(pools.buffers[kind].device)
        raw = pools._encode(kind, values) if kind not in STATE_KINDS else values.view(torch.uint8)
        pools.buffers[kind][:, spec.page_order(raw.device)] = raw.reshape(spec.num_pages, -1)


def random_batch(cfg: ModelConfig, pools: KVPools, shapes: list[tuple[int, int]], seed: int,
                 device: str | torch.device = "cpu") -> ForwardBatch:
    """One segment per (cached tokens, new tokens) in `shapes`, pages reserved in `pools`."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for cached, new in shapes:
        seq = SeqKV()
        pools.reserve(seq, cached + new)
        seq.num_tokens = cached
        tokens = torch.randint(0, cfg.vocab_size, (new,), generator=g).tolist()
        items.append((seq, tokens))
    return ForwardBatch.build(items, device=device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()  # module outputs may carry autograd state
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def unpack_all(pools: KVPools, kind: str) -> torch.Tensor:
    """Decoded view of a whole pool (for comparing two pools' contents)."""
    spec = pools.specs[kind]
    raw = pools.buffers[kind].cpu()[:, spec.page_order()].reshape(-1, spec.entry_bytes)
    if kind in STATE_KINDS or pools.format == "fp32":
        return raw.contiguous().view(torch.float32)
    if pools.format == "bf16":
        return raw.contiguous().view(torch.bfloat16).float()
    if kind == "c4_indexer":
        return low_precision.unpack_index_key(raw, pools.cfg.index_head_dim)
    return low_precision.unpack_kv(raw, pools.cfg.head_dim, pools.cfg.qk_rope_head_dim)


def block_weights(rows: int, K: int, g: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """Random weights whose 128×128 blocks differ in magnitude by powers of two (2^-3..2^3), so every
    block has its own UE8M0 scale: a product that takes a neighbour's scale is off by a power of 2."""
    blocks = (-(-rows // 128), -(-K // 128))
    mag = torch.exp2(torch.randint(-3, 4, blocks, generator=g, device=device).float())
    mag = mag.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :K]
    return torch.randn(rows, K, generator=g, device=device) * mag


def random_picks(batch: ForwardBatch, k: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """[T, k] int32: distinct random causal compressed entries per query (as the indexer gives them),
    -1 padded where a query has fewer than k."""
    g = torch.Generator(device=device).manual_seed(seed)
    n = (batch.positions + 1) // 4
    scores = torch.rand(n.shape[0], int(n.max()), device=device, generator=g)
    scores = scores.masked_fill(torch.arange(scores.shape[1], device=device)[None, :] >= n[:, None], -1.0)
    values, idx = scores.topk(k, dim=-1)
    return torch.where(values < 0, -1, idx).int()


def mhc_inputs(T: int, device: str = "cpu", hc: int = 4, D: int = 4096):
    """Random V4-Flash mHC operands: (x [T, hc, D] bf16, fn [24, hc·D], base [24], scale [3])."""
    g = torch.Generator(device=device).manual_seed(T)
    x = torch.randn(T, hc, D, device=device, generator=g).bfloat16()
    fn = torch.randn((2 + hc) * hc, hc * D, device=device, generator=g) / 128
    base = 0.5 * torch.randn((2 + hc) * hc, device=device, generator=g)
    scale = 0.5 + torch.rand(3, device=device, generator=g)
    return x, fn, base, scale


def captured(fn):
    """fn() captured in a CUDA graph after a warm-up call on a side stream → (the graph, what fn
    returned during the capture: the tensors each replay rewrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
