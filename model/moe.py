"""DeepSeek-V4 mixture of experts: router (hash or biased top-k), clamped SwiGLU experts, shared expert.

Routing (per token):
* hash layers (the first `num_hash_layers`): experts = `tid2eid[token id]`, a frozen table;
* other layers: experts = top-k of `score + bias`, the bias steering selection only;
weights = the chosen experts' `score` (sqrt(softplus(logit)) by default), normalised to sum 1,
times `routed_scaling_factor`. Output = Σ_k weight_k · expert_k(x) + shared_expert(x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig


def score_fn(name: str, logits: torch.Tensor) -> torch.Tensor:
    if name == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if name == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


class Gate(nn.Module):
    """weight [E, D]; `bias` [E] (score layers) or `tid2eid` [vocab, k] (hash layers)."""

    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        self.cfg, self.hashed = cfg, hashed
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.tid2eid = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int32),
                                        requires_grad=False)
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], input_ids [T] → (weights [T, k] float32, expert ids [T, k] int64)."""
        scores = score_fn(self.cfg.scoring_func, F.linear(x.float(), self.weight.float()))
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = (scores + self.bias.float()).topk(self.cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.cfg.routed_scaling_factor, ids


class Expert(nn.Module):
    """SwiGLU with clamping: w2(silu(min(w1 x, L)) · clamp(w3 x, ±L)); w1, w3 [I, D], w2 [D, I]."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if self.limit > 0:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.gate = Gate(cfg, hashed=cfg.is_hash_layer(layer))
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit) for _ in range(cfg.n_routed_experts))
        self.shared_experts = (Expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)
                               if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [T, D] → [T, D]; the grouped reference path (one GEMM pair per hit expert)."""
        weights, ids = self.gate(x, input_ids)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            y = self.experts[e](x[token]) * weights[token, slot, None].to(x.dtype)
            out.index_add_(0, token, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
