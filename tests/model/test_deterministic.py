"""`--deterministic`: every kernel dispatch that picks a tile, split or path by the step's token
count picks one for every count under it; the flag parses on `generate` and `up`, reaches the
workers' options and every dispatching module of the model, and on the CPU changes nothing."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.cli import main as cli_main
from cluster.cli_parser import build_parser
from model.kernels import set_deterministic
from model.kernels.attention import indexer, sparse_attention
from model.kernels.gemm import fixed_matmul, fp8_gemm
from model.kernels.mhc import mhc
from model.kernels.moe import moe_fused
from model.quantized import Fp8Linear, quantize_model
from model.tiny import random_model, tiny_config
from worker_runtime.model_loader import load_replica
from worker_runtime.options import ExpertParallelOptions, WorkerOptions

TOKENS = range(1, 513)
# V4-Flash products: wq_a | wkv, wq_b | indexer wq_b, wo_a (8 groups), wo_b, shared expert w13 / w2
FP8_SHAPES = [(1536, 4096, 1), (33024, 1024, 1), (1024, 4096, 8), (4096, 8192, 1), (4096, 4096, 1), (4096, 2048, 1)]


def _one(configs) -> bool:
    first = configs[0]
    return all(c == first for c in configs)


# ---------------------------------------------------------------------------------------
# the selection functions
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("a8", [False, True])
@pytest.mark.parametrize("N, K, groups", FP8_SHAPES)
def test_fp8_gemm_takes_one_configuration_for_every_m(N, K, groups, a8):
    assert _one([fp8_gemm.decode_config(M, N, K, groups, a8=a8, deterministic=True) for M in TOKENS])
    assert not _one([fp8_gemm.decode_config(M, N, K, groups, a8=a8) for M in TOKENS])  # the flag is what fixes it
    cfg = fp8_gemm.decode_config(1, N, K, groups, a8=a8, deterministic=True)
    assert "BLOCK_M" not in cfg and not cfg.get("TMA") and not cfg.get("UNIFORM_SW")


def test_fp8_gemm_k_split_follows_the_weight_alone():
    """The split is what fills the GPU at one token (wq_a's 24 output tiles split K), and a wide
    product (wq_b | indexer wq_b) is not split."""
    assert fp8_gemm.decode_config(1, 1536, 4096, 1, deterministic=True)["SPLIT_K"] > 1
    assert fp8_gemm.decode_config(1, 33024, 1024, 1, deterministic=True)["SPLIT_K"] == 1


@pytest.mark.parametrize("heads, blocks", [(1, 10), (1, 2), (64, 10), (64, 34)])
def test_attention_takes_one_split_count_for_every_step(heads, blocks):
    splits = [sparse_attention.split_count(T * heads, blocks, 132, deterministic=True) for T in TOKENS]
    assert _one(splits) and splits[0] == sparse_attention.DETERMINISTIC_SPLITS > 1
    assert not _one([sparse_attention.split_count(T * heads, blocks, 132) for T in TOKENS])


def test_indexer_logits_take_one_tile_for_every_step():
    for n_max in (16, 512, 2048, 8192):
        assert _one([indexer.logit_blocks(T, n_max, 132, deterministic=True) for T in TOKENS])
    assert not _one([indexer.logit_blocks(T, 2048, 132) for T in TOKENS])


def test_mhc_entries_take_one_path_for_every_step():
    tiles = [mhc.entry_tiles(T, deterministic=True) for T in range(1, 4097)]
    assert _one(tiles) and isinstance(tiles[0], mhc.BatchTiles)
    kinds = {type(mhc.entry_tiles(T)) for T in range(1, 4097)}
    assert kinds == {mhc.SmallTiles, mhc.BatchTiles, mhc.MixTiles}


def test_moe_takes_one_k_order_for_every_step():
    """Every step size cuts K alike: the one-token tiles' ranges split over programs up to
    `SMALL_T` tokens, the same ranges walked in one program above (`Tiles.k_ranges`, the split's
    bits: tests/model/test_moe_kernels.py)."""
    tiles = [moe_fused.decode_tiles(T, deterministic=True) for T in range(1, 4097)]

    def k_order(t):
        return t.BK, t.split_k * t.k_ranges, t.swap_ab

    assert _one([(k_order(g), k_order(d)) for g, d in tiles]) and tiles[0] == moe_fused.decode_tiles(1)
    assert {g.split_k for g, _ in tiles} == {1, 4} and tiles[-1][0].k_ranges == 4  # split small steps, walk large
    assert not _one([moe_fused.decode_tiles(T) for T in TOKENS])


def test_the_fixed_matmul_configuration_follows_the_weight_alone():
    import inspect

    assert list(inspect.signature(fixed_matmul.config).parameters) == ["N"]  # nothing of M can reach it
    assert fixed_matmul.config(256)["BLOCK_N"] < fixed_matmul.config(129280)["BLOCK_N"]


# ---------------------------------------------------------------------------------------
# the flag reaches every dispatching module
# ---------------------------------------------------------------------------------------

def _flags(model) -> dict[str, bool]:
    return {name: m.deterministic for name, m in model.named_modules() if hasattr(m, "deterministic")}


def test_the_flag_reaches_every_dispatching_module_after_quantisation():
    cfg = tiny_config()
    model = random_model(cfg, with_mtp=True, seed=0)
    quantize_model(model, "torch")
    set_deterministic(model, True)
    flags = _flags(model)
    kinds = {type(m).__name__ for name, m in model.named_modules() if name in flags}
    # every kind of module whose kernels choose by the step's size
    assert {"Transformer", "Block", "MTPBlock", "Attention", "Compressor", "Indexer", "MoE", "Gate",
            "Fp8Linear", "Linear"} <= kinds
    assert all(flags.values())
    fused = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert fused and all(m.deterministic for m in fused)
    set_deterministic(model, False)
    assert not any(_flags(model).values())


def test_transformer_takes_the_flag_at_construction():
    model = random_model(tiny_config(), with_mtp=False, seed=0)
    assert not any(_flags(model).values())
    from model.transformer import Transformer

    det = Transformer(tiny_config(), deterministic=True)
    assert all(_flags(det).values()) and det.deterministic


# ---------------------------------------------------------------------------------------
# the command line and the workers' options
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["up"], ["generate", "--model", "m", "--prompt", "x", "--max-new-tokens", "1"]])
def test_the_flag_parses_on_both_commands_and_defaults_to_off(command):
    parser = build_parser()
    assert parser.parse_args(command).deterministic is False
    assert parser.parse_args(command + ["--deterministic"]).deterministic is True


def test_worker_options_carry_it_and_refuse_expert_parallel_pools():
    assert WorkerOptions("m", "").deterministic is False
    assert WorkerOptions("m", "", deterministic=True).deterministic is True
    for field in ("prefill_ep", "decode_ep"):
        with pytest.raises(ValueError, match="deterministic is not supported with an expert-parallel"):
            WorkerOptions("m", "", deterministic=True, **{field: ExpertParallelOptions(size=2)})


def test_the_replica_is_built_with_it_and_the_cpu_logits_do_not_change(tiny_official_ckpt):
    from model.batch import ForwardBatch
    from model.kv_pool import SeqKV

    def logits(deterministic: bool) -> torch.Tensor:
        options = WorkerOptions(str(tiny_official_ckpt), "", max_tokens=256, max_seqs=1, deterministic=deterministic)
        _, model, pools = load_replica(options)
        assert all(v is deterministic for v in _flags(model).values())
        seq = SeqKV()
        pools.reserve(seq, 40)
        return model(ForwardBatch.build([(seq, list(range(3, 43)))]), pools, all_logits=True)

    assert torch.equal(logits(True), logits(False))


def test_generate_accepts_it_on_the_cpu_and_gives_the_same_tokens(tiny_official_ckpt, capsys):
    lines = []
    for extra in ([], ["--deterministic"]):
        assert cli_main(["generate", "--model", str(tiny_official_ckpt), "--prompt-ids", "5,6,7,8",
                         "--max-new-tokens", "4", "--temperature", "0"] + extra) in (0, None)
        lines.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert lines[0]["token_ids"] == lines[1]["token_ids"] and len(lines[0]["token_ids"]) == 4
