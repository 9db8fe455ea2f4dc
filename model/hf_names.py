"""Official ↔ transformers parameter names of DeepSeek-V4.

Our modules use the official checkpoint names (`layers.3.attn.wq_a.weight`). transformers'
`DeepseekV4ForCausalLM` uses its own (`model.layers.3.self_attn.q_a_proj.weight`) and stores
routed experts stacked: `mlp.experts.gate_up_proj` [E, 2I, D] = cat(w1, w3) per expert and
`mlp.experts.down_proj` [E, D, I]. The MTP block (`mtp.*`) has no transformers counterpart.
"""

from __future__ import annotations

import re

import torch

# (official regex, transformers template) — applied to names without the `model.` prefix.
_LEAF_RULES = [
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^norm\.weight$", "norm.weight"),
    (r"^hc_head_fn$", "hc_head.hc_fn"),
    (r"^hc_head_base$", "hc_head.hc_base"),
    (r"^hc_head_scale$", "hc_head.hc_scale"),
]
_LAYER_RULES = [
    (r"attn_norm\.weight", "input_layernorm.weight"),
    (r"ffn_norm\.weight", "post_attention_layernorm.weight"),
    (r"hc_(attn|ffn)_(fn|base|scale)", r"\1_hc.\2"),
    (r"attn\.attn_sink", "self_attn.sinks"),
    (r"attn\.wq_a\.weight", "self_attn.q_a_proj.weight"),
    (r"attn\.q_norm\.weight", "self_attn.q_a_norm.weight"),
    (r"attn\.wq_b\.weight", "self_attn.q_b_proj.weight"),
    (r"attn\.wkv\.weight", "self_attn.kv_proj.weight"),
    (r"attn\.kv_norm\.weight", "self_attn.kv_norm.weight"),
    (r"attn\.wo_a\.weight", "self_attn.o_a_proj.weight"),
    (r"attn\.wo_b\.weight", "self_attn.o_b_proj.weight"),
    (r"attn\.indexer\.wq_b\.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    (r"attn\.indexer\.weights_proj\.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    (r"attn\.indexer\.compressor\.(\w+)(\.weight)?", r"self_attn.compressor.indexer.{\1}\2"),
    (r"attn\.compressor\.(\w+)(\.weight)?", r"self_attn.compressor.{\1}\2"),
    (r"ffn\.gate\.weight", "mlp.gate.weight"),
    (r"ffn\.gate\.bias", "mlp.gate.e_score_correction_bias"),
    (r"ffn\.gate\.tid2eid", "mlp.gate.tid2eid"),
    (r"ffn\.shared_experts\.w1\.weight", "mlp.shared_experts.gate_proj.weight"),
    (r"ffn\.shared_experts\.w2\.weight", "mlp.shared_experts.down_proj.weight"),
    (r"ffn\.shared_experts\.w3\.weight", "mlp.shared_experts.up_proj.weight"),
]
_COMPRESSOR_LEAVES = {"wkv": "kv_proj", "wgate": "gate_proj", "ape": "position_bias", "norm": "kv_norm"}
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


def official_to_hf_name(name: str) -> str | None:
    """HF runtime name of a non-expert official tensor; None for names HF does not have (mtp)."""
    if name == "head.weight":
        return "lm_head.weight"
    for pattern, target in _LEAF_RULES:
        if re.match(pattern, name):
            return "model." + target
    m = re.match(r"^layers\.(\d+)\.(.+)$", name)
    if not m:
        return None
    layer, rest = m.groups()
    for pattern, target in _LAYER_RULES:
        hit = re.fullmatch(pattern, rest)
        if hit:
            out = hit.expand(target)
            for leaf, hf_leaf in _COMPRESSOR_LEAVES.items():
                out = out.replace("{" + leaf + "}", hf_leaf)
            return f"model.layers.{layer}.{out}"
    return None


def to_hf_state_dict(official: dict[str, torch.Tensor], n_experts: int) -> dict[str, torch.Tensor]:
    """Official-named tensors → transformers runtime state dict (experts stacked)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], list[torch.Tensor | None]] = {}
    for name, tensor in official.items():
        m = _EXPERT.match(name)
        if m:
            layer, e, w = int(m.group(1)), int(m.group(2)), m.group(3)
            experts.setdefault((layer, w), [None] * n_experts)[e] = tensor
            continue
        hf = official_to_hf_name(name)
        if hf is not None:
            out[hf] = tensor.long() if name.endswith("tid2eid") else tensor
    for layer in sorted({k[0] for k in experts}):
        w1, w2, w3 = (torch.stack(experts[(layer, w)]) for w in ("w1", "w2", "w3"))
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = w2
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], official_names: list[str]) -> dict[str, torch.Tensor]:
    """transformers runtime state dict → official-named tensors for `official_names`."""
    out: dict[str, torch.Tensor] = {}
    for name in official_names:
        m = _EXPERT.match(name)
        if m:
            layer, e, w = int(m.group(1)), int(m.group(2)), m.group(3)
            if w == "w2":
                out[name] = hf[f"model.layers.{layer}.mlp.experts.down_proj"][e]
            else:
                gate_up = hf[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e]
                half = gate_up.shape[0] // 2
                out[name] = gate_up[:half] if w == "w1" else gate_up[half:]
            continue
        hf_name = official_to_hf_name(name)
        if hf_name is not None and hf_name in hf:
            out[name] = hf[hf_name]
    return out
