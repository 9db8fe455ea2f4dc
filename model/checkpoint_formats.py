"""Tensor-level rules of the two DeepSeek-V4 checkpoint formats (no I/O here).

* **official** (the DeepSeek hub layout): our parameter names as they are (`embed.weight`,
  `layers.3.attn.wq_a.weight`, `layers.1.ffn.experts.5.w1.weight`, `mtp.0.e_proj.weight`, ...).
  Storage per tensor group:

  - FP8 e4m3 + UE8M0 128×128 block scales in `<name minus .weight>.scale`: `attn.wq_a/wq_b/wkv/
    wo_a/wo_b`, `attn.indexer.wq_b`, `ffn.shared_experts.w1/w2/w3`, MTP `e_proj/h_proj`;
  - FP4 e2m1, two per int8 byte (low nibble first, K halved) + UE8M0 scales per 32 along K in
    `.scale`: routed experts `ffn.experts.E.w1/w2/w3`;
  - BF16: `embed`, `head`, `ffn.gate.weight`, compressor `wkv/wgate`, `indexer.weights_proj`;
  - FP32: norms, `ape`, `attn_sink`, `hc_*`, `ffn.gate.bias`; int32: `ffn.gate.tid2eid`.

* **hf**: what `DeepseekV4ForCausalLM.save_pretrained` writes in transformers 5.23. It reverts
  transformers' load-time renames, which is not the identity on the official names: everything
  gets a `model.` prefix except `head.weight`; `embed.weight` → `model.embed_tokens.weight`;
  `hc_head_{fn,base,scale}` → `model.hc_head.hc_{fn,base,scale}`; the attention's
  `attn.kv_norm.weight` → `attn.norm.weight`. Experts stay one tensor per expert, all tensors
  in the model dtype (`tid2eid` int64), no MTP. The runtime names
  (`save_pretrained(save_original_format=False)`: `self_attn.q_a_proj`, stacked
  `mlp.experts.gate_up_proj` [E, 2I, D] / `down_proj` [E, D, I]) are read as well.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from model import low_precision
from model.hf_names import official_to_hf_name

FP8_BLOCK = 128
FP4_BLOCK = 32

_PREFIX = r"^(?:layers\.\d+|mtp\.\d+)\."
_FP8 = re.compile(_PREFIX + r"(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b"
                  r"|ffn\.shared_experts\.w[123]|e_proj|h_proj)\.weight$")
_FP4 = re.compile(_PREFIX + r"ffn\.experts\.\d+\.w[123]\.weight$")
_BF16 = re.compile(r"^(?:embed|head)\.weight$|" + _PREFIX +
                   r"(?:ffn\.gate\.weight|attn\.(?:indexer\.)?compressor\.(?:wkv|wgate)\.weight"
                   r"|attn\.indexer\.weights_proj\.weight)$")
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")

QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "activation_scheme": "dynamic",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    "expert_dtype": "fp4",
}


def official_storage(name: str) -> str:
    """How the official format stores `name`: 'fp8', 'fp4', 'bf16', 'fp32' or 'int32'."""
    if name.endswith("tid2eid"):
        return "int32"
    if _FP8.match(name):
        return "fp8"
    if _FP4.match(name):
        return "fp4"
    if _BF16.match(name):
        return "bf16"
    return "fp32"


def scale_name(weight_name: str) -> str:
    """`layers.0.attn.wq_a.weight` → `layers.0.attn.wq_a.scale`."""
    return weight_name.removesuffix(".weight") + ".scale"


def encode_official(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One official-named float tensor → the stored tensor(s) (weight and maybe its scale)."""
    kind = official_storage(name)
    if kind == "fp8":
        q, s = low_precision.fp8_quantize_weight(tensor, FP8_BLOCK)
        return {name: q, scale_name(name): s}
    if kind == "fp4":
        q, s = low_precision.fp4_quantize_weight(tensor, FP4_BLOCK)
        return {name: q, scale_name(name): s}
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "int32": torch.int32}[kind]
    return {name: tensor.to(dtype).contiguous()}


def hf_saved_name(name: str) -> str | None:
    """Official name → the name `save_pretrained` writes. It writes no MTP block: a transformers-
    format checkpoint that has one keeps it beside those under the official names (`mtp.0.*`)."""
    if name.startswith("mtp."):
        return name
    if name == "head.weight":
        return name
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name.startswith("hc_head_"):
        return "model.hc_head.hc_" + name.removeprefix("hc_head_")
    m = re.fullmatch(r"layers\.(\d+)\.attn\.kv_norm\.weight", name)
    if m:
        return f"model.layers.{m.group(1)}.attn.norm.weight"
    return "model." + name


