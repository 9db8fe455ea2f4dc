"""How far FP8 activations into the MoE experts would move the model (W4A8: each expert's input
quantised to e4m3 per 128 along K, `act_quant.fake_quantize`, as the W8A8 projections already
quantise theirs), against how far the W8A8 projections move it now. The question behind it: the
FP4 experts on an H200 are bound in part by turning codes into bf16 MMA operands, and e4m3
operands convert for fewer instructions, but only with FP8 activations (docs/journal/,
round v33, with why the per-32 scales may eat that saving).

    python benchmarks/research/expert_activation_error.py --out e.json [--device cuda] [--prompts 32]

* layer: one full-width V4-Flash MoE layer (random FP4 experts, FP8 shared expert) on unit-RMS
  inputs, relative error of its output with FP8 inputs against bf16 ones; beside it wq_b's W8A8
  product against its W8A16 one on the same kind of input (what the serving path accepts today).
* model: the tiny checkpoint's logits at every position of random prompts, three ways:
  everything on bf16 activations (the reference here), the projections W8A8 (how a checkpoint
  that declares `"activation_scheme": "dynamic"` runs now), and the experts' inputs quantised
  too; relative L2 error against the reference and how often the greedy token changes.
Torch reference paths only (impl "torch"): the numbers are the formats', not the kernels'.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.batch import ForwardBatch  # noqa: E402
from model.checkpoint import expected_shapes, load_checkpoint, write_checkpoint  # noqa: E402
from model.kernels.gemm import act_quant  # noqa: E402
from model.kv_pool import KVPools, SeqKV  # noqa: E402
from model.moe import MoE, experts_forward  # noqa: E402
from model.quantized import Fp8Linear, quantize_model  # noqa: E402
from model.tiny import flash_config, random_weights, tiny_config  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def fp8_experts(moe: MoE, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """A forward hook: the MoE's output again, with the experts (routed and shared) fed e4m3-rounded
    inputs; the gate keeps the bf16 input."""
    x, input_ids = args
    weights, ids = moe.gate(x, input_ids)
    return experts_forward(act_quant.fake_quantize(x, "torch"), weights, ids, moe.experts, moe.shared_experts,
                           moe.cfg.swiglu_limit, moe.impl)


def layer_errors(device: str, tokens: int) -> dict:
    cfg = flash_config(4)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, cfg.hidden_size, device=device, generator=g).bfloat16()
    moe = MoE.random_packed(cfg, 3, "fp4", "torch", device)  # a score-routed layer
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    with torch.no_grad():
        y16 = moe(x, ids)
        y8 = fp8_experts(moe, (x, ids), y16)
        wq_b = Fp8Linear.random(cfg.num_attention_heads * cfg.head_dim, cfg.q_lora_rank, device)
        xq = torch.randn(tokens, cfg.q_lora_rank, device=device, generator=g).bfloat16()
        p16 = wq_b(xq)
        wq_b.act_fp8 = True
        p8 = wq_b(xq)
    return {"tokens": tokens, "moe_rel_err": rel(y8, y16), "wq_b_rel_err": rel(p8, p16)}


def model_errors(device: str, prompts: int, length: int) -> dict:
    cfg = tiny_config(index_topk=128)  # top-k covers every entry: no ReLU-tie noise in the comparison
    ckpt = write_checkpoint(tempfile.mkdtemp(), cfg, random_weights(expected_shapes(cfg), cfg, seed=0), "official")
    g = torch.Generator().manual_seed(1)
    batch_ids = [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(prompts)]
    logits = {}
    for name, act_fp8, experts_fp8 in (("bf16", False, False), ("projections_fp8", True, False),
                                      ("projections_and_experts_fp8", True, True)):
        _, model = load_checkpoint(ckpt, device=device)
        quantize_model(model, "torch", act_fp8=act_fp8)
        if experts_fp8:
            for m in model.modules():
                if isinstance(m, MoE):
                    m.register_forward_hook(fp8_experts)
        pools = KVPools(cfg, "bf16", max_tokens=length, max_seqs=1, device=device)
        rows = []
        with torch.no_grad():
            for prompt in batch_ids:
                seq = SeqKV()
                pools.reserve(seq, length)
                rows.append(model(ForwardBatch.build([(seq, prompt)], device=device), pools, all_logits=True).float().cpu())
                pools.release(seq)
        logits[name] = torch.stack(rows)
    ref = logits["bf16"]
    return {name: {"rel_err": rel(v, ref), "greedy_changed": int((v.argmax(-1) != ref.argmax(-1)).sum()),
                   "positions": ref.shape[0] * ref.shape[1]} for name, v in logits.items() if name != "bf16"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=16, help="tokens through the full-width layer")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--length", type=int, default=64)
    args = ap.parse_args()
    result = {"layer": layer_errors(args.device, args.tokens),
              "model": model_errors(args.device, args.prompts, args.length)}
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
