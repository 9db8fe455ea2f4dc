"""The `dummy` load format: random weights made in the device format from config.json alone.

Checked: the dummy model has exactly the parameters, shapes and dtypes `quantize_model` gives a
loaded checkpoint (so every kernel sees what a real checkpoint gives it); it is seeded (two builds
are equal) and runs a finite forward; deferred routed experts stay shapes until made, and making
them gives what building them at once gives; `make-config` writes a config the loader reads back
as V4-Flash; the worker options refuse an unknown load format by name."""

from __future__ import annotations

import pytest
import torch

from cluster.cli import main as cli_main
from model.batch import ForwardBatch
from model.checkpoint import fp8_activations, load_checkpoint, read_config
from model.dummy_weights import dummy_block, dummy_model, materialize_experts
from model.kv_pool import KVPools, SeqKV
from model.quantized import quantize_model
from model.tiny import flash_config
from worker_runtime.model_loader import load_replica
from worker_runtime.options import WorkerOptions


def _layout(model) -> dict:
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def test_dummy_model_has_the_device_format_of_a_loaded_checkpoint(tiny_official_ckpt):
    cfg, loaded = load_checkpoint(tiny_official_ckpt)
    quantize_model(loaded, "torch", act_fp8=fp8_activations(tiny_official_ckpt))
    dummy = dummy_model(cfg, "torch", "cpu", act_fp8=fp8_activations(tiny_official_ckpt))
    assert _layout(dummy) == _layout(loaded)
    fp8 = [m for m in dummy.modules() if type(m).__name__ == "Fp8Linear"]
    assert fp8 and all(m.act_fp8 for m in fp8)  # the official config declares dynamic activations
    for model in (dummy, loaded):  # and with them the indexers' FP8 queries
        flags = [m.fp8_query for m in model.modules() if type(m).__name__ == "Indexer"]
        assert flags and all(flags)
    plain = dummy_block(cfg, cfg.compress_ratios.index(4), "torch", "meta")  # bf16 activations: exact queries
    assert plain.attn.indexer.fp8_query is False


def test_dummy_model_is_seeded_and_runs(tiny_ckpt_cfg):
    a = dummy_model(tiny_ckpt_cfg, "torch", "cpu", act_fp8=True)
    b = dummy_model(tiny_ckpt_cfg, "torch", "cpu", act_fp8=True)
    other = dummy_model(tiny_ckpt_cfg, "torch", "cpu", act_fp8=True, seed=1)
    sa, sb, so = a.state_dict(), b.state_dict(), other.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.1.ffn.experts.w13"], so["layers.1.ffn.experts.w13"])
    assert not any(t.is_meta for t in sa.values())
    pools = KVPools(tiny_ckpt_cfg, "fp8_pack", max_tokens=256, max_seqs=1)
    seq = SeqKV()
    pools.reserve(seq, 200)
    logits = a(ForwardBatch.build([(seq, list(range(3, 140)))]), pools)
    assert logits.shape == (1, tiny_ckpt_cfg.vocab_size)
    assert logits.isfinite().all() and logits.std() > 0.1  # random weights, yet a live forward


def test_deferred_experts_are_shapes_until_made(tiny_ckpt_cfg):
    deferred = dummy_model(tiny_ckpt_cfg, "torch", "cpu", defer_experts=True)
    assert all(block.ffn.experts.w13.is_meta for block in deferred.layers)
    assert not any(p.is_meta for p in deferred.parameters())  # all but the routed experts are made
    assert materialize_experts(deferred) == tiny_ckpt_cfg.num_hidden_layers
    assert materialize_experts(deferred) == 0  # nothing left to make
    whole = dummy_model(tiny_ckpt_cfg, "torch", "cpu")
    sd, sw = deferred.state_dict(), whole.state_dict()
    assert all(torch.equal(sd[k], sw[k]) for k in sw)


def test_make_config_writes_v4_flash(tmp_path, capsys):
    assert cli_main(["make-config", "--out", str(tmp_path), "--layers", "5"]) in (0, None)
    assert str(tmp_path / "config.json") in capsys.readouterr().out
    cfg = read_config(tmp_path)
    assert cfg == flash_config(5)
    assert fp8_activations(tmp_path)
    assert cli_main(["make-config", "--out", str(tmp_path), "--layers", "44"]) == 2


def test_dummy_replica_from_a_config_alone(tmp_path, tiny_ckpt_cfg):
    from model.checkpoint import write_config

    write_config(tmp_path, tiny_ckpt_cfg)  # no weights in the directory
    _, model, pools = load_replica(WorkerOptions(str(tmp_path), "", load_format="dummy", kv_dtype="fp8_pack",
                                                 max_tokens=256, max_seqs=2))
    assert pools.format == "fp8_pack"
    assert _layout(model) == _layout(dummy_model(tiny_ckpt_cfg, "torch", "cpu"))
    with pytest.raises(Exception, match="no .*safetensors|index|weights"):
        load_replica(WorkerOptions(str(tmp_path), "", max_tokens=256, max_seqs=2))  # "auto" needs weights


def test_unknown_load_format_is_refused():
    with pytest.raises(ValueError, match="load_format must be one of"):
        WorkerOptions("m", "", load_format="random")
