"""Expert parallelism on CPU: 2 gloo processes on localhost against EP 1 (the plain model, in-process).

Each rank builds the same random model (same seed), shards its experts (`model.ep`) and runs its
own batch — different lengths, a rank with zero tokens, a whole tiny Transformer with one rank idle
for a step — comparing with the unsharded model on the same batch. With FP8 dispatch off the
arithmetic is the same as EP 1's except that the expert GEMMs see other ranks' rows in their
batch: outputs agree to 1e-6 relative (fp32 rounding). With FP8 dispatch the expert inputs carry
e4m3 rounding (3 mantissa bits: ≤ 2^-4 relative per value, ~3.6% rms), which the expert outputs
inherit at about that size: 0.08 relative norm.
"""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model import ep
from model.batch import ForwardBatch
from model.kv_pool import KVPools, SeqKV
from model.moe import MoE
from model.tiny import random_weights, tiny_config
from model.transformer import Transformer

EXACT_TOL = 1e-6
FP8_TOL = 0.08


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).double().norm() / b.double().norm().clamp_min(1e-30))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(case: str, world: int = 2) -> None:
    """Run `case` on `world` gloo ranks; a failing assertion in any rank fails the test."""
    mp.spawn(_rank_main, args=(world, free_port(), case), nprocs=world, join=True)


def _rank_main(rank: int, world: int, port: int, case: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        CASES[case](rank, world)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# cases (run inside each rank)
# ---------------------------------------------------------------------------------------

def _moe(layer: int, packed: str | None) -> MoE:
    cfg = tiny_config()
    moe = MoE(cfg, layer)
    moe.load_state_dict(random_weights({k: v.shape for k, v in moe.state_dict().items()}, cfg, seed=layer))
    return moe.pack_experts(packed) if packed else moe


def _batch(cfg, rank: int, step: int, sizes: dict[tuple[int, int], int]):
    g = torch.Generator().manual_seed(100 * rank + step)
    T = sizes[(rank, step)]
    return torch.randn(T, cfg.hidden_size, generator=g), torch.randint(0, cfg.vocab_size, (T,), generator=g)


def case_moe_layers(rank: int, world: int) -> None:
    """Score-routed and hash layers, float and FP4 experts, FP8 dispatch off and on; step 0 leaves
    rank 1 without tokens."""
    sizes = {(0, 0): 7, (1, 0): 0, (0, 1): 5, (1, 1): 11}
    for layer, packed, fp8 in ((3, None, False), (0, None, False), (3, "fp4", False), (3, None, True)):
        local = _moe(layer, packed)
        sharded = ep.ExpertParallelMoE(copy.deepcopy(local), fp8_dispatch=fp8)
        assert sharded.experts is not None and sharded.n_local == local.cfg.n_routed_experts // world
        _check_steps(local, sharded, rank, sizes, FP8_TOL if fp8 else EXACT_TOL, (layer, packed, fp8))


def _check_steps(local: MoE, sharded: ep.ExpertParallelMoE, rank: int, sizes: dict, tol: float, what) -> None:
    """Steps 0 and 1 of `sizes` through both layers: the sharded one within `tol` of the local one."""
    for step in (0, 1):
        x, tok = _batch(local.cfg, rank, step, sizes)
        with torch.no_grad():
            got, want = sharded(x, tok), local(x, tok)
        assert got.shape == want.shape
        if len(x):
            assert rel(got, want) < tol, (what, step, rel(got, want))


def _model(cfg) -> Transformer:
    model = Transformer(cfg)
    model.load_state_dict(random_weights({k: v.shape for k, v in model.state_dict().items()}, cfg, seed=0))
    return model.eval()


def _run(model: Transformer, pools: KVPools, seqs: list[SeqKV], tokens: list[list[int]]) -> torch.Tensor:
    batch = ForwardBatch.build(list(zip(seqs, tokens)))
    logits = model(batch, pools, all_logits=True)
    batch.commit()
    return logits


def case_transformer(rank: int, world: int) -> None:
    """The whole tiny model, data-parallel attention: rank 0 prefills one prompt, rank 1 two; then
    rank 0 decodes while rank 1 is idle (joins the exchanges with no tokens), then both decode."""
    _check_model(rank, (37,) if rank == 0 else (20, 9), decode_capacity=0)


def _check_model(rank: int, prompt_lens: tuple[int, ...], decode_capacity: int) -> None:
    """Prefill `prompt_lens` (exact-split exchange), decode a step with rank 1 idle, then one on
    both ranks (with `decode_capacity` > 0: the fixed-capacity exchange), each against EP 1."""
    cfg = tiny_config(index_topk=128)
    ref = _model(cfg)
    sharded = ep.shard_experts(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in prompt_lens]
    pools = {name: KVPools(cfg, "fp32", page_size=128, max_tokens=256, max_seqs=4) for name in ("ref", "ep")}
    seqs = {name: [SeqKV() for _ in prompts] for name in pools}
    for name in pools:
        for seq, p in zip(seqs[name], prompts):
            pools[name].reserve(seq, len(p) + 3)
    for step, tokens in enumerate([prompts, [[5]] * len(prompts) if rank == 0 else None, [[7]] * len(prompts)]):
        ep.set_capacity(sharded, 0 if step == 0 else decode_capacity)
        if tokens is None:
            ep.idle_step(sharded)
            continue
        want = _run(ref, pools["ref"], seqs["ref"], tokens)
        got = _run(sharded, pools["ep"], seqs["ep"], tokens)
        assert rel(got, want) < EXACT_TOL, (step, decode_capacity, rel(got, want))


def case_capped(rank: int, world: int) -> None:
    """The fixed-capacity exchange (decode): padded equal-split buffers give the same outputs, for a
    rank with no tokens and a rank exactly at capacity; more tokens than the capacity are refused
    (on every rank, before any exchange); then the whole model decodes with it, rank 1 idle once."""
    cap = 6
    sizes = {(0, 0): cap, (1, 0): 0, (0, 1): 2, (1, 1): cap}
    for layer, packed in ((3, None), (0, None), (3, "fp4")):
        local = _moe(layer, packed)
        sharded = ep.ExpertParallelMoE(copy.deepcopy(local))
        sharded.capacity = cap
        _check_steps(local, sharded, rank, sizes, EXACT_TOL, (layer, packed))
        x, tok = _batch(local.cfg, 0, 0, {(0, 0): cap + 1})
        with pytest.raises(ValueError, match="exceed the expert-parallel capacity of 6"):
            sharded(x, tok)
    _check_model(rank, (30, 12) if rank == 0 else (25,), decode_capacity=2)


CASES = {"moe_layers": case_moe_layers, "transformer": case_transformer, "capped": case_capped}


# ---------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CASES))
def test_ep2_matches_ep1(case):
    run_ranks(case)


def test_uneven_expert_split_is_refused(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    with pytest.raises(ValueError, match="8 routed experts cannot be split evenly"):
        ep.ExpertParallelMoE(_moe(3, None))


def test_dispatch_payload_round_trip():
    rows, ids = torch.randn(5, 256), torch.tensor([3, 0, 1, 7, 2])
    back, back_ids = ep._unpack(ep._pack(rows, ids, fp8=False), 256, torch.float32, fp8=False)
    assert torch.equal(back, rows) and torch.equal(back_ids, ids)
    back, back_ids = ep._unpack(ep._pack(rows, ids, fp8=True), 256, torch.float32, fp8=True)
    assert torch.equal(back_ids, ids) and rel(back, rows) < 0.05
