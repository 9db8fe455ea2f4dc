"""DeepSeek-V4 transformer: embedding → N × Block (mHC-wrapped attention and MoE) → hc_head → norm → head.

The residual stream is `hc_mult` parallel streams [T, hc, D] (manifold-constrained
hyper-connections). Around each sub-block, `hc_pre` collapses the streams with weights `pre`
(σ + eps) and `hc_post` expands the output with `post` (2σ) and mixes the old streams with
`comb`, a Sinkhorn-projected doubly-stochastic matrix: new = post ⊗ out + combᵀ · streams
(definitions and kernels in `model.kernels.mhc.mhc`).

Parameter names mirror the official checkpoint (`embed`, `layers.N.attn_norm`, `hc_attn_fn`,
`hc_head_fn`, `head`, `mtp.0.e_proj`, ...), so loading it is a name-for-name copy.
"""

from __future__ import annotations

import torch
from torch import nn

from model import low_precision
from model.attention import Attention, RMSNorm
from model.batch import BatchMeta, ForwardBatch
from model.config import ModelConfig
from model.kernels import arrival_counter, set_deterministic, set_impl
from model.kernels.common.invariant import Linear
from model.kernels.mhc import mhc
from model.kv_pool import KVPools, SeqKV
from model.moe import MoE
from model.quantized import Fp8Linear
from model.side_stream import SideStream, SideStreams


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ratio: int, impl: str = "torch"):
        super().__init__()
        self.cfg, self.impl = cfg, impl
        mix = (2 + cfg.hc_mult) * cfg.hc_mult
        self.attn = Attention(cfg, layer, ratio, impl)
        self.ffn = MoE(cfg, layer, impl)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, impl)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, impl)
        self.hc_attn_fn = nn.Parameter(torch.zeros(mix, cfg.hc_mult * cfg.hidden_size))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix))
        self.hc_attn_scale = nn.Parameter(torch.ones(3))
        self.hc_ffn_fn = nn.Parameter(torch.zeros(mix, cfg.hc_mult * cfg.hidden_size))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3))
        # the one-launch mHC entry's arrival counter, zero between calls (the calls run in stream order),
        # and the full mixes its post / comb kernel reads on a side stream (`mhc.EntryScratch`)
        self.register_buffer("hc_arrivals", arrival_counter(), persistent=False)
        self.register_buffer("hc_mixes", mhc.mixes_buffer(), persistent=False)
        self.side_stream = True  # see `forward` (off: all in order, tests' and benchmarks' baseline)
        self.deterministic = False  # `kernels.set_deterministic`: the mHC entries on one path for every T

    def forward(self, res: mhc.Residual, batch: ForwardBatch, pools: KVPools,
                streams: SideStreams | None = None) -> mhc.Residual:
        """Streams [T, hc, D] in, streams out, each sub-block's hc_post left pending for the next
        entry's kernel to apply (`mhc.Residual`). With `streams` (the model's, on a GPU) the blocks'
        side stream takes an entry's post and comb (`mhc.EntryScratch`: joined before the next entry
        reads them) and the attention's compressors (joined inside it), and the other the MoE's
        shared expert; without, everything runs in order."""
        side = SideStream(streams.device, streams.block) if streams is not None and self.side_stream else None
        scratch = mhc.EntryScratch(self.hc_mixes, side)
        x, h, post, comb = self._enter(res, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.attn_norm,
                                       scratch)
        res = mhc.Residual(x, self.attn(h, batch, pools, side), post, comb)
        scratch.join()
        x, h, post, comb = self._enter(res, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.ffn_norm,
                                       scratch)
        res = mhc.Residual(x, self.ffn(h, batch.input_ids, streams.shared if streams is not None else None),
                           post, comb)
        scratch.join()
        return res

    def _enter(self, res, fn, base, scale, norm: RMSNorm, scratch: "mhc.EntryScratch"):
        c = self.cfg
        return mhc.sublayer_input(res, fn, base, scale, norm.weight, norm.eps, c.hc_mult, c.hc_sinkhorn_iters,
                                  c.hc_eps, c.rms_norm_eps, self.impl, self.hc_arrivals, scratch=scratch,
                                  deterministic=self.deterministic)

    def head(self, res: mhc.Residual, fn, base, scale, norm: RMSNorm) -> torch.Tensor:
        """The LM head's input norm(hc_head(streams)) [T, D]."""
        return mhc.head_input(res, fn, base, scale, norm.weight, norm.eps, self.cfg.hc_eps, self.cfg.rms_norm_eps,
                              self.impl, self.hc_arrivals, self.deterministic)


