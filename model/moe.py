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
  impl "torch" runs the reference of kernels/moe/moe_grouped.py on them; impl "triton" the fused decode
  path (kernels/moe/moe_fused.py) up to `fused_max_tokens` tokens on score-routed main layers, else
  the grouped path (kernels/moe/moe_grouped.py). Neither Triton path synchronises with the host.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from model.config import ModelConfig
from model.kernels import arrival_counter, check_impl
from model.kernels.gemm.fp32_out import linear_fp32_out
from model.kernels.moe import moe_fused, moe_gate, moe_grouped, moe_prefill
from model.kernels.moe.packed_experts import PackedExperts


class Gate(nn.Module):
    """weight [E, D]; `bias` [E] (score layers) or `tid2eid` [vocab, k] (hash layers)."""

    def __init__(self, cfg: ModelConfig, hashed: bool, impl: str = "torch"):
        super().__init__()
        self.cfg, self.hashed, self.impl = cfg, hashed, impl
        self.deterministic = False  # `kernels.set_deterministic`: the logits by the fixed-tile product at every T
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.tid2eid = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int32),
                                        requires_grad=False)
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))
        # `moe_gate.gate_route`'s arrival counter, zero between calls (the calls run in stream order)
        self.register_buffer("arrivals", arrival_counter(), persistent=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], input_ids [T] → (weights [T, k] float32, expert ids [T, k] int64); kernels/moe/moe_gate.py."""
        c = self.cfg
        args = (None if self.hashed else self.bias, self.tid2eid if self.hashed else None, input_ids,
                c.num_experts_per_tok, c.scoring_func, c.norm_topk_prob, c.routed_scaling_factor)
        if check_impl(self.impl) == "triton" and x.shape[0] <= moe_gate.TOKENS_PER_PROGRAM and not self.deterministic:
            return moe_gate.gate_route(x, self.weight, *args, self.arrivals)
        return moe_gate.route(linear_fp32_out(x, self.weight, self.deterministic), *args, self.impl)


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


def experts_forward(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: nn.ModuleList | PackedExperts, shared: Expert | PackedExperts | None,
                    limit: float, impl: str, fused: bool = False, side: "torch.cuda.Stream | None" = None,
                    deterministic: bool = False) -> torch.Tensor:
    """Σ_k weights · expert_k(x) + shared(x) for x [T, D], weights/ids [T, k] → [T, D] (x.dtype).

    Float experts run the torch path whatever `impl` (the kernels need packed weights); packed ones
    run the reference (impl "torch"), the fused decode path (`fused`), the FP4 prefill path (from
    `moe_prefill.MIN_TOKENS` tokens) or the grouped path, on the decode tiles up to
    `moe_fused.DECODE_MAX_TOKENS` tokens (hash layers decode there). `side`: a
    stream for the dense shared expert at decode sizes (`moe_shared.split_shared`). `deterministic`:
    packed experts on the kernels take the fused path's tiles of one K order at every size
    (`moe_fused.deterministic_moe`)."""
    if not isinstance(experts, PackedExperts):
        y = moe_grouped.expert_outputs(x, ids, lambda e, rows: experts[e](rows))
        return moe_grouped.combine(y, weights, shared(x) if shared is not None else None)
    if check_impl(impl) == "triton" and deterministic:
        return moe_fused.deterministic_moe(x, weights, ids, experts, shared, limit, side)
    if impl == "triton" and fused:
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
        self.shared_on_side_stream = True  # see `forward` (off: benchmarks/research/shared_stream_bench.py's baseline)
        self.deterministic = False  # `kernels.set_deterministic` (`experts_forward`)

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
        """The fused decode path covers score-routed layers up to `fused_max_tokens` tokens, the MTP
        block's too (a speculative step drafts through it at decode sizes); hash layers stay on the
        grouped path (as seed 000's MegaMoE excludes them)."""
        return (self.impl == "triton" and self.packed and not self.gate.hashed
                and tokens <= self.fused_max_tokens)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, side: torch.cuda.Stream | None = None) -> torch.Tensor:
        """x [T, D] → [T, D]. `side`: the stream for the dense shared expert at decode sizes,
        beside the routed kernels, where it is faster (docs/results.md, fused MoE): the model's
        `SideStreams.shared`."""
        weights, ids = self.gate(x, input_ids)
        side = side if self.shared_on_side_stream else None
        return experts_forward(x, weights, ids, self.experts, self.shared_experts, self.cfg.swiglu_limit,
                               self.impl, self.uses_fused(x.shape[0]), side, self.deterministic)
