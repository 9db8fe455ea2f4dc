"""Full-width DeepSeek-V4-Flash layers with random device-format weights, and pools holding
decode requests at a given context, for the GPU benchmarks (decode_step_bench, kernel_bench,
pd_gpu_slice). Importable; not a benchmark itself.

Weights are made directly on the GPU in the device format (`model.dummy_weights.dummy_block`: FP8
projections, FP4 routed experts, FP8 shared expert), never as floats: a layer is ~3.5 GB that way. Pools are
filled with one page of valid random entries tiled over every page (the kernels' memory traffic
does not depend on the values, and it avoids encoding tens of GB).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from model.batch import ForwardBatch
from model.config import ModelConfig
from model.dummy_weights import dummy_block
from model.kernels.mhc import mhc
from model.kv_pool import STATE_KINDS, KVPools, SeqKV
from model.side_stream import SideStreams
from model.tiny import flash_config
from model.transformer import Block


def layer_bytes(cfg: ModelConfig, layer: int) -> int:
    """Device-format bytes of one block (weights + scales), by building it on the meta device."""
    block = dummy_block(cfg, layer, "triton", "meta")
    return sum(t.numel() * t.element_size() for t in list(block.parameters()) + list(block.buffers()))


class LayerStack(nn.Module):
    """Blocks run on random input streams; forward returns the final streams [T, hc, D] (it stands
    in for the model in `DecodeGraph`, which only slices the output)."""

    def __init__(self, cfg: ModelConfig, blocks: list[Block], device):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(blocks)
        g = torch.Generator(device=device).manual_seed(7)
        self.table = torch.randn(1024, cfg.hc_mult, cfg.hidden_size, device=device, generator=g).bfloat16()
        self.streams = SideStreams.on(device)  # as the model's (`Transformer.side_streams`)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, pools: KVPools, all_logits: bool = True,
                return_streams: bool = False) -> torch.Tensor:
        if return_streams:  # a verify graph's (logits, streams): the stack has no head
            raise ValueError("LayerStack has no LM head: it stands in for one-token decode graphs only")
        res = mhc.Residual(self.table[batch.input_ids % self.table.shape[0]])
        for block in self.blocks:
            res = block(res, batch, pools, self.streams)
        return mhc.settle(res, self.blocks[-1].impl)


def stack(num_layers: int, device: str = "cuda", impl: str = "triton", first_layer: int = 0,
          act_fp8: bool = False, fuse: bool = True) -> LayerStack:
    cfg = flash_config(43)
    blocks = [dummy_block(cfg, i, impl, device, seed=i, act_fp8=act_fp8, fuse=fuse)
              for i in range(first_layer, first_layer + num_layers)]
    return LayerStack(cfg, blocks, device)


def layers_that_fit(free_bytes: int, reserve_bytes: int, first_layer: int = 0) -> int:
    """How many consecutive V4-Flash layers from `first_layer` fit in `free_bytes - reserve_bytes`."""
    cfg = flash_config(43)
    budget, n = free_bytes - reserve_bytes, 0
    while first_layer + n < 43:
        need = layer_bytes(cfg, first_layer + n)
        if need > budget:
            break
        budget -= need
        n += 1
    return n


def decode_pools(cfg: ModelConfig, num_layers: int, batch: int, context: int, device: str = "cuda",
                 fmt: str = "fp8_pack", steps: int = 1) -> tuple[KVPools, list[SeqKV]]:
    """Pools of the first `num_layers` layers for `batch` requests each holding `context` tokens
    (random valid entries), sized for `steps` more tokens, plus room for one more such request (a
    CUDA graph's scratch row); SWA keeps only the live window."""
    sub = dataclasses.replace(cfg, num_hidden_layers=num_layers, compress_ratios=cfg.compress_ratios[:num_layers])
    total = context + steps
    probe = KVPools(sub, fmt, max_tokens=total, max_seqs=1, device="meta")
    if probe.first_live_swa_page(total) != probe.first_live_swa_page(context + 1):
        raise ValueError(f"context {context} + {steps} steps crosses an SWA page the window still needs")
    need = probe.resume_page_counts(total)
    pools = KVPools(sub, fmt, max_tokens=total, max_seqs=batch + 1, device=device,
                    swa_pages=batch * need["swa"] + -(-(total + 1) // 256))  # the scratch is not trimmed
    _tile_random(pools)
    seqs = []
    for _ in range(batch):
        pages = {k: pools.alloc(k, n) for k, n in need.items()}
        seq = pools.adopt(total, pages)
        seq.num_tokens = context
        seqs.append(seq)
    return pools, seqs


def _tile_random(pools: KVPools, seed: int = 0) -> None:
    g = torch.Generator(device=pools.device).manual_seed(seed)
    for kind, spec in pools.specs.items():
        if not spec.layers or spec.num_pages == 0:
            continue
        n = len(spec.layers) * spec.entries_per_page
        if kind in STATE_KINDS:
            page = torch.randn(n, spec.entry_bytes // 4, device=pools.device, generator=g).view(torch.uint8)
        else:
            width = pools.cfg.index_head_dim if kind == "c4_indexer" else pools.cfg.head_dim
            entries = pools._encode(kind, torch.randn(n, width, device=pools.device, generator=g)).reshape(-1)
            page = torch.empty_like(entries)
            page[spec.page_order(pools.device)] = entries
        pools.buffers[kind].copy_(page.reshape(1, -1).expand(spec.num_pages, -1))


def decode_batch(seqs: list[SeqKV], device: str = "cuda", seed: int = 0) -> ForwardBatch:
    g = torch.Generator().manual_seed(seed)
    return ForwardBatch.build([(s, [int(torch.randint(0, 1024, (1,), generator=g))]) for s in seqs], device=device)


def decode_batches(seqs: list[SeqKV], steps: int, device: str = "cuda") -> list[ForwardBatch]:
    """`steps` consecutive decode batches of `seqs` (positions num_tokens, num_tokens + 1, ...), as a
    serving loop feeds a decode graph; the requests' token counts are left as they were (pools
    from `decode_pools(..., steps=steps)` hold the pages)."""
    start = [s.num_tokens for s in seqs]
    out = []
    for i in range(steps):
        out.append(decode_batch(seqs, device, seed=i))
        out[-1].commit()
    for s, n in zip(seqs, start):
        s.num_tokens = n
    return out


def roofline_bytes(cfg: ModelConfig, layer: int, block: Block, batch: int, context: int, experts_hit: int) -> dict:
    """Fewest bytes a decode step of one layer must move: the weights it uses and the KV it reads."""
    # the state dict: each weight once (a fused product's weight is its parts' rows, not counted again)
    dense = sum(t.numel() * t.element_size() for n, t in block.state_dict().items() if not n.startswith("ffn.experts."))
    per_expert = sum(t.numel() * t.element_size() for t in block.ffn.experts.buffers()) / cfg.n_routed_experts
    ratio, entry = cfg.compress_ratios[layer], 584
    kv = cfg.sliding_window * entry
    if ratio == 4:
        kv += min(cfg.index_topk, context // 4) * entry + (context // 4) * 132  # picks + indexer scan
    elif ratio == 128:
        kv += (context // 128) * entry
    act = batch * cfg.hc_mult * cfg.hidden_size * 2 * 4  # streams in/out, twice per layer (bf16)
    return {"weights": dense + experts_hit * per_expert, "kv": batch * kv, "activations": act}


