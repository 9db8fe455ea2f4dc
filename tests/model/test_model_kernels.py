"""The whole model with `impl="triton"` against the torch reference path, same weights and pool
format: chunked prefill of two requests in one batch, then batched decode steps (the Triton
interpreter on CPU; compiled kernels on a GPU). Tolerance: the kernels run attention and the
indexer in bf16 on the tensor cores, so logits agree to ~1e-2 relative. `index_topk` covers every
entry here: with a smaller top-k, bf16 rounding reorders near-tied indexer scores and this random
(chaotic) model amplifies the different picks (the indexer kernel has its own tie-tolerant test)."""

import copy

import pytest
import torch

from model.batch import ForwardBatch
from model.kv_pool import KVPools, SeqKV
from model.kernels import set_impl
from model.tiny import random_weights, tiny_config
from model.checkpoint import expected_shapes
from model.transformer import Transformer
from tests.model.kernel_cases import rel_err

# Triton-interpreter parity of the whole model: minutes on 2 cores (the cases are exhaustive)
pytestmark = pytest.mark.slow

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run(model, pools, prompts, decode_steps, chunk):
    seqs = [SeqKV() for _ in prompts]
    for seq, p in zip(seqs, prompts):
        pools.reserve(seq, len(p) + decode_steps)
    logits = []
    for start in range(0, max(len(p) for p in prompts), chunk):
        items = [(s, p[start:start + chunk]) for s, p in zip(seqs, prompts) if p[start:start + chunk]]
        batch = ForwardBatch.build(items, device=DEVICE)
        logits.append(model(batch, pools))
        batch.commit()
    last = logits[-1].argmax(-1).tolist()
    for _ in range(decode_steps):
        batch = ForwardBatch.build([(s, [t]) for s, t in zip(seqs, last)], device=DEVICE)
        out = model(batch, pools)
        batch.commit()
        logits.append(out)
        last = out.argmax(-1).tolist()
    return torch.cat(logits)


@pytest.mark.parametrize("lengths, chunk", [
    # C4 entries and compress-state carry-over across chunks; no C128 entry yet. Under the
    # interpreter, against the batch-invariant reference, ~2 min of a 2-core machine: every
    # kernel's own parity test runs in CI, and the composed model runs compiled in
    # tests/gpu/test_model_gpu.py, so this case is exhaustive
    pytest.param((30, 13), 20, marks=pytest.mark.exhaustive),
    # 140 tokens make one C128 entry (~5 min under the interpreter)
    pytest.param((140, 37), 70, marks=pytest.mark.exhaustive),
])
def test_triton_model_matches_reference(lengths, chunk):
    cfg = tiny_config(index_topk=64)
    model = Transformer(cfg).to(DEVICE)
    model.load_state_dict(random_weights(expected_shapes(cfg), cfg, seed=3), strict=False)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    pools = KVPools(cfg, "bf16", max_tokens=512, max_seqs=2, device=DEVICE)
    ref = _run(model, copy.deepcopy(pools), prompts, decode_steps=2, chunk=chunk)
    fast_model = copy.deepcopy(model)
    set_impl(fast_model, "triton")
    got = _run(fast_model, pools, prompts, decode_steps=2, chunk=chunk)
    assert got.shape == ref.shape and bool(got.isfinite().all())
    assert rel_err(got, ref) < 1e-2
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8


def test_modules_built_with_an_impl_all_take_it():
    """A block (or MTP block) built on its own runs the kernels it was built for: every module that
    dispatches (norms, projections, MoE) carries the impl, with no `set_impl` pass needed."""
    from model.transformer import Block, MTPBlock

    cfg = tiny_config()
    for module in (Block(cfg, 2, cfg.compress_ratios[2], "triton"), MTPBlock(cfg, "triton")):
        impls = {name: m.impl for name, m in module.named_modules() if hasattr(m, "impl")}
        assert impls and all(v == "triton" for v in impls.values()), \
            {k: v for k, v in impls.items() if v != "triton"}


def test_steps_the_kernels_cannot_address_are_refused():
    """The Triton kernels address a step's tensors with 32-bit offsets, the widest per token being
    the fused query product wq_b | indexer.wq_b: a step or an engine budget past that is refused
    with the limit named (at V4-Flash's 64 × 512 + 64 × 128 columns, 52428 tokens); the torch
    reference has no limit."""
    from decode_worker.engine import DecodeConfig, DecodeEngine
    from model.tiny import flash_config
    from model.transformer import kernel_step_limit
    from prefill_worker.engine import PrefillConfig, PrefillEngine

    cfg = tiny_config()
    assert Transformer(cfg, impl="torch").max_step_tokens() is None
    model = Transformer(cfg, impl="triton")
    limit = model.max_step_tokens()
    assert limit == (2**31 - 1) // (cfg.num_attention_heads * cfg.head_dim + cfg.index_n_heads * cfg.index_head_dim)
    # the rope kernel reads the query as a view of wq_b | indexer.wq_b, 40960 columns a token: a
    # step of 52,674 tokens (63 requests beside one) wrapped its offsets into an illegal access
    assert kernel_step_limit(flash_config(num_layers=1)) == 52428
    model.check_step_tokens(limit, "a step")
    with pytest.raises(ValueError, match=rf"the prefill token budget = {limit + 1} tokens.*\({limit} tokens"):
        PrefillEngine(model, None, "p0", PrefillConfig(token_budget=limit + 1))
    with pytest.raises(ValueError, match="max_running"):
        DecodeEngine(model, None, None, "d0", DecodeConfig(prefill_token_budget=limit, max_running=2))
    with pytest.raises(ValueError, match="the batch"):
        model(type("Batch", (), {"input_ids": torch.zeros(limit + 1, dtype=torch.long, device="meta")})(), None)
