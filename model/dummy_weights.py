"""Random weights made directly in the device format: the `dummy` load format (vLLM's and SGLang's
`--load-format dummy`), for serving and benchmarking models whose checkpoint is not at hand.

Only `config.json` is read. Every tensor is made on its device in the form `quantize_model` would
leave a checkpoint in (FP8 e4m3 projections with UE8M0-valued scales, packed FP4 routed experts,
FP8 shared expert, bf16 embedding / head / gate, fp32 norms and mHC parameters), never as floats:
a full-width V4-Flash layer is ~3.5 GB that way instead of ~30 GB of float32.

Values are seeded: the dense part of layer i by i, the embedding and head by the model seed, and
a run of routed experts by (layer, first expert). So every worker holds the same dense weights,
and ranks of expert-parallel groups of the same size hold the same experts at the same rank; P/D
workers of such pools therefore compute the same model. Routed experts can be left as shapes
only (`defer_experts`) and made after an expert-parallel group has picked this rank's slice
(`materialize_experts`), so a rank never holds more than its share (the whole of V4-Flash, ~154
GB, fits no single GPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from model.config import ModelConfig
from model.kernels import arrival_counter, set_impl
from model.kernels.mhc import mhc
from model.kernels.moe.packed_experts import PackedExperts
from model.load_progress import DUMMY, LoadProgress, LoadTracker
from model.moe import MoE
from model.quantized import FP8_LINEARS, Fp8Linear, _is_projection, _param_dtype
from model.tiny import random_weights
from model.transformer import Block, MTPBlock, Transformer

EXPERT_FORMAT = "fp4"  # the routed experts' format, as V4 checkpoints ship them
_EXPERT_SEED = 1_000_003  # seeds of expert runs: layer · this + first expert (apart from dense seeds)


def dummy_model(cfg: ModelConfig, impl: str, device: torch.device | str, act_fp8: bool = False, seed: int = 0,
                defer_experts: bool = False, with_mtp: bool = False,
                progress: Callable[[LoadProgress], None] | None = None) -> Transformer:
    """The whole model (its MTP block too with `with_mtp`) with random device-format weights on
    `device`. `defer_experts`: routed experts as shapes only (meta), for `materialize_experts`
    after sharding. `progress` is told the layers (and the rest: embedding, head) made so far."""
    with torch.device("meta"):
        model = Transformer(_without_experts(cfg), impl=impl)
    model.cfg = cfg
    mtp = with_mtp and cfg.num_nextn_predict_layers > 0
    tracker = LoadTracker(progress, DUMMY, "layers", cfg.num_hidden_layers + mtp + 1)

    def made(block: Block) -> Block:
        if not defer_experts:  # each layer's experts with it, seeded as `materialize_experts` seeds them
            _materialize(block.ffn, 0, seed)
        tracker.step(1, _nbytes(block))
        return block

    model.layers = nn.ModuleList(made(dummy_block(cfg, i, impl, device, seed=seed + i, act_fp8=act_fp8,
                                                  defer_experts=True)) for i in range(cfg.num_hidden_layers))
    if mtp:
        n = cfg.num_hidden_layers
        model.mtp = nn.ModuleList([made(dummy_block(cfg, n, impl, device, seed=seed + n, act_fp8=act_fp8,
                                                    defer_experts=True, mtp=True))])
    g = torch.Generator(device=device).manual_seed(seed)
    D, V = cfg.hidden_size, cfg.vocab_size
    model.embed.weight = nn.Parameter(torch.randn(V, D, device=device, generator=g).bfloat16(), requires_grad=False)
    model.head.weight = nn.Parameter((torch.randn(V, D, device=device, generator=g) / D ** 0.5).bfloat16(),
                                     requires_grad=False)
    _fill_meta_parameters(model, cfg, device, seed)
    model.hc_arrivals = arrival_counter(device)  # a buffer, built on the meta device above
    set_impl(model, impl)
    tracker.step(1, _nbytes(model) - tracker.bytes_done)
    return model.eval()


def _nbytes(module: nn.Module) -> int:
    """Bytes of the tensors `module` holds on a device (meta ones are shapes only)."""
    return sum(t.nbytes for t in [*module.parameters(), *module.buffers()] if not t.is_meta)


def dummy_block(cfg: ModelConfig, layer: int, impl: str, device: torch.device | str, seed: int = 0,
                act_fp8: bool = False, fuse: bool = True, defer_experts: bool = False, mtp: bool = False) -> Block:
    """Layer `layer` of `cfg` with random weights in the device format (`act_fp8`: W8A8 projections
    and FP8 indexer queries; `fuse`: products of one input as one, `Attention.fuse_products`, as
    `quantize_model` does); the MTP block with `mtp` (`layer` = num_hidden_layers). On the meta
    device it gives shapes only (for counting bytes)."""
    meta = torch.device(device).type == "meta"
    with torch.device("meta"):
        block = (MTPBlock(_without_experts(cfg), impl) if mtp
                 else Block(_without_experts(cfg), layer, cfg.compress_ratios[layer], impl))
    block.cfg = cfg
    g = None if meta else torch.Generator(device=device).manual_seed(seed)
    for name, module in list(block.named_modules()):
        if hasattr(module, "fp8_query"):
            module.fp8_query = act_fp8
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name in FP8_LINEARS and _is_projection(name):
                if meta:
                    with torch.device("meta"):
                        w = torch.empty(child.out_features, child.in_features, dtype=torch.float8_e4m3fn)
                        s = torch.empty(-(-child.out_features // 128), -(-child.in_features // 128))
                    setattr(module, child_name, Fp8Linear(w, s, impl, act_fp8))
                else:
                    setattr(module, child_name, Fp8Linear.random(child.out_features, child.in_features, device, impl, g,
                                                                 act_fp8))
    block.ffn = MoE.random_packed(cfg, layer, EXPERT_FORMAT, impl, device=device, seed=seed, defer_routed=True)
    if not meta:
        _fill_meta_parameters(block, cfg, device, seed)
        block.hc_arrivals = arrival_counter(device)  # buffers, built on the meta device above
        block.hc_mixes = mhc.mixes_buffer(device)
        if fuse:
            block.attn.fuse_products()
        if not defer_experts:
            _materialize(block.ffn, 0, seed)
    return block


def materialize_experts(model: Transformer, seed: int = 0) -> int:
    """Make every routed-expert set still on the meta device: the slice this rank holds (an
    `ExpertParallelMoE`'s `first` and `n_local`, else all), seeded by (layer, first expert).
    → how many layers it made."""
    made = 0
    for block in [*model.layers, *model.mtp]:
        ffn = block.ffn
        if isinstance(ffn.experts, PackedExperts) and ffn.experts.w13.is_meta:  # (float experts: a checkpoint's)
            _materialize(ffn, getattr(ffn, "first", 0), seed)
            made += 1
    return made


def _materialize(ffn: nn.Module, first: int, seed: int) -> None:
    """`ffn`'s experts (shapes on the meta device; the first is expert `first`) made on its device."""
    meta = ffn.experts
    device = ffn.gate.weight.device
    g = torch.Generator(device=device).manual_seed(seed + ffn.layer * _EXPERT_SEED + first)
    ffn.experts = PackedExperts.random(meta.fmt, meta.n_experts, meta.dim, meta.inter, device, g)


def _fill_meta_parameters(module: nn.Module, cfg: ModelConfig, device, seed: int) -> None:
    """Random values (`tiny.random_weights`, by official name) for the parameters still on the meta
    device, in the dtypes `quantize_model` gives them."""
    shapes = {n: p.shape for n, p in module.named_parameters() if p.is_meta}
    values = random_weights(shapes, cfg, seed)
    for name, shape in shapes.items():
        owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        dtype = _param_dtype(name, torch.empty(shape, device="meta"), torch.bfloat16)
        setattr(owner, name.rsplit(".", 1)[-1], nn.Parameter(values[name].to(device, dtype), requires_grad=False))


def _without_experts(cfg: ModelConfig) -> ModelConfig:
    """`cfg` without experts, so building on the meta device skips hundreds of expert modules."""
    return dataclasses.replace(cfg, n_routed_experts=1, n_shared_experts=0)
