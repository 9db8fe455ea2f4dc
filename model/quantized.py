"""The model in its device format: FP8 dense projections, packed experts, bf16 activations (the
projections' inputs FP8 too where the checkpoint declares dynamic activation scaling: W8A8).

The checkpoint's dense projections are FP8 e4m3 with UE8M0 scales per 128×128 block
(`model.checkpoint_formats`); on a GPU they stay in that form and multiply through
`model.kernels.gemm.fp8_gemm` (half the bytes of bf16, which is what decode is bound by). The CPU
reference model instead holds every weight as a float `nn.Linear`.

`quantize_model` turns a loaded float model into the device format in place:

| parameters | device format |
|---|---|
| `attn.wq_a/wq_b/wkv/wo_a/wo_b`, `attn.indexer.wq_b`, MTP `e_proj/h_proj` | `Fp8Linear` |
| routed and shared experts | `MoE.pack_experts(expert_format)` (FP4 or FP8 routed, FP8 shared) |
| compressor `wkv/wgate` | bf16 (as stored; multiplied with fp32 accumulation and output) |
| norms, `ape`, `attn_sink`, `hc_*`, gate bias | fp32 |
| everything else (`embed`, `head`, `ffn.gate`, `indexer.weights_proj`) | bf16 |
"""

from __future__ import annotations

import torch
from torch import nn

from model import low_precision
from model.kernels import check_impl, set_impl
from model.kernels.gemm import fp8_gemm

FP8_LINEARS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "e_proj", "h_proj")


class Fp8Linear(nn.Module):
    """y = x · dequant(weight)ᵀ. weight e4m3 [out, in]; scale fp32 [⌈out/128⌉, ⌈in/128⌉] (powers of 2).
    `act_fp8`: W8A8, x quantised to e4m3 per 128 along K first (`kernels/gemm/act_quant.py`), as the
    checkpoint's `"activation_scheme": "dynamic"` declares."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, impl: str = "torch", act_fp8: bool = False,
                 persistent: bool = True):
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"Fp8Linear needs float8_e4m3fn weights, got {weight.dtype}")
        rows, cols = -(-weight.shape[0] // fp8_gemm.BLOCK), -(-weight.shape[1] // fp8_gemm.BLOCK)
        if tuple(scale.shape) != (rows, cols):
            raise ValueError(f"Fp8Linear scale shape {tuple(scale.shape)} does not match weight "
                             f"{tuple(weight.shape)} (expected {(rows, cols)})")
        self.impl = check_impl(impl)
        self.act_fp8 = act_fp8
        self.deterministic = False  # `kernels.set_deterministic`: one kernel configuration for every M
        # not persistent: a fused module (`fuse_fp8_linears`), whose rows are other modules' state
        self.register_buffer("weight", weight, persistent=persistent)
        self.register_buffer("scale", scale.float(), persistent=persistent)
        # split-K arrival counters of the decode products (the kernel leaves them zeroed); a module
        # runs one product at a time, in stream order
        self.register_buffer("arrivals", fp8_gemm.arrival_counters(weight.shape[0], weight.device), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, impl: str = "torch", act_fp8: bool = False) -> "Fp8Linear":
        q, s = low_precision.fp8_quantize_weight(linear.weight.detach().float())
        return cls(q, s, impl, act_fp8)

    @classmethod
    def random(cls, out_features: int, in_features: int, device: torch.device | str, impl: str = "torch",
               generator: torch.Generator | None = None, act_fp8: bool = False) -> "Fp8Linear":
        """Random e4m3 codes with scales giving unit-variance outputs (benchmarks at full size)."""
        w = torch.randn(out_features, in_features, device=device, generator=generator) / in_features ** 0.5
        q, s = low_precision.fp8_quantize_weight(w)
        return cls(q, s, impl, act_fp8)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_gemm.fp8_linear(x, self.weight, self.scale, self.impl, arrivals=self.arrivals, act_fp8=self.act_fp8,
                                   deterministic=self.deterministic)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, g, in] → [T, g, out/g]: group i multiplies rows [i·out/g, (i+1)·out/g)."""
        return fp8_gemm.fp8_linear(x, self.weight, self.scale, self.impl, x.shape[1], self.arrivals, self.act_fp8,
                                   self.deterministic)


