"""DeepSeek-V4 mixture of experts: router (hash or biased top-k), clamped SwiGLU experts, shared expert.

Routing (per token):
* hash layers (the first `num_hash_layers`): experts = `tid2eid[token id]`, a frozen table;
* other layers: experts = top-k of `score + bias`, the bias steering selection only;
weights = the chosen experts' `score` (sqrt(softplus(logit)) by default), normalised to sum 1,
times `routed_scaling_factor`. Output = Σ_k weight_k · expert_k(x) + shared_expert(x).

Expert weights come in two forms:
* float `nn.Linear` experts (`experts.N.w1/w2/w3`, `shared_experts.w1/w2/w3`): what a checkpoint
  loads into, run by the torch path (the CPU default);
* packed (`MoE.pack_experts(fmt)`, or `MoE.random_packed` for benchmarks): routed experts stacked
  in FP4 e2m1 + UE8M0 per 32 or FP8 128×128 blocks, the shared expert in FP8 (`PackedExperts`).
  impl "torch" runs the reference of kernels/moe_grouped.py on them; impl "triton" the fused decode
  path (kernels/moe_fused.py) up to `fused_max_tokens` tokens on score-routed main layers, else
  the grouped path (kernels/moe_grouped.py). Neither Triton path synchronises with the host.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from model import quant
from model.config import ModelConfig
from model.kernels import arrival_counter, check_impl
from model.kernels import fp8_gemm, moe_fused, moe_grouped, moe_prefill, router
from model.kernels.fp4 import FP4_GROUP, FP8_BLOCK, fp4_k_block, shuffle_fp4_words
from model.quantized import linear_fp32_out

FORMATS = ("fp4", "fp8")
MAX_SCALE_BYTE = {"fp4": 128, "fp8": 134}  # UE8M0 bytes the kernels dequantise exactly


class Gate(nn.Module):
    """weight [E, D]; `bias` [E] (score layers) or `tid2eid` [vocab, k] (hash layers)."""

    def __init__(self, cfg: ModelConfig, hashed: bool, impl: str = "torch"):
        super().__init__()
        self.cfg, self.hashed, self.impl = cfg, hashed, impl
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.tid2eid = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int32),
                                        requires_grad=False)
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))
        # `router.gate_route`'s arrival counter, zero between calls (the calls run in stream order)
        self.register_buffer("arrivals", arrival_counter(), persistent=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], input_ids [T] → (weights [T, k] float32, expert ids [T, k] int64); kernels/router.py."""
        c = self.cfg
        args = (None if self.hashed else self.bias, self.tid2eid if self.hashed else None, input_ids,
                c.num_experts_per_tok, c.scoring_func, c.norm_topk_prob, c.routed_scaling_factor)
        if check_impl(self.impl) == "triton" and x.shape[0] <= router.TOKENS_PER_PROGRAM:
            return router.gate_route(x, self.weight, *args, self.arrivals)
        return router.route(linear_fp32_out(x, self.weight), *args, self.impl)


