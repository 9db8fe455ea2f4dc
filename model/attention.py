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
by prefill, chunked prefill and decode. Steps 1-4 are ops of `model.kernels` (`impl` "torch": the
pure-torch reference, walking the batch's segments; "triton": the GPU kernels).
"""

from __future__ import annotations

import torch
from torch import nn

from model.batch import ForwardBatch
from model.config import ModelConfig
from model.kernels.attention import compressor, indexer, rope as rope_ops, sparse_attention
from model.kernels.common import invariant, rmsnorm
from model.kernels.gemm.fp32_out import linear_fp32_out
from model.kv_pool import KVPools
from model.quantized import Fp8Linear, fuse_fp8_linears, fuse_weights
from model.rope import Rope
from model.side_stream import SideStream, fork, join


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, impl: str = "torch"):
        super().__init__()
        self.eps, self.impl = eps, impl
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm.rms_norm(x, self.weight, self.eps, self.impl)


def linear(dim_in: int, dim_out: int) -> nn.Linear:
    """A float projection (`invariant.Linear`: its rows never depend on the batch on the CPU)."""
    return invariant.Linear(dim_in, dim_out)


# ---------------------------------------------------------------------------------------
# Compressor
# ---------------------------------------------------------------------------------------

class Compressor(nn.Module):
    """Gated pooling of `ratio` tokens into one entry; ratio 4 overlaps the previous window.

    Parameters: wkv, wgate [coff·h, D]; ape [ratio, coff·h]; norm [h] (coff = 2 if overlap).
    Writes entries to pool `kind` and keeps partial windows in ring pool `state_kind`
    (semantics in `model.kernels.attention.compressor`).
    """

    def __init__(self, cfg: ModelConfig, layer: int, ratio: int, head_dim: int, kind: str, state_kind: str,
                 impl: str = "torch"):
        super().__init__()
        self.layer, self.ratio, self.head_dim, self.impl = layer, ratio, head_dim, impl
        self.kind, self.state_kind = kind, state_kind
        coff = 2 if ratio == 4 else 1
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim))
        self.wkv = linear(cfg.hidden_size, coff * head_dim)
        self.wgate = linear(cfg.hidden_size, coff * head_dim)
        self.norm = RMSNorm(head_dim, cfg.rms_norm_eps, impl)
        self.rope = Rope.for_layer(cfg, compressed=True)
        self.deterministic = False  # `kernels.set_deterministic`: `project`'s products at one tile for every T

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] → (wkv | wgate)(x) [T, 2·coff·h] float32. Compression runs in fp32 (the reference
        keeps wkv/wgate in fp32; the checkpoint's bf16 values are exact there, so bf16 weights with
        fp32 accumulation and output lose nothing)."""
        d = self.deterministic
        return torch.cat([linear_fp32_out(x, self.wkv.weight, d), linear_fp32_out(x, self.wgate.weight, d)], dim=-1)

    def forward(self, proj: torch.Tensor, batch: ForwardBatch, pools: KVPools) -> None:
        """proj: `project(x)` [T, 2·coff·h] float32 (rows may be strided: a slice of a fused product)."""
        compressor.compress(proj, batch, pools, self.layer, self.ratio, self.kind, self.state_kind, self.ape,
                            self.norm.weight, self.norm.eps, self.rope, self.impl)


# ---------------------------------------------------------------------------------------
# Lightning indexer
# ---------------------------------------------------------------------------------------

class Indexer(nn.Module):
    """Scores compressed entries per query; returns causal top-k indices (-1 padded).

    Parameters: wq_b [n_I·c, q_lora], weights_proj [n_I, D], compressor (ratio 4, head dim c).
    """

    def __init__(self, cfg: ModelConfig, layer: int, impl: str = "torch"):
        super().__init__()
        self.layer, self.n_heads, self.head_dim, self.topk = layer, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.impl = impl
        self.wq_b = linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = linear(cfg.hidden_size, cfg.index_n_heads)
        self.compressor = Compressor(cfg, layer, 4, cfg.index_head_dim, "c4_indexer", "state_c4_indexer", impl)
        self.rope = Rope.for_layer(cfg, compressed=True)
        # FP8 queries against FP8 keys (`indexer.scoring_query`): set with the W8A8 projections
        # (`quantize_model(..., act_fp8=True)`, `dummy_block`), as the checkpoint's recipe runs them
        self.fp8_query = False
        self.deterministic = False  # `kernels.set_deterministic`: the logits at one tile for every step

    def forward(self, q: torch.Tensor, weights: torch.Tensor, batch: ForwardBatch, pools: KVPools) -> torch.Tensor:
        """The products of the attention's inputs (`Attention.forward` runs them, fused where it can,
        and this indexer's compressor, which must have written the step's entries first):
        q = wq_b(qr) [T, n_I·c], weights = weights_proj(x) [T, n_I] float32.
        → picks [T, K] int32, K = min(index_topk, entries of the batch's longest request)."""
        q = q.view(q.shape[0], self.n_heads, self.head_dim)  # roped by the top-k's logits launch
        return indexer.indexer_topk(q, weights, batch, pools, self.layer, self.topk, self.impl, rope=self.rope,
                                    w_scale=self.n_heads ** -0.5, fp8_query=self.fp8_query,
                                    deterministic=self.deterministic)


# ---------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------

class Attention(nn.Module):
    """Shared-KV MQA with sink; parameter names follow the official checkpoint (`layers.N.attn.*`).

    wq_a [q_lora, D], q_norm [q_lora], wq_b [H·d, q_lora], wkv [d, D], kv_norm [d],
    wo_a [g·o_lora, H·d/g], wo_b [D, g·o_lora], attn_sink [H].
    """

    def __init__(self, cfg: ModelConfig, layer: int, ratio: int, impl: str = "torch"):
        super().__init__()
        self.cfg, self.layer, self.ratio, self.impl = cfg, layer, ratio, impl
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.attn_sink = nn.Parameter(torch.zeros(cfg.num_attention_heads))
        self.wq_a = linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, impl)
        self.wq_b = linear(cfg.q_lora_rank, cfg.num_attention_heads * cfg.head_dim)
        self.wkv = linear(cfg.hidden_size, cfg.head_dim)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, impl)
        group_in = cfg.num_attention_heads * cfg.head_dim // cfg.o_groups
        self.wo_a = linear(group_in, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.rope = Rope.for_layer(cfg, compressed=ratio > 0)
        self.compressor = None
        self.indexer = None
        if ratio:
            kind = "c4" if ratio == 4 else "c128"
            self.compressor = Compressor(cfg, layer, ratio, cfg.head_dim, kind, f"state_{kind}", impl)
        if ratio == 4:
            self.indexer = Indexer(cfg, layer, impl)
        # device format (`fuse_products`): products of one input as one launch
        self.fused_x: Fp8Linear | None = None  # wq_a | wkv
        self.fused_qr: Fp8Linear | None = None  # wq_b | indexer.wq_b
        self.fused_firsts: dict[str, list[int]] = {}  # fused name → each part's first output column
        self.register_buffer("x_products", None, persistent=False)  # the bf16 products of x, stacked
        self.x_widths: list[int] = []  # x_products' output columns per `_bf16_products` entry
        # `kernels.set_deterministic`: every choice the kernels make by the step's size made once
        # for all sizes (the attention's KV splits, the bf16 products' tiles)
        self.deterministic = False

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pools: KVPools, side: SideStream | None = None
                ) -> torch.Tensor:
        """x [T, D] → [T, D]. `side`: the compressors (and the products of x they read) run on it,
        beside the query path, which reads nothing of theirs; joined before the indexer and the
        attention read the entries they write."""
        T, eps = x.shape[0], self.cfg.rms_norm_eps
        if side is not None and self.impl == "triton":
            _ = batch.meta  # built (once per batch) on this stream, before either stream reads it
        with fork(side):
            index_weights = self._compress(x, batch, pools)
        qa, kv = self._products("fused_x", (self.wq_a, self.wkv), x)
        qr = self.q_norm(qa)
        q, index_q = self._products("fused_qr", (self.wq_b, self._index_wq_b()), qr)
        q = rope_ops.q_rms_rope_store_kv(q.view(T, self.n_heads, self.head_dim), kv, batch, pools, self.layer,
                                         self.kv_norm.weight, eps, self.rope, self.impl)
        join(side)
        picks = None
        if self.indexer is not None:
            if side is not None:
                side.keep(index_weights)
            picks = self.indexer(index_q, index_weights, batch, pools)
        out = sparse_attention.attend(q, batch, pools, self.layer, self.ratio, picks, self.attn_sink,
                                      self.cfg.sliding_window, self.rope, self.impl, out_dtype=x.dtype,
                                      deterministic=self.deterministic)
        groups = out.view(T, self.cfg.o_groups, -1)
        return self.wo_b(grouped_linear(groups, self.wo_a, self.deterministic).flatten(1))

    def _compress(self, x: torch.Tensor, batch: ForwardBatch, pools: KVPools) -> torch.Tensor | None:
        """The compressors' step from x [T, D]: their products, then the compressed entries and ring
        state written to the pools; → the indexer's head weights [T, n_I] float32 (None without one)."""
        proj, index_proj, index_weights = self._bf16_products(x)
        if self.compressor is not None:
            self.compressor(proj, batch, pools)
        if self.indexer is not None:
            self.indexer.compressor(index_proj, batch, pools)
        return index_weights

    def fuse_products(self) -> None:
        """Device format (`quantize_model`): products of the same input run as one. A decode step's
        layer then launches three products where it launched up to nine (each launch, and each
        W8A8 input quantisation, costs a few µs at batch 1):

        * `fused_x` = wq_a | wkv and `fused_qr` = wq_b | indexer.wq_b (FP8, one quantisation of
          their input);
        * `x_products` = compressor wkv | wgate | indexer compressor wkv | wgate | weights_proj
          (bf16, fp32 out; weights_proj's output is no longer rounded to bf16).

        The parts' weights become row views of the fused ones: same memory, same state-dict names.
        Fuse on the model's final device: `.to()` afterwards would copy parts and fused tensors
        apart, and the fused products would no longer see loads into the parts."""
        pairs = {"fused_x": (self.wq_a, self.wkv), "fused_qr": (self.wq_b, self._index_wq_b())}
        for name, parts in pairs.items():
            if all(isinstance(p, Fp8Linear) for p in parts):
                fused, self.fused_firsts[name] = fuse_fp8_linears(list(parts))
                setattr(self, name, fused)
        groups = self._bf16_linears()
        parts = [p for group in groups for p in group]
        if len(parts) > 1 and all(p.weight.dtype == torch.bfloat16 for p in parts):
            self.x_products, _ = fuse_weights(parts)
            self.x_widths = [sum(p.weight.shape[0] for p in group) for group in groups]

    def _products(self, name: str, parts: tuple, x: torch.Tensor) -> list[torch.Tensor | None]:
        """[part(x) for part in parts] (None for a missing part), from one product when fused."""
        fused = getattr(self, name)
        if fused is None:
            return [p(x) if p is not None else None for p in parts]
        y = fused(x)
        return [y[:, first:first + p.out_features] for p, first in zip(parts, self.fused_firsts[name])]

    def _index_wq_b(self) -> nn.Module | None:
        return self.indexer.wq_b if self.indexer is not None else None

    def _bf16_linears(self) -> list[list[nn.Linear]]:
        """The bf16 products of x, one group per `_bf16_products` output: compressor wkv | wgate,
        then (CSA) the indexer compressor's wkv | wgate and weights_proj."""
        groups = [[self.compressor.wkv, self.compressor.wgate]] if self.compressor is not None else []
        if self.indexer is not None:
            groups += [[self.indexer.compressor.wkv, self.indexer.compressor.wgate], [self.indexer.weights_proj]]
        return groups

    def _bf16_products(self, x: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """x [T, D] → float32 (compressor.project(x), indexer.compressor.project(x), weights_proj(x)),
        None where the layer has no such module; one GEMM when fused (`x_products`)."""
        if self.x_products is None:
            proj = self.compressor.project(x) if self.compressor is not None else None
            if self.indexer is None:
                return proj, None, None
            return proj, self.indexer.compressor.project(x), self.indexer.weights_proj(x).float()
        out = list(linear_fp32_out(x, self.x_products, self.deterministic).split(self.x_widths, dim=-1))
        return tuple(out + [None] * (3 - len(out)))


def grouped_linear(x: torch.Tensor, proj: nn.Module, deterministic: bool = False) -> torch.Tensor:
    """The grouped low-rank projection: x [T, g, in] by group g's rows of `proj` → [T, g, out];
    `deterministic`: a float `proj` off the CPU by the fixed-tile product, a group at a time (an
    `Fp8Linear` follows its own flag)."""
    g = x.shape[1]
    if isinstance(proj, Fp8Linear):
        return proj.grouped(x)
    w = proj.weight.view(g, -1, x.shape[2])
    if x.device.type != "cpu" and deterministic:
        return torch.stack([invariant.linear(x[:, i], w[i], deterministic=True) for i in range(g)], dim=1)
    if x.device.type != "cpu":
        return torch.einsum("tgi,gri->tgr", x, w)
    return invariant.matmul(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).to(x.dtype)
