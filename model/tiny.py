"""A tiny random DeepSeek-V4 for tests, CI and `v4serve make-tiny`.

Every layer kind is present: ratios 0, 4 and 128, hash and score-routed MoE layers, hc_mult 4,
a small sliding window, YaRN on compressed layers. Weights are random but deterministic in the
seed and scaled so activations stay O(1) through all layers (so the oracle comparison is
meaningful, not a comparison of saturated or vanishing values).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from model.config import ModelConfig

TINY_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "vocab_size": 320,  # 256 bytes + special tokens of the byte tokenizer
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "compress_ratios": [0, 4, 128, 4, 128, 0],  # last entry: the MTP block
    "num_hash_layers": 2,
    "sliding_window": 16,
    "index_n_heads": 2,
    "index_head_dim": 64,
    "index_topk": 64,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                     "beta_fast": 32, "beta_slow": 1},
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 256,
    "eos_token_id": 257,
}


def tiny_config(**overrides: Any) -> ModelConfig:
    return ModelConfig.from_dict({**TINY_CONFIG, **overrides})


def flash_config(num_layers: int = 43, **overrides: Any) -> ModelConfig:
    """DeepSeek-V4-Flash's shapes (hidden 4096, 64 heads × 512, 256 experts top-6, ...) with the
    first `num_layers` of its layer pattern: 2 window-only, then ratio 4 and 128 alternating
    (43 layers: 2 + 21 + 20). For kernel tests and benchmarks with random weights."""
    ratios = ([0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)])[:num_layers]
    return ModelConfig.from_dict({**TINY_CONFIG, **FLASH_SHAPES, "num_hidden_layers": num_layers,
                                  "compress_ratios": ratios + [0], **overrides})


FLASH_SHAPES: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 4096, "num_attention_heads": 64, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1,
    "num_hash_layers": 3, "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "bos_token_id": 0, "eos_token_id": 1,
}


def random_weights(shapes: dict[str, torch.Size], cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random tensors (float32; int32 for `tid2eid`) for the given official names."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        leaf = name.rsplit(".", 1)[-1] if "." in name else name
        if leaf == "tid2eid":
            out[name] = torch.randint(0, cfg.n_routed_experts, shape, generator=g, dtype=torch.int32)
        elif leaf == "weight" and len(shape) == 1:  # RMSNorm gains
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(("hc_attn_scale", "hc_ffn_scale", "hc_head_scale")):
            out[name] = 0.5 + torch.rand(shape, generator=g)
        elif name.endswith(("_fn",)):
            out[name] = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        elif name.endswith(("_base", "attn_sink", "ape", "gate.bias")):
            out[name] = 0.5 * torch.randn(shape, generator=g)
        elif leaf == "weight" and name.startswith("embed"):
            out[name] = torch.randn(shape, generator=g)
        else:  # projections: unit-variance outputs for unit-variance inputs
            out[name] = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    return out


def random_model(cfg: ModelConfig, with_mtp: bool = False, seed: int = 0):
    """A `Transformer` of `cfg` (with its MTP block if asked) holding `random_weights(seed)`."""
    from model.transformer import Transformer  # the model imports the kernels; the config helpers need none

    m = Transformer(cfg, with_mtp=with_mtp)
    m.load_state_dict(random_weights({k: v.shape for k, v in m.state_dict().items()}, cfg, seed))
    return m