class Expert(nn.Module):
    """SwiGLU with clamping: w2(silu(min(w1 x, L)) · clamp(w3 x, ±L)); w1, w3 [I, D], w2 [D, I]."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return moe_grouped.swiglu(x, self.w1.weight, self.w3.weight, self.w2.weight, self.limit)


class PackedExperts(nn.Module):
    """E experts stacked and quantised; w13 = [w1; w3] (gate rows, then up rows), D = dim, I = inter.

    fmt "fp4", K-blocked: a matrix of R rows × K (codes [R, K/2]: e2m1 pairs, low nibble first;
               scales [R, K/32]: UE8M0 per 32 along K) is stored K block by K block,
               codes [K/2/kb, R, kb] and scales [K/32/sb, R, sb], kb = `fp4_k_block(K/2)` (64 bytes,
               128 K, at V4 shapes), sb = kb/16: element [b, r, j] is byte b·kb + j of row r, the
               codes with the bits of each 4-byte group (rows r, r+8 of a 16-row block × bytes
               2p, 2p+1) permuted as the kernels read them (kernels/fp4.py's `shuffle_fp4_words`).
               w13 uint8 [E, D/2/kb13, 2I, kb13], w13_scale uint8 [E, D/32/sb13, 2I, sb13];
               w2 uint8 [E, I/2/kb2, D, kb2], w2_scale uint8 [E, I/32/sb2, D, sb2].
               Why: a kernel's K step over BN rows is then one contiguous read (BN·64 bytes) instead
               of BN reads of 64 bytes a row apart, which H100 HBM serves at ~65% of copy bandwidth
               against ~94% (benchmarks/fp4_layout_bench.py).
    fmt "fp8": w13 e4m3 [E, 2I, D], w13_scale uint8 [E, 2⌈I/128⌉, ⌈D/128⌉] (w1's blocks, then w3's);
               w2 e4m3 [E, D, I], w2_scale uint8 [E, ⌈D/128⌉, ⌈I/128⌉]
    Scales are UE8M0 bytes (scale = 2^(byte - 127)), as the official checkpoint stores them.
    """

    def __init__(self, fmt: str, n_experts: int, dim: int, inter: int, device: torch.device | str | None = None):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"packed expert format must be one of {FORMATS}, got {fmt!r}")
        if fmt == "fp4" and (dim % FP4_GROUP or inter % FP4_GROUP):
            raise ValueError(f"FP4 experts need hidden ({dim}) and intermediate ({inter}) sizes divisible by 32")
        self.fmt, self.n_experts, self.dim, self.inter = fmt, n_experts, dim, inter
        E, D, I = n_experts, dim, inter
        # code bytes per row in one K block of w13 and w2 (FP4)
        self.kb13, self.kb2 = (fp4_k_block(D // 2), fp4_k_block(I // 2)) if fmt == "fp4" else (0, 0)
        if fmt == "fp4":
            kb13, kb2 = self.kb13, self.kb2
            shapes = [(E, D // 2 // kb13, 2 * I, kb13), (E, D // 2 // kb13, 2 * I, kb13 // 16),
                      (E, I // 2 // kb2, D, kb2), (E, I // 2 // kb2, D, kb2 // 16)]
            dtypes = [torch.uint8] * 4
        else:
            ib, db = math.ceil(I / FP8_BLOCK), math.ceil(D / FP8_BLOCK)
            shapes = [(E, 2 * I, D), (E, 2 * ib, db), (E, D, I), (E, db, ib)]
            dtypes = [torch.float8_e4m3fn, torch.uint8] * 2
        for name, shape, dtype in zip(("w13", "w13_scale", "w2", "w2_scale"), shapes, dtypes):
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
        if fmt == "fp8" and n_experts == 1:  # a shared expert: split-K counters of its dense decode
            # products (kernels/moe_shared.py), left zeroed by every product
            self.register_buffer("arrivals", fp8_gemm.arrival_counters(max(2 * I, D), device), persistent=False)
        # kernels/moe_grouped.py's `_operand_checked` verdicts, per kernel configuration
        self.operand_checks: dict[tuple, bool] = {}

    @classmethod
    @torch.no_grad()
    def from_float(cls, experts: list[Expert], fmt: str) -> "PackedExperts":
        """Quantise float experts with the checkpoint's codecs (w1 and w3 quantised separately)."""
        w = experts[0].w1.weight
        packed = cls(fmt, len(experts), w.shape[1], w.shape[0], w.device)
        for e, ex in enumerate(experts):
            q1, s1 = _quantize(ex.w1.weight, fmt)
            q3, s3 = _quantize(ex.w3.weight, fmt)
            q2, s2 = _quantize(ex.w2.weight, fmt)
            q13, s13 = torch.cat([q1, q3]), torch.cat([s1, s3])
            if fmt == "fp4":
                (q13, s13), (q2, s2) = _k_blocked(q13, s13, packed.kb13), _k_blocked(q2, s2, packed.kb2)
            packed.w13[e], packed.w13_scale[e] = q13, s13
            packed.w2[e], packed.w2_scale[e] = q2, s2
        # the kernels' bf16 dequantisation is exact up to these scales (kernels/fp4.py)
        top, limit = int(max(packed.w13_scale.max(), packed.w2_scale.max())), MAX_SCALE_BYTE[fmt]
        if top > limit:
            raise ValueError(f"{fmt} expert weights need a scale of 2^{top - 127}; the kernels support up to "
                             f"2^{limit - 127} (weights beyond ±{quant.FP4_MAX if fmt == 'fp4' else quant.FP8_MAX:g}"
                             f"·2^{limit - 127})")
        return packed

    @classmethod
    def random(cls, fmt: str, n_experts: int, dim: int, inter: int, device: torch.device | str,
               generator: torch.Generator | None) -> "PackedExperts":
        """Uniformly random codes with scales giving the weights an rms of about 1/sqrt(K) (unit-scale
        outputs for unit-scale inputs), made on `device` directly: no float copy of the experts exists."""
        p = cls(fmt, n_experts, dim, inter, device)
        for w, s, k in ((p.w13, p.w13_scale, dim), (p.w2, p.w2_scale, inter)):
            byte = w.view(torch.uint8)
            byte.random_(0, 256, generator=generator)
            if fmt == "fp8":  # keep sign and mantissa, exponent field 4..10: values ±2^-3..2^3·1.x, never NaN
                byte.copy_((byte & 0x87) | (((byte >> 3) % 7 + 4) << 3))
            exp = math.floor(math.log2(1 / (_code_rms(fmt) * math.sqrt(k))))
            s.random_(127 + exp, 127 + exp + 2, generator=generator)
        return p

    def dequantize(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e → float32 (w1 [I, D], w3 [I, D], w2 [D, I])."""
        I = self.inter
        if self.fmt == "fp4":
            w13 = quant.fp4_dequantize_weight(*_k_unblocked(self.w13[e], self.w13_scale[e]), FP4_GROUP)
            w2 = quant.fp4_dequantize_weight(*_k_unblocked(self.w2[e], self.w2_scale[e]), FP4_GROUP)
            return w13[:I], w13[I:], w2
        ib = math.ceil(I / FP8_BLOCK)
        w1 = quant.fp8_dequantize_weight(self.w13[e, :I], self.w13_scale[e, :ib], FP8_BLOCK)
        w3 = quant.fp8_dequantize_weight(self.w13[e, I:], self.w13_scale[e, ib:], FP8_BLOCK)
        return w1, w3, quant.fp8_dequantize_weight(self.w2[e], self.w2_scale[e], FP8_BLOCK)

    def narrow(self, start: int, length: int) -> "PackedExperts":
        """Experts [start, start + length) as views (an expert-parallel rank's slice)."""
        out = PackedExperts(self.fmt, length, self.dim, self.inter, device="meta")
        for name, buf in self.named_buffers():
            setattr(out, name, buf.narrow(0, start, length))
        return out

    def extra_repr(self) -> str:
        return f"fmt={self.fmt}, n_experts={self.n_experts}, dim={self.dim}, inter={self.inter}"


def _code_rms(fmt: str) -> float:
    """Rms of the values `PackedExperts.random` draws codes from (before scaling)."""
    if fmt == "fp4":
        return math.sqrt(sum(v * v for v in quant.E2M1_VALUES) / 16)
    byte = torch.arange(256, dtype=torch.uint8)
    values = ((byte & 0x87) | (((byte >> 3) % 7 + 4) << 3)).view(torch.float8_e4m3fn).float()
    return float(values.square().mean().sqrt())


def _k_blocked(codes: torch.Tensor, scales: torch.Tensor, kb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 codes [R, K/2] and scales [R, K/32] → `PackedExperts`' K-blocked [K/2/kb, R, kb] (words
    shuffled) and [K/32/sb, R, sb] (sb = kb/16), contiguous."""
    return (shuffle_fp4_words(codes.unflatten(-1, (-1, kb)).transpose(0, 1)),
            scales.unflatten(-1, (-1, kb // 16)).transpose(0, 1).contiguous())


def _k_unblocked(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_k_blocked`'s inverse: → codes [R, K/2], scales [R, K/32]."""
    return (shuffle_fp4_words(codes, inverse=True).transpose(0, 1).flatten(1),
            scales.transpose(0, 1).flatten(1))


def _quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "fp4":
        q, s = quant.fp4_quantize_weight(w, FP4_GROUP)
        return q.view(torch.uint8), s.view(torch.uint8)
    q, s = quant.fp8_quantize_weight(w, FP8_BLOCK)
    return q, s.view(torch.uint8)


def experts_forward(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: nn.ModuleList | PackedExperts, shared: Expert | PackedExperts | None,
                    limit: float, impl: str, fused: bool = False, side: "torch.cuda.Stream | None" = None
                    ) -> torch.Tensor:
    """Σ_k weights · expert_k(x) + shared(x) for x [T, D], weights/ids [T, k] → [T, D] (x.dtype).

    Float experts run the torch path whatever `impl` (the kernels need packed weights); packed ones
    run the reference (impl "torch"), the fused decode path (`fused`), the FP4 prefill path (from
    `moe_prefill.MIN_TOKENS` tokens) or the grouped path, on the decode tiles up to
    `moe_fused.DECODE_MAX_TOKENS` tokens (hash layers and the MTP block decode there). `side`: a
    stream for the dense shared expert at decode sizes (`moe_shared.split_shared`)."""
    if not isinstance(experts, PackedExperts):
        y = moe_grouped.expert_outputs(x, ids, lambda e, rows: experts[e](rows))
        return moe_grouped.combine(y, weights, shared(x) if shared is not None else None)
    if check_impl(impl) == "triton" and fused:
        return moe_fused.fused_moe(x, weights, ids, experts, shared, limit, side=side)
    if impl == "triton" and experts.fmt == "fp4" and x.shape[0] >= moe_prefill.MIN_TOKENS:
        return moe_prefill.prefill_moe(x, weights, ids, experts, shared, limit)
    if x.shape[0] > moe_fused.DECODE_MAX_TOKENS:
        return moe_grouped.grouped_moe(x, weights, ids, experts, shared, limit, impl)
    return moe_grouped.grouped_moe(x, weights, ids, experts, shared, limit, impl,
                                   *moe_fused.decode_tiles(x.shape[0]), side=side)


class MoE(nn.Module):
    # Seed 000's MegaMoE bound is 1024 tokens per rank; past a few hundred tokens the grouped path's
    # larger tiles win, so the fused path stops here (benchmarks/moe_bench.py measures both).
    FUSED_MAX_TOKENS = moe_fused.DECODE_MAX_TOKENS

    def __init__(self, cfg: ModelConfig, layer: int, impl: str = "torch"):
        super().__init__()
        self.cfg, self.layer, self.impl = cfg, layer, check_impl(impl)
        self.gate = Gate(cfg, hashed=cfg.is_hash_layer(layer), impl=impl)
        self.experts: nn.ModuleList | PackedExperts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit) for _ in range(cfg.n_routed_experts))
        self.shared_experts: Expert | PackedExperts | None = (
            Expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit) if cfg.n_shared_experts else None)
        self.fused_max_tokens = self.FUSED_MAX_TOKENS
        self.shared_on_side_stream = True  # see `forward` (off: benchmarks/shared_stream_bench.py's baseline)

    @property
    def packed(self) -> bool:
        return isinstance(self.experts, PackedExperts)

    def pack_experts(self, fmt: str = "fp4") -> "MoE":
        """Routed experts → `fmt` ("fp4" or "fp8"), shared expert → FP8; the float weights are dropped."""
        if self.packed:
            raise ValueError("experts are already packed")
        self.experts = PackedExperts.from_float(list(self.experts), fmt)
        if self.shared_experts is not None:
            self.shared_experts = PackedExperts.from_float([self.shared_experts], "fp8")
        return self

    @classmethod
    def random_packed(cls, cfg: ModelConfig, layer: int, fmt: str = "fp4", impl: str = "torch",
                      device: torch.device | str = "cpu", seed: int = 0, defer_routed: bool = False) -> "MoE":
        """A packed MoE with random weights made on `device` (float experts are never allocated:
        the module is built on the meta device first), e.g. a full-width layer for benchmarks.
        `defer_routed`: the routed experts as shapes only (meta), made later for one rank's slice
        (`dummy_weights.materialize_experts`)."""
        with torch.device("meta"):  # a config without experts: nothing float to build, even on meta
            moe = cls(dataclasses.replace(cfg, n_routed_experts=0, n_shared_experts=0), layer, impl)
        moe.cfg = moe.gate.cfg = cfg
        moe.gate.arrivals = arrival_counter(device)  # a buffer, built on the meta device above
        # (the meta device, for shapes only, has no generator)
        g = None if torch.device(device).type == "meta" else torch.Generator(device=device).manual_seed(seed)
        D, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
        # bf16, as `quantized.quantize_model` leaves a checkpoint's gate
        moe.gate.weight = nn.Parameter((torch.randn(E, D, device=device, generator=g) / math.sqrt(D)).bfloat16())
        if moe.gate.hashed:
            moe.gate.tid2eid = nn.Parameter(torch.randint(0, E, (cfg.vocab_size, cfg.num_experts_per_tok),
                                                          device=device, generator=g, dtype=torch.int32),
                                            requires_grad=False)
        else:
            moe.gate.bias = nn.Parameter(0.1 * torch.randn(E, device=device, generator=g))
        moe.experts = (PackedExperts(fmt, E, D, I, "meta") if defer_routed
                       else PackedExperts.random(fmt, E, D, I, device, g))
        if cfg.n_shared_experts:
            moe.shared_experts = PackedExperts.random("fp8", 1, D, I, device, g)
        return moe

    def uses_fused(self, tokens: int) -> bool:
        """The fused decode path covers score-routed main layers up to `fused_max_tokens` tokens;
        hash layers and the MTP block stay on the grouped path (as seed 000's MegaMoE excludes them)."""
        return (self.impl == "triton" and self.packed and not self.gate.hashed
                and self.layer < self.cfg.num_hidden_layers and tokens <= self.fused_max_tokens)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [T, D] → [T, D]."""
        weights, ids = self.gate(x, input_ids)
        # at decode sizes the dense shared expert runs on a side stream, beside the routed kernels
        # (H100, one V4-Flash layer on the fused path: 0.895 → 0.886 ms at 64 tokens, 1.144 →
        # 1.118 at 128, 1.364 → 1.351 at 256; benchmarks/moe_tiles_bench.py, variants `fused` and
        # `fused_shared_stream_high`). torch hands out streams from per-device pools, one per priority:
        # taking one per call costs no CUDA call, and the high-priority pool is one only the
        # model's side work draws from (kvtransfer's copy streams come from the default one), so
        # no other thread's work can share the stream, or join a graph captured on it
        side = torch.cuda.Stream(x.device, priority=-1) if x.is_cuda and self.shared_on_side_stream else None
        return experts_forward(x, weights, ids, self.experts, self.shared_experts, self.cfg.swiglu_limit,
                               self.impl, self.uses_fused(x.shape[0]), side)