class MTPBlock(Block):
    """Multi-token prediction: fuses the main model's streams at t with the embedding of token
    t+1 and predicts token t+2 through one more block and its own hc_head / norm."""

    def __init__(self, cfg: ModelConfig, impl: str = "torch"):
        super().__init__(cfg, cfg.num_hidden_layers, cfg.mtp_compress_ratio, impl)
        D = cfg.hidden_size
        self.e_proj = Linear(D, D)
        self.h_proj = Linear(D, D)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, impl)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, impl)
        self.norm = RMSNorm(D, cfg.rms_norm_eps, impl)
        self.hc_head_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * D))
        self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.hc_head_scale = nn.Parameter(torch.ones(1))


def query_row_width(cfg: ModelConfig) -> int:
    """Columns a token of the attention's fused query product (wq_b | the indexer's wq_b, `Attention
    .fused_qr`) spans: the query [T, heads, head_dim] is a strided view of it, which the kernels
    address row by row (64 × 512 + 64 × 128 = 40960 at V4 shapes)."""
    return cfg.num_attention_heads * cfg.head_dim + cfg.index_n_heads * cfg.index_head_dim


def kernel_step_limit(cfg: ModelConfig) -> int:
    """The most tokens in one step of the Triton kernels: they address a step's tensors with 32-bit
    element offsets, and the widest per token is the fused query product (`query_row_width`; 52428
    tokens at V4 shapes). Past it an offset wraps and a kernel reads or writes out of bounds."""
    return (2**31 - 1) // query_row_width(cfg)