def quantize_model(model: nn.Module, impl: str, expert_format: str = "fp4",
                   dtype: torch.dtype = torch.bfloat16, act_fp8: bool = False, fuse: bool = True) -> nn.Module:
    """Convert a float model (on its target device) to the device format (table above), in place;
    `act_fp8`: the FP8 projections quantise their inputs (W8A8, `Fp8Linear`) and the indexers
    their queries against FP8 keys (`Indexer.fp8_query`); `fuse`: products of one input run as one
    (`Attention.fuse_products`; off only to compare against)."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name in FP8_LINEARS and _is_projection(name):
                setattr(module, child_name, Fp8Linear.from_linear(child, impl, act_fp8))
        if hasattr(module, "fp8_query"):
            module.fp8_query = act_fp8
    for module in model.modules():
        if hasattr(module, "pack_experts"):
            module.pack_experts(expert_format)
    for name, p in model.named_parameters():
        p.data = p.data.to(_param_dtype(name, p, dtype))
    set_impl(model, impl)
    if fuse:
        for module in model.modules():
            if hasattr(module, "fuse_products"):
                module.fuse_products()
    return model


@torch.no_grad()  # the copies into the stack are no autograd ops: the views stay leaves
def fuse_weights(parts: list[nn.Module], name: str = "weight", align: int = 1) -> tuple[torch.Tensor, list[int]]:
    """Stack the `name` tensors of `parts` along dim 0, each starting at a multiple of `align` rows
    (zero rows between), and make each part's tensor a view of its rows: one allocation where there
    were several, nothing copied twice, the parts' names and values unchanged. → (stacked, each
    part's first row)."""
    firsts, rows = [], 0
    for part in parts:
        rows = -(-rows // align) * align
        firsts.append(rows)
        rows += getattr(part, name).shape[0]
    first = getattr(parts[0], name)
    stacked = first.new_zeros(rows, *first.shape[1:])
    for part, row in zip(parts, firsts):
        t = getattr(part, name)
        view = stacked[row:row + t.shape[0]]
        view.copy_(t)
        if isinstance(t, nn.Parameter):
            view = nn.Parameter(view, requires_grad=t.requires_grad)
        setattr(part, name, view)
    return stacked, firsts


def fuse_fp8_linears(parts: list[Fp8Linear]) -> tuple[Fp8Linear, list[int]]:
    """One `Fp8Linear` over the rows of `parts` (linears of the same input): its output's columns
    [first, first + part.out_features) are that part's product. Each part starts on a 128-row scale
    block (zero rows pad the blocks between: none at V4 widths, whose rows are multiples of 128);
    its weight and scale become views of the fused ones. → (fused, each part's first column)."""
    if len({(p.act_fp8, p.impl, p.weight.shape[1]) for p in parts}) != 1:
        raise ValueError("fused FP8 linears must share the input width, activation scheme and impl")
    weight, firsts = fuse_weights(parts, "weight", fp8_gemm.BLOCK)
    # part i's scale rows start at block firsts[i] / 128: every part before it fills whole blocks
    scale, _ = fuse_weights(parts, "scale")
    return Fp8Linear(weight, scale, parts[0].impl, parts[0].act_fp8, persistent=False), firsts


def _is_projection(module_name: str) -> bool:
    """FP8 in the checkpoint: attention and indexer projections, MTP e/h projections."""
    leaf = module_name.rsplit(".", 1)[-1]
    return leaf in ("attn", "indexer") or module_name.startswith("mtp.")


def _param_dtype(name: str, p: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    if not p.is_floating_point():
        return p.dtype
    if p.dim() == 1 or name.endswith(("ape", "attn_sink")) or ".hc_" in name \
            or name.startswith("hc_") or "norm" in name:
        return torch.float32
    return dtype
