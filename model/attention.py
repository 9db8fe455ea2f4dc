"""DeepSeek-V4 attention over paged pools: sliding window + CSA (ratio 4) / HCA (ratio 128).

Reference path in pure torch. Per layer, for a batch of segments (see `model.batch`):

1. q = wq_b(q_norm(wq_a(x))), per-head RMS rescale, RoPE on the trailing r dims;
   kv = kv_norm(wkv(x)) with RoPE, written to the SWA pool (K = V, one shared head).
2. Compressor (ratio > 0): raw projections (kv, score) of every token go to the request's
   compress-state ring; each completed window of `ratio` tokens (ratio 4: plus the previous
   window's overlap half) is softmax(score + ape)-pooled, normed, roped at its first position and
   written as one compressed entry.
3. Indexer (ratio 4): its own compressor fills the indexer pool; query heads score entries
   with Σ_h w_h·relu(q_h·k)/sqrt(c) and each query keeps its causal top-k (-1 = none).
4. Attention of each query over its window (last `sliding_window` tokens) plus the visible
   compressed entries (HCA: all complete windows; CSA: the indexer's picks), with a per-head
   learned sink logit in the softmax; the output's rope dims are de-rotated at the query
   position; grouped low-rank output projection (wo_a per group, then wo_b).

Every K/V read comes back from the pool, so the storage format's rounding is seen identically
by prefill, chunked prefill and decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.batch import ForwardBatch, Segment
from model.config import ModelConfig
from model.kv_pool import KVPools
from model.rope import Rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight.float() * xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def linear(dim_in: int, dim_out: int) -> nn.Linear:
    return nn.Linear(dim_in, dim_out, bias=False)


# ---------------------------------------------------------------------------------------
# Compressor
# ---------------------------------------------------------------------------------------

class Compressor(nn.Module):
    """Gated pooling of `ratio` tokens into one entry; ratio 4 overlaps the previous window.

    Parameters: wkv, wgate [coff·h, D]; ape [ratio, coff·h]; norm [h] (coff = 2 if overlap).
    Writes entries to pool `kind` and keeps partial windows in ring pool `state_kind`.
    """

    def __init__(self, cfg: ModelConfig, layer: int, ratio: int, head_dim: int, kind: str, state_kind: str):
        super().__init__()
        self.layer, self.ratio, self.head_dim = layer, ratio, head_dim
        self.kind, self.state_kind = kind, state_kind
        self.overlap = ratio == 4
        coff = 2 if self.overlap else 1
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim))
        self.wkv = linear(cfg.hidden_size, coff * head_dim)
        self.wgate = linear(cfg.hidden_size, coff * head_dim)
        self.norm = RMSNorm(head_dim, cfg.rms_norm_eps)
        self.rope = Rope.for_layer(cfg, compressed=True)
        self.ring = 2 * ratio if self.overlap else ratio

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pools: KVPools) -> None:
        xf = x.float()  # compression runs in fp32 (the reference keeps wkv/wgate in fp32)
        proj = torch.cat([self.wkv(xf), self.wgate(xf)], dim=-1)  # [T, 2·coff·h]
        for seg in batch.segments:
            self._segment(seg, proj[seg.rows], pools)

    def _segment(self, seg: Segment, proj: torch.Tensor, pools: KVPools) -> None:
        r, h, s, e = self.ratio, self.head_dim, seg.start, seg.end
        slot = seg.seq.pages[self.state_kind]
        n0, n1 = s // r, e // r  # entries complete before / after this segment
        if n1 > n0:
            lo = max(0, n0 * r - (r if self.overlap else 0))
            history = pools.read(self.state_kind, self.layer, slot, torch.arange(lo, s) % self.ring)
            rows = torch.cat([history, proj[: n1 * r - s]])  # tokens [lo, n1·r)
            width = rows.shape[1] // 2
            kv, score = rows[:, :width], rows[:, width:] + self.ape[torch.arange(lo, n1 * r) % r]
            windows = torch.arange(n0, n1).unsqueeze(1) * r + torch.arange(r) - lo  # [n, r] row ids
            if self.overlap:
                prev, first = windows - r, n0 == 0
                kv = torch.cat([kv[prev.clamp_min(0), :h], kv[windows, h:]], dim=1)
                score = torch.cat([score[prev.clamp_min(0), :h], score[windows, h:]], dim=1)
                if first:  # window 0 has no predecessor: zero value, zero weight
                    kv[0, :r], score[0, :r] = 0.0, float("-inf")
            else:
                kv, score = kv[windows], score[windows]
            pooled = (kv * score.softmax(dim=1)).sum(dim=1)  # [n, h]
            entries = self.rope.apply(self.norm(pooled), torch.arange(n0, n1) * r)
            pools.write(self.kind, self.layer, seg.seq.pages[self.kind], torch.arange(n0, n1), entries)
        keep = min(self.ring, seg.length)  # ring rows written after the read above
        pools.write(self.state_kind, self.layer, slot, torch.arange(e - keep, e) % self.ring, proj[-keep:])


# ---------------------------------------------------------------------------------------
# Lightning indexer
# ---------------------------------------------------------------------------------------

class Indexer(nn.Module):
    """Scores compressed entries per query; returns causal top-k indices (-1 padded).

    Parameters: wq_b [n_I·c, q_lora], weights_proj [n_I, D], compressor (ratio 4, head dim c).
    """

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.n_heads, self.head_dim, self.topk = layer, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = linear(cfg.hidden_size, cfg.index_n_heads)
        self.compressor = Compressor(cfg, layer, 4, cfg.index_head_dim, "c4_indexer", "state_c4_indexer")
        self.rope = Rope.for_layer(cfg, compressed=True)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, batch: ForwardBatch, pools: KVPools) -> list[torch.Tensor]:
        self.compressor(x, batch, pools)
        q = self.wq_b(qr).view(x.shape[0], self.n_heads, self.head_dim)
        q = self.rope.apply(q, batch.positions).float()
        w = self.weights_proj(x).float() * self.n_heads ** -0.5  # [T, n_I]
        picks = []
        for seg in batch.segments:
            n = seg.end // 4
            keys = pools.read("c4_indexer", self.layer, seg.seq.pages["c4_indexer"], torch.arange(n))
            scores = torch.einsum("shc,tc->sht", q[seg.rows], keys).relu() * self.head_dim ** -0.5
            scores = (scores * w[seg.rows].unsqueeze(-1)).sum(dim=1)  # [S, n]
            picks.append(self.select(scores, batch.positions[seg.rows]))
        return picks

    def select(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """scores [S, n] of queries at `positions` [S] → top-k entry ids [S, min(k, n)], -1 where
        a query has fewer than k causal entries (entry j is causal for p iff j < (p+1)/4)."""
        visible = (positions + 1) // 4
        future = torch.arange(scores.shape[1]) >= visible.unsqueeze(1)
        top = scores.masked_fill(future, float("-inf")).topk(min(self.topk, scores.shape[1]), dim=-1).indices
        return torch.where(top >= visible.unsqueeze(1), -1, top)


# ---------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------

class Attention(nn.Module):
    """Shared-KV MQA with sink; parameter names follow the official checkpoint (`layers.N.attn.*`).

    wq_a [q_lora, D], q_norm [q_lora], wq_b [H·d, q_lora], wkv [d, D], kv_norm [d],
    wo_a [g·o_lora, H·d/g], wo_b [D, g·o_lora], attn_sink [H].
    """

    def __init__(self, cfg: ModelConfig, layer: int, ratio: int):
        super().__init__()
        self.cfg, self.layer, self.ratio = cfg, layer, ratio
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.attn_sink = nn.Parameter(torch.zeros(cfg.num_attention_heads))
        self.wq_a = linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = linear(cfg.q_lora_rank, cfg.num_attention_heads * cfg.head_dim)
        self.wkv = linear(cfg.hidden_size, cfg.head_dim)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        group_in = cfg.num_attention_heads * cfg.head_dim // cfg.o_groups
        self.wo_a = linear(group_in, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.rope = Rope.for_layer(cfg, compressed=ratio > 0)
        self.compressor = None
        self.indexer = None
        if ratio:
            kind = "c4" if ratio == 4 else "c128"
            self.compressor = Compressor(cfg, layer, ratio, cfg.head_dim, kind, f"state_{kind}")
        if ratio == 4:
            self.indexer = Indexer(cfg, layer)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pools: KVPools) -> torch.Tensor:
        """x [T, D] → [T, D]."""
        T, pos = x.shape[0], batch.positions
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(T, self.n_heads, self.head_dim)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.cfg.rms_norm_eps).to(q.dtype)
        q = self.rope.apply(q, pos)
        kv = self.rope.apply(self.kv_norm(self.wkv(x)), pos)
        for seg in batch.segments:
            pools.write("swa", self.layer, seg.seq.pages["swa"], pos[seg.rows], kv[seg.rows])
        if self.compressor is not None:
            self.compressor(x, batch, pools)
        picks = self.indexer(x, qr, batch, pools) if self.indexer is not None else None
        out = torch.empty(T, self.n_heads, self.head_dim, dtype=torch.float32)
        for i, seg in enumerate(batch.segments):
            out[seg.rows] = self._attend(q[seg.rows], pos[seg.rows], seg, pools, picks[i] if picks else None)
        out = self.rope.apply(out, pos, inverse=True).to(x.dtype)
        groups = out.view(T, self.cfg.o_groups, -1)
        wo_a = self.wo_a.weight.view(self.cfg.o_groups, self.cfg.o_lora_rank, -1)
        return self.wo_b(torch.einsum("tgi,gri->tgr", groups, wo_a).flatten(1))

    def _attend(self, q: torch.Tensor, qpos: torch.Tensor, seg: Segment, pools: KVPools,
                picks: torch.Tensor | None) -> torch.Tensor:
        """q [S, H, d] of one segment → [S, H, d] over its window and compressed entries."""
        window = self.cfg.sliding_window
        kpos = torch.arange(max(0, seg.start - window + 1), seg.end)
        keys = pools.read("swa", self.layer, seg.seq.pages["swa"], kpos)
        visible = (kpos <= qpos.unsqueeze(1)) & (kpos > qpos.unsqueeze(1) - window)  # [S, Lw]
        if self.ratio:
            n = seg.end // self.ratio
            kind = self.compressor.kind
            keys = torch.cat([keys, pools.read(kind, self.layer, seg.seq.pages[kind], torch.arange(n))])
            if picks is None:  # HCA: every complete window at or before the query
                comp_visible = torch.arange(n) < ((qpos + 1) // self.ratio).unsqueeze(1)
            else:  # CSA: the indexer's picks (-1 = no pick)
                comp_visible = torch.zeros(q.shape[0], n + 1, dtype=torch.bool)
                comp_visible.scatter_(1, torch.where(picks < 0, n, picks), True)
                comp_visible = comp_visible[:, :n]
            visible = torch.cat([visible, comp_visible], dim=1)
        logits = torch.einsum("shd,ld->hsl", q.float(), keys) * self.head_dim ** -0.5
        logits = logits.masked_fill(~visible.unsqueeze(0), float("-inf"))
        sink = self.attn_sink.float().view(-1, 1, 1).expand(-1, q.shape[0], 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("hsl,ld->shd", probs, keys)