class Transformer(nn.Module):
    """The whole model. `forward` runs one mixed prefill/decode batch over the pools.

    `impl` picks the kernels of `model.kernels` ("torch" reference or "triton"); the GPU path
    also wants the device weight format (`model.quantized.quantize_model`). `deterministic`
    (`kernels.set_deterministic`, again after `quantize_model`): the kernels' batch-invariant
    configurations, so a row's logits do not depend on the step it runs in; the torch reference
    is batch-invariant either way."""

    def __init__(self, cfg: ModelConfig, with_mtp: bool = False, impl: str = "torch", deterministic: bool = False):
        super().__init__()
        self.cfg, self.impl = cfg, impl
        self.deterministic = deterministic
        D = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, D)
        self.layers = nn.ModuleList(Block(cfg, i, r, impl) for i, r in enumerate(cfg.compress_ratios))
        self.norm = RMSNorm(D, cfg.rms_norm_eps, impl)
        self.head = Linear(D, cfg.vocab_size)
        self.hc_head_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * D))
        self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.register_buffer("hc_arrivals", arrival_counter(), persistent=False)
        self.mtp = nn.ModuleList([MTPBlock(cfg, impl)]) if with_mtp and cfg.num_nextn_predict_layers else nn.ModuleList()
        self.draft_head: Fp8Linear | None = None  # `quantize_draft_head`
        set_impl(self, impl)  # norms and other leaf modules take the model's kernels too
        set_deterministic(self, deterministic)
        self._side_streams: SideStreams | None = None  # `side_streams`

    def side_streams(self, device: torch.device) -> SideStreams | None:
        """The side streams every layer and step on `device` shares (`SideStreams`), taken at the
        first step there; None off the GPU."""
        if device.type != "cuda":
            return None
        if self._side_streams is None or self._side_streams.device != device:
            self._side_streams = SideStreams(device)
        return self._side_streams

    def max_step_tokens(self) -> int | None:
        """The most tokens one `forward` may carry (`kernel_step_limit`), None for no limit: the torch
        reference has none."""
        return kernel_step_limit(self.cfg) if self.impl == "triton" else None

    def check_step_tokens(self, tokens: int, what: str) -> None:
        """Refuse a step size the kernels cannot address (`max_step_tokens`), naming `what` set it."""
        limit = self.max_step_tokens()
        if limit is not None and tokens > limit:
            raise ValueError(f"{what} = {tokens} tokens in one step is more than the Triton kernels address with "
                             f"32-bit offsets ({limit} tokens: {query_row_width(self.cfg)} query columns each); "
                             "chunk the prefill into smaller steps")

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, pools: KVPools, all_logits: bool = False,
                return_streams: bool = False, logit_rows: torch.Tensor | None = None):
        """Logits [num_segments, vocab] of each segment's last token ([T, vocab] with `all_logits`,
        [len(logit_rows), vocab] for the token rows `logit_rows`).

        Writes the batch's KV into `pools`; the caller then calls `batch.commit()`. When the model
        has its MTP block and the pools hold its layer, the step also runs the MTP block over the
        positions the new tokens complete (`extend_mtp`), so its KV keeps up with the main layers'.
        With `return_streams` also returns the final residual streams [T, hc, D] (the MTP input).
        """
        self.check_step_tokens(batch.input_ids.shape[0], "the batch")
        x = self.embed(batch.input_ids)
        res = mhc.Residual(x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous())
        streams = self.side_streams(x.device)
        for layer in self.layers:
            res = layer(res, batch, pools, streams)
        extend = bool(self.mtp) and pools.with_mtp
        # the head reads `res` as it would without the MTP block: its logits do not depend on it
        streams = mhc.settle(res, self.impl) if return_streams or extend else None
        if extend:
            self.extend_mtp(streams, batch, pools)
        if logit_rows is None:
            logit_rows = slice(None) if all_logits else batch.last_rows
        c = self.cfg
        h = mhc.head_input(res.rows(logit_rows), self.hc_head_fn, self.hc_head_base, self.hc_head_scale,
                           self.norm.weight, self.norm.eps, c.hc_eps, c.rms_norm_eps, self.impl, self.hc_arrivals,
                           self.deterministic)
        logits = self.head(h).float()
        return (logits, streams) if return_streams else logits

    def extend_mtp(self, streams: torch.Tensor, batch: ForwardBatch, pools: KVPools) -> None:
        """MTP position t pairs the main streams at t with token t+1, so a segment of tokens at
        [s, e) completes MTP positions [s-1, e-1): the first pairs the streams at s-1, kept in the
        request's `state_mtp` slot since the step before, with token s. The slot then takes the
        streams at e-1. Only the MTP block's KV is wanted here, not its logits.

        A batch without host segments is a CUDA graph's static one (`model.cuda_graph`): rows of
        equal length, each past its first token, extended from the device meta alone."""
        if not batch.segments:
            return self._extend_mtp_rows(streams, batch, pools)
        segs = batch.segments
        slots = torch.tensor([seg.seq.pages["state_mtp"][0] for seg in segs], device=streams.device)
        prev = pools.read_slots("state_mtp", slots).view(len(segs), *streams.shape[1:]).to(streams.dtype)
        items, inputs = [], []
        for i, seg in enumerate(segs):
            rows = streams[seg.rows]
            ids = list(batch.host_ids[seg.rows]) if batch.host_ids else batch.input_ids[seg.rows].tolist()
            if seg.start > 0:
                inputs.append(torch.cat([prev[i:i + 1], rows[:-1]]))
                items.append((SeqKV(seg.seq.pages, seg.start - 1), ids))
            elif seg.length > 1:
                inputs.append(rows[:-1])
                items.append((SeqKV(seg.seq.pages, 0), ids[1:]))
        last = torch.tensor([seg.offset + seg.length - 1 for seg in segs], device=streams.device)
        pools.write_slots("state_mtp", slots, streams[last])
        if items:
            self.mtp_step(torch.cat(inputs), ForwardBatch.build(items, device=streams.device), pools, logits=False)

    def _extend_mtp_rows(self, streams: torch.Tensor, batch: ForwardBatch, pools: KVPools) -> None:
        """`extend_mtp` for a graph's B rows of L tokens, all on the device: the MTP segment of a
        row is its tokens at its positions - 1, beside [its slot, its streams but the last]. A
        padding row (the scratch request at position 0) is clamped to position 0: its writes land
        in the scratch's pages and nothing reads them."""
        meta = batch.meta
        B = meta.seg_start.shape[0]
        x = streams.view(B, -1, *streams.shape[1:])
        slots = meta.tables["state_mtp"][:, 0]
        prev = pools.read_slots("state_mtp", slots).view(B, 1, *streams.shape[1:]).to(streams.dtype)
        pools.write_slots("state_mtp", slots, x[:, -1])
        shifted = ForwardBatch(batch.input_ids, (batch.positions - 1).clamp(min=0), ())
        shifted.__dict__["meta"] = BatchMeta(meta.token_seq, (meta.positions - 1).clamp(min=0),
                                             (meta.seg_start - 1).clamp(min=0), (meta.seg_end - 1).clamp(min=1),
                                             meta.tables, meta.max_end)
        self.mtp_step(torch.cat([prev, x[:, :-1]], dim=1).flatten(0, 1), shifted, pools, logits=False)

    @torch.no_grad()
    def quantize_draft_head(self) -> None:
        """Draft through an FP8 copy of the head (128×128 block scales, `Fp8Linear`): each draft
        reads half the head's bytes, which are most of what a draft reads at batch 1. A draft is a
        proposal the verify checks with the exact head, so this moves how often drafts are
        accepted, never a token; `mtp_step(exact=True)` keeps the exact head."""
        q, scale = low_precision.fp8_quantize_weight(self.head.weight.float())
        self.draft_head = Fp8Linear(q, scale, self.impl, persistent=False)

    @torch.no_grad()
    def mtp_step(self, streams: torch.Tensor, batch: ForwardBatch, pools: KVPools, logits: bool = True,
                 rows: torch.Tensor | None = None, exact: bool = False):
        """The MTP block over `batch` (its tokens are those at t+1, its positions t) beside the
        streams at t [T, hc, D]: writes its KV into `pools` (the caller commits) and returns
        (draft logits [rows, vocab] for position t+2 of each segment's last token (`rows`: these
        token rows), the block's output streams [T, hc, D], which stand in for the main streams
        when drafts are chained), or nothing with `logits=False`. The logits come from the draft
        head when there is one (`quantize_draft_head`), unless `exact`."""
        mtp = self.mtp[0]
        e = mtp.enorm(self.embed(batch.input_ids))
        x = mtp.e_proj(e).unsqueeze(1) + mtp.h_proj(mtp.hnorm(streams))
        res = mtp(mhc.Residual(x), batch, pools, self.side_streams(x.device))
        if not logits:
            return None
        res = mhc.Residual(mhc.settle(res, self.impl))
        picked = res.rows(batch.last_rows if rows is None else rows)
        h = mtp.head(picked, mtp.hc_head_fn, mtp.hc_head_base, mtp.hc_head_scale, mtp.norm)
        head = self.head if exact or self.draft_head is None else self.draft_head
        return head(h).float(), res.x

    @torch.no_grad()
    def forward_mtp(self, streams: torch.Tensor, batch: ForwardBatch, pools: KVPools) -> torch.Tensor:
        """Draft logits [T, vocab] for position t+2 from the main streams at t [T, hc, D] and the
        batch's tokens (which must be the tokens at t+1)."""
        logits, _ = self.mtp_step(streams, batch, pools, rows=torch.arange(batch.input_ids.shape[0]), exact=True)
        return logits