def encode_hf(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> tuple[str, torch.Tensor] | None:
    saved = hf_saved_name(name)
    if saved is None:
        return None
    return saved, (tensor.long() if name.endswith("tid2eid") else tensor.to(dtype)).contiguous()


# ---------------------------------------------------------------------------------------
# reading: where each of the model's tensors comes from
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """One model tensor in the checkpoint: stored `key` (a slice of it for stacked experts)
    and, for quantized weights, the key of its block scales."""

    key: str
    index: tuple | None = None  # (expert, row slice) into a stacked [E, ...] tensor
    scale_key: str | None = None


def split_scales(keys: set[str]) -> tuple[dict[str, str], set[str]]:
    """Separate block-scale tensors: returns ({weight key: scale key}, remaining keys).

    `X.scale` (official) and `X.weight_scale_inv` (transformers) are scales of `X.weight` when
    that tensor exists; otherwise they are ordinary tensors (e.g. HF runtime `attn_hc.scale`).
    """
    scales: dict[str, str] = {}
    for key in keys:
        for suffix in (".scale", ".weight_scale_inv"):
            if key.endswith(suffix):
                weight = key[: -len(suffix)] + ".weight"
                if weight in keys:
                    scales[weight] = key
    return scales, keys - set(scales.values())


def detect_format(keys: set[str]) -> str:
    """'official' or 'hf' from the tensor names."""
    if any(k.startswith(("model.", "lm_head.")) for k in keys):
        return "hf"
    if any(k.startswith(("layers.", "embed.", "mtp.")) for k in keys):
        return "official"
    sample = ", ".join(sorted(keys)[:3]) or "none"
    raise ValueError(f"tensor names match neither the official nor the transformers format (e.g. {sample})")


def hf_key_table(expected: list[str]) -> dict[str, str]:
    """{HF key (saved and runtime style) → official name} for the non-stacked tensors."""
    table: dict[str, str] = {}
    for name in expected:
        for key in (hf_saved_name(name), None if _EXPERT.match(name) else official_to_hf_name(name)):
            if key is not None:
                table[key] = name
    return table


def plan_sources(fmt: str, keys: set[str], expected: list[str], n_experts: int
                 ) -> tuple[dict[str, Source], list[str], list[tuple[str, str]]]:
    """Map checkpoint keys onto the model's official names.

    Returns (sources for the names found, unknown keys, duplicates as (name, key) pairs).
    Names of `expected` absent from the result are missing from the checkpoint.
    """
    scales, plain = split_scales(keys)
    wanted = set(expected)
    sources: dict[str, Source] = {}
    unknown: list[str] = []
    dups: list[tuple[str, str]] = []

    def add(name: str, src: Source) -> None:
        if name in sources:
            dups.append((name, src.key))
        else:
            sources[name] = src

    table = hf_key_table(expected) if fmt == "hf" else {}
    for key in sorted(plain):
        if fmt == "official":
            name = key if key in wanted else None
        else:
            name = table.get(key)
            m = _STACKED.match(key)
            if name is None and m is not None:
                layer, which = m.groups()
                ws = ("w2",) if which == "down_proj" else ("w1", "w3")
                names = [f"layers.{layer}.ffn.experts.{e}.{w}.weight" for e in range(n_experts) for w in ws]
                if all(n in wanted for n in names):
                    for e in range(n_experts):
                        for half, w in enumerate(ws):
                            add(f"layers.{layer}.ffn.experts.{e}.{w}.weight",
                                Source(key, (e, half if which == "gate_up_proj" else None)))
                    continue
        if name is None:
            unknown.append(key)
        else:
            add(name, Source(key, None, scales.get(key)))
    return sources, unknown, dups


def stored_shape(expected: torch.Size | tuple[int, ...], dtype: torch.dtype, has_scale: bool,
                 block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Shape the stored tensor (and its scale) must have to decode to `expected`."""
    shape = tuple(expected)
    if not has_scale:
        return shape, None
    if dtype in (torch.int8, torch.uint8):  # FP4 packed along K, scales per 32 along K
        return shape[:-1] + (shape[-1] // 2,), shape[:-1] + (shape[-1] // FP4_BLOCK,)
    return shape, (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def decode(tensor: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
           ) -> torch.Tensor:
    """Stored tensor (+ scale) → float32 (ints stay ints)."""
    if scale is None:
        return tensor if not tensor.is_floating_point() else tensor.float()
    if tensor.dtype in (torch.int8, torch.uint8):
        return low_precision.fp4_dequantize_weight(tensor, scale, FP4_BLOCK)
    if block[0] != block[1]:
        raise ValueError(f"non-square FP8 weight blocks {block} are not supported")
    return low_precision.fp8_dequantize_weight(tensor, scale, block[0])


def shard_order(expected: list[str], sources: dict[str, Source], files: dict[str, Path]
                 ) -> tuple[list[str], dict[Path, int]]:
    """The model's tensors in the order of their shards (one shard finished before the next is
    begun; a tensor whose scale is in a later shard, with the later), and how many reads each
    shard gets."""
    rank = {path: i for i, path in enumerate(sorted(set(files.values())))}
    reads: dict[Path, int] = {}
    last = {}
    for name in expected:
        src = sources[name]
        keys = (src.key, src.scale_key) if src.scale_key else (src.key,)
        for key in keys:
            reads[files[key]] = reads.get(files[key], 0) + 1
        last[name] = max(rank[files[key]] for key in keys)
    return sorted(expected, key=last.__getitem__), reads

