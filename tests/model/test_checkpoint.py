"""Checkpoint I/O: both formats written, read back and cross-checked against transformers 5.23.

transformers is the oracle: it must load our official checkpoint with
`FineGrainedFP8Config(dequantize=True)` and our HF one with plain `from_pretrained`, and its
logits on a 200-token prompt must match ours (loaded through `load_checkpoint`) within 1e-4
relative. Our HF writer must produce what `save_pretrained` writes, key for key.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from model import low_precision
from model.batch import ForwardBatch
from model.checkpoint import (
    CheckpointError,
    detect_format,
    expected_shapes,
    fp8_activations,
    load_checkpoint,
    read_config,
    write_checkpoint,
)
from model.checkpoint_formats import official_storage
from model.hf_names import to_hf_state_dict
from model.kv_pool import KVPools, SeqKV
from model.tiny import random_weights, tiny_config

transformers = pytest.importorskip("transformers")

TOL = 1e-4
PROMPT_LEN = 200


def decoded_official(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the official format's stored tensors decode to, by our codecs."""
    out = {}
    for name, w in weights.items():
        kind = official_storage(name)
        if kind == "fp8":
            out[name] = low_precision.fp8_dequantize_weight(*low_precision.fp8_quantize_weight(w))
        elif kind == "fp4":
            out[name] = low_precision.fp4_dequantize_weight(*low_precision.fp4_quantize_weight(w))
        elif kind == "bf16":
            out[name] = w.bfloat16().float()
        else:
            out[name] = w
    return out


def assert_state_equal(model: torch.nn.Module, ref: dict[str, torch.Tensor]) -> None:
    sd = model.state_dict()
    assert set(sd) == set(ref)
    bad = [n for n, v in sd.items() if not torch.equal(v, ref[n].to(v.dtype))]
    assert not bad, bad[:5]


def all_tensors(ckpt) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


def rewrite(src, dst, edit) -> None:
    """Copy a single-file checkpoint, applying `edit` to its tensor dict."""
    shutil.copytree(src, dst)
    tensors = all_tensors(dst)
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def our_logits(ckpt, ids: torch.Tensor) -> torch.Tensor:
    cfg, model = load_checkpoint(ckpt)
    pools = KVPools(cfg, "fp32", page_size=128, max_tokens=512, max_seqs=1)
    seq = SeqKV()
    pools.reserve(seq, len(ids))
    return model(ForwardBatch.build([(seq, ids.tolist())]), pools, all_logits=True)


@pytest.fixture(scope="module")
def prompt(tiny_ckpt_cfg):
    return torch.randint(0, tiny_ckpt_cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------------------
# official format: layout and codecs
# ---------------------------------------------------------------------------------------

def test_official_layout(tiny_official_ckpt, tiny_ckpt_weights):
    config = json.loads((tiny_official_ckpt / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128], "expert_dtype": "fp4"}
    assert config["compress_ratios"] == [0, 4, 128, 4, 128, 0] and config["num_hash_layers"] == 2
    with safe_open(str(tiny_official_ckpt / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        dtypes = {k: f.get_slice(k).get_dtype() for k in keys}
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
    groups = {
        "layers.1.attn.wq_a.weight": ("F8_E4M3", (32, 64)), "layers.1.attn.wq_a.scale": ("F8_E8M0", (1, 1)),
        "layers.1.attn.wq_b.scale": ("F8_E8M0", (4, 1)), "layers.1.attn.wo_a.scale": ("F8_E8M0", (1, 2)),
        "layers.1.attn.indexer.wq_b.weight": ("F8_E4M3", (128, 32)),
        "layers.1.ffn.shared_experts.w2.weight": ("F8_E4M3", (64, 32)),
        "mtp.0.e_proj.weight": ("F8_E4M3", (64, 64)), "mtp.0.h_proj.scale": ("F8_E8M0", (1, 1)),
        "layers.1.ffn.experts.5.w1.weight": ("I8", (32, 32)), "layers.1.ffn.experts.5.w1.scale": ("F8_E8M0", (32, 2)),
        "layers.1.ffn.experts.5.w2.weight": ("I8", (64, 16)), "layers.1.ffn.experts.5.w2.scale": ("F8_E8M0", (64, 1)),
        "mtp.0.ffn.experts.0.w3.weight": ("I8", (32, 32)),
        "embed.weight": ("BF16", (320, 64)), "head.weight": ("BF16", (320, 64)),
        "layers.2.ffn.gate.weight": ("BF16", (8, 64)), "layers.1.attn.compressor.wkv.weight": ("BF16", (256, 64)),
        "layers.1.attn.indexer.compressor.wgate.weight": ("BF16", (128, 64)),
        "layers.1.attn.indexer.weights_proj.weight": ("BF16", (2, 64)),
        "norm.weight": ("F32", (64,)), "layers.1.attn.kv_norm.weight": ("F32", (128,)),
        "layers.1.attn.compressor.ape": ("F32", (4, 256)), "layers.1.attn.attn_sink": ("F32", (4,)),
        "hc_head_fn": ("F32", (4, 256)), "layers.3.hc_ffn_base": ("F32", (24,)),
        "layers.2.ffn.gate.bias": ("F32", (8,)), "layers.0.ffn.gate.tid2eid": ("I32", (320, 2)),
    }
    for key, (dtype, shape) in groups.items():
        assert (dtypes[key], shapes[key]) == (dtype, shape), key
    n_quantized = sum(official_storage(n) in ("fp8", "fp4") for n in tiny_ckpt_weights)
    assert len(keys) == len(tiny_ckpt_weights) + n_quantized  # every tensor, plus one scale per quantized
    assert all(k.removesuffix(".scale") + ".weight" in keys for k in keys if k.endswith(".scale"))


def test_official_bytes_are_the_codecs(tiny_official_ckpt, tiny_ckpt_weights):
    stored = all_tensors(tiny_official_ckpt)
    for name in ("layers.1.attn.wq_b.weight", "mtp.0.e_proj.weight", "layers.3.ffn.experts.2.w2.weight"):
        encode = low_precision.fp8_quantize_weight if official_storage(name) == "fp8" else low_precision.fp4_quantize_weight
        q, s = encode(tiny_ckpt_weights[name])
        assert torch.equal(stored[name].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(stored[name.removesuffix(".weight") + ".scale"].view(torch.uint8), s.view(torch.uint8))


def test_official_loads_to_codec_values(tiny_official_ckpt, tiny_ckpt_cfg, tiny_ckpt_weights):
    cfg, model = load_checkpoint(tiny_official_ckpt, with_mtp=True)
    assert cfg == tiny_ckpt_cfg
    assert_state_equal(model, decoded_official(tiny_ckpt_weights))
    # FP4 really is lossy here and FP8 too: the test compares decoded values, not the originals
    name = "layers.1.ffn.experts.0.w1.weight"
    assert not torch.equal(model.state_dict()[name], tiny_ckpt_weights[name])


# ---------------------------------------------------------------------------------------
# round trips: both formats, single file and sharded
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["official", "hf"])
@pytest.mark.parametrize("shard_bytes", [None, 30_000])
def test_round_trip(tmp_path, fmt, shard_bytes, tiny_ckpt_cfg, tiny_ckpt_weights):
    ckpt = write_checkpoint(tmp_path, tiny_ckpt_cfg, tiny_ckpt_weights, fmt, shard_bytes=shard_bytes)
    files = sorted(p.name for p in ckpt.glob("*.safetensors"))
    if shard_bytes is None:
        assert files == ["model.safetensors"] and not (ckpt / "model.safetensors.index.json").exists()
    else:
        n = len(files)
        assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(files)
        for fname in files:
            with safe_open(str(ckpt / fname), "pt") as f:
                assert {k for k, v in index["weight_map"].items() if v == fname} == set(f.keys())
    assert detect_format(ckpt) == fmt
    with_mtp = fmt == "official"
    cfg, model = load_checkpoint(ckpt, with_mtp=with_mtp)
    assert cfg == tiny_ckpt_cfg
    ref = decoded_official(tiny_ckpt_weights) if fmt == "official" else tiny_ckpt_weights
    assert_state_equal(model, {n: v for n, v in ref.items() if with_mtp or not n.startswith("mtp.")})


def test_load_in_bf16(tiny_hf_ckpt, tiny_ckpt_weights):
    _, model = load_checkpoint(tiny_hf_ckpt, dtype=torch.bfloat16)
    sd = model.state_dict()
    assert sd["head.weight"].dtype == torch.bfloat16 and sd["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert torch.equal(sd["head.weight"], tiny_ckpt_weights["head.weight"].bfloat16())


def test_hf_in_bf16(tmp_path, tiny_ckpt_cfg, tiny_ckpt_weights):
    ckpt = write_checkpoint(tmp_path, tiny_ckpt_cfg, tiny_ckpt_weights, "hf", hf_dtype=torch.bfloat16)
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == "bfloat16"
    stored = all_tensors(ckpt)
    assert stored["model.layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert {v.dtype for k, v in stored.items() if not k.endswith("tid2eid")} == {torch.bfloat16}
    _, model = load_checkpoint(ckpt)
    assert_state_equal(model, {n: v.bfloat16().float() if v.is_floating_point() else v
                               for n, v in tiny_ckpt_weights.items() if not n.startswith("mtp.")})


def test_mtp_handling(tiny_official_ckpt, tiny_hf_ckpt, tmp_path, tiny_ckpt_cfg, tiny_ckpt_weights):
    _, model = load_checkpoint(tiny_official_ckpt)  # MTP tensors present but not wanted: ignored
    assert not any(n.startswith("mtp.") for n in model.state_dict())
    with pytest.raises(CheckpointError, match=r"missing tensor 'mtp\.0\..*no MTP block"):
        load_checkpoint(tiny_hf_ckpt, with_mtp=True)
    no_mtp = {n: v for n, v in tiny_ckpt_weights.items() if not n.startswith("mtp.")}
    ckpt = write_checkpoint(tmp_path, tiny_ckpt_cfg, no_mtp, "official")
    load_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=r"missing tensor 'mtp\.0\.\S+' \(expected shape \(\d+(, \d+)*\)\)"):
        load_checkpoint(ckpt, with_mtp=True)


# ---------------------------------------------------------------------------------------
# transformers as the oracle
# ---------------------------------------------------------------------------------------

def test_hf_format_is_what_save_pretrained_writes(tmp_path, tiny_hf_ckpt, tiny_ckpt_cfg, tiny_ckpt_weights):
    config = {k: v for k, v in tiny_ckpt_cfg.to_hf_dict().items() if k not in ("model_type", "architectures")}
    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**config)).eval()
    main = {n: v for n, v in tiny_ckpt_weights.items() if not n.startswith("mtp.")}
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(main, tiny_ckpt_cfg.n_routed_experts), strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing)
    hf.save_pretrained(tmp_path)
    ours, theirs = all_tensors(tiny_hf_ckpt), all_tensors(tmp_path)
    assert set(ours) == set(theirs)
    for key, t in theirs.items():
        assert ours[key].dtype == t.dtype and torch.equal(ours[key], t), key
    for fname in ("config.json", "generation_config.json"):
        a = json.loads((tiny_hf_ckpt / fname).read_text())
        b = json.loads((tmp_path / fname).read_text())
        b.pop("transformers_version")
        assert {k: v for k, v in a.items()} == {k: b[k] for k in a}, fname
        assert fname == "generation_config.json" or set(a) == set(b), fname
    assert transformers.DeepseekV4Config.from_pretrained(tiny_hf_ckpt).to_dict() == \
        transformers.DeepseekV4Config.from_pretrained(tmp_path).to_dict()
    assert read_config(tmp_path) == tiny_ckpt_cfg

    # transformers' runtime names (stacked experts) are read too, one expert slice at a time
    hf.save_pretrained(tmp_path / "runtime", save_original_format=False)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in all_tensors(tmp_path / "runtime"))
    _, model = load_checkpoint(tmp_path / "runtime")
    assert_state_equal(model, main)


def _hf_logits(ckpt, ids, **kwargs) -> torch.Tensor:
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, **kwargs)
    # transformers' FP8 path keeps BF16-stored tensors in BF16 even with dtype=float32 (and then
    # fails on mixed dtypes); the upcast is exact.
    hf = hf.float().eval()
    with torch.no_grad():
        return hf, hf(ids[None]).logits[0]


@pytest.mark.parametrize("fmt", ["official", "hf"])
def test_transformers_agrees(fmt, request, prompt, tiny_ckpt_weights, tiny_ckpt_cfg):
    ckpt = request.getfixturevalue(f"tiny_{fmt}_ckpt")
    kwargs = {}
    ref_weights = tiny_ckpt_weights
    if fmt == "official":
        kwargs["quantization_config"] = transformers.FineGrainedFP8Config(dequantize=True)
        ref_weights = decoded_official(tiny_ckpt_weights)
    hf, ref = _hf_logits(ckpt, prompt, **kwargs)
    # transformers decodes our FP8 / FP4 tensors to exactly the values our codecs give
    main = {n: v for n, v in ref_weights.items() if not n.startswith("mtp.")}
    sd = hf.state_dict()
    for key, value in to_hf_state_dict(main, tiny_ckpt_cfg.n_routed_experts).items():
        assert torch.equal(sd[key], value.to(sd[key].dtype)), key
    ours = our_logits(ckpt, prompt)
    assert ours.shape == ref.shape == (PROMPT_LEN, tiny_ckpt_cfg.vocab_size)
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= TOL, rel


# A second shape family: hc_mult 2, window 8, no YaRN, one hash layer, 6 experts.
HC2 = dict(hc_mult=2, sliding_window=8, head_dim=64, qk_rope_head_dim=32, index_head_dim=32, index_topk=96,
           num_hidden_layers=4, compress_ratios=[4, 4, 0, 128, 4], num_hash_layers=1, n_routed_experts=6,
           num_experts_per_tok=3, rope_scaling=None)


@pytest.mark.parametrize("fmt", ["official", "hf"])
def test_transformers_agrees_other_config(tmp_path, fmt, prompt):
    cfg = tiny_config(**HC2)
    weights = random_weights(expected_shapes(cfg, with_mtp=True), cfg, seed=3)
    ckpt = write_checkpoint(tmp_path, cfg, weights, fmt, shard_bytes=20_000)
    kwargs = {"quantization_config": transformers.FineGrainedFP8Config(dequantize=True)} if fmt == "official" else {}
    _, ref = _hf_logits(ckpt, prompt, **kwargs)
    rel = ((our_logits(ckpt, prompt) - ref).abs().max() / ref.abs().max()).item()
    assert rel <= TOL, rel


def test_fp8_blocks_of_partial_size(tmp_path):
    """FP8 dims that are not multiples of 128 (wkv [192, 64], wq_b [1536, 32]) use ceil-div 128×128
    blocks, the last one partial. (transformers 5.23 instead derives the block from the scale
    grid, 192 / 2 = 96 rows, and decodes such weights wrongly, so it is not the oracle here.)"""
    cfg = tiny_config(head_dim=192, num_attention_heads=8, o_groups=4, index_n_heads=4, num_hidden_layers=3,
                      compress_ratios=[128, 0, 4, 0], num_hash_layers=0, q_lora_rank=160)
    weights = random_weights(expected_shapes(cfg, with_mtp=True), cfg, seed=5)
    ckpt = write_checkpoint(tmp_path, cfg, weights, "official")
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert f.get_slice("layers.0.attn.wkv.scale").get_shape() == [2, 1]
        assert f.get_slice("layers.0.attn.wq_a.scale").get_shape() == [2, 1]
    _, model = load_checkpoint(ckpt, with_mtp=True)
    assert_state_equal(model, decoded_official(weights))
    w = weights["layers.0.attn.wkv.weight"]
    rows = model.state_dict()["layers.0.attn.wkv.weight"][128:]  # the partial block's own scale
    assert torch.equal(rows, low_precision.fp8_dequantize_weight(*low_precision.fp8_quantize_weight(w[128:])))


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------

def test_missing_tensor(tmp_path, tiny_official_ckpt, tiny_hf_ckpt):
    def drop(t):
        del t["layers.1.attn.wq_b.weight"], t["layers.1.attn.wq_b.scale"]
    rewrite(tiny_official_ckpt, tmp_path / "off", drop)
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.1\.attn\.wq_b\.weight' \(expected shape \(512, 32\)\)"):
        load_checkpoint(tmp_path / "off")
    rewrite(tiny_hf_ckpt, tmp_path / "hf", lambda t: t.pop("model.layers.2.attn.norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.2\.attn\.kv_norm\.weight' "
                                              r"\(expected shape \(128,\)\) \(looked for 'model\.layers\.2\.attn\.norm\.weight'\)"):
        load_checkpoint(tmp_path / "hf")


def test_extra_tensor(tmp_path, tiny_official_ckpt, tiny_hf_ckpt):
    rewrite(tiny_official_ckpt, tmp_path / "off", lambda t: t.update({"layers.1.attn.bogus.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers\.1\.attn\.bogus\.weight'"):
        load_checkpoint(tmp_path / "off")
    rewrite(tiny_hf_ckpt, tmp_path / "hf", lambda t: t.update({"model.layers.9.mlp.foo": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.9\.mlp\.foo'"):
        load_checkpoint(tmp_path / "hf")
    # an orphan scale (its weight missing) is an unknown tensor, not silently dropped
    rewrite(tiny_official_ckpt, tmp_path / "orphan", lambda t: t.update({"layers.1.attn.zz.scale": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers\.1\.attn\.zz\.scale'"):
        load_checkpoint(tmp_path / "orphan")


def test_misshaped_tensor(tmp_path, tiny_official_ckpt, tiny_hf_ckpt):
    rewrite(tiny_official_ckpt, tmp_path / "norm", lambda t: t.update({"norm.weight": torch.ones(65)}))
    with pytest.raises(CheckpointError, match=r"tensor 'norm\.weight' .*has shape \(65,\), expected \(64,\)"):
        load_checkpoint(tmp_path / "norm")
    name = "layers.3.ffn.experts.1.w2.weight"
    rewrite(tiny_official_ckpt, tmp_path / "fp4", lambda t: t.update({name: t[name][:, :15].contiguous()}))
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.3\.ffn\.experts\.1\.w2\.weight' .*has shape \(64, 15\), "
                                              r"expected \(64, 16\), the packed form of \(64, 32\)"):
        load_checkpoint(tmp_path / "fp4")
    scale = "layers.1.attn.wq_b.scale"
    rewrite(tiny_official_ckpt, tmp_path / "scale", lambda t: t.update({scale: t[scale][:2].contiguous()}))
    with pytest.raises(CheckpointError, match=r"scale tensor 'layers\.1\.attn\.wq_b\.scale' .*has shape \(2, 1\), expected \(4, 1\)"):
        load_checkpoint(tmp_path / "scale")
    key = "model.layers.0.attn.wo_a.weight"
    rewrite(tiny_hf_ckpt, tmp_path / "hf", lambda t: t.update({key: t[key].T.contiguous()}))
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.0\.attn\.wo_a\.weight' \(stored as "
                                              r"'model\.layers\.0\.attn\.wo_a\.weight'\).* has shape \(256, 64\), expected \(64, 256\)"):
        load_checkpoint(tmp_path / "hf")


def test_fp8_weight_without_scale(tmp_path, tiny_official_ckpt):
    rewrite(tiny_official_ckpt, tmp_path / "c", lambda t: t.pop("layers.1.attn.wkv.scale"))
    with pytest.raises(CheckpointError, match=r"'layers\.1\.attn\.wkv\.weight'.*float8_e4m3fn but has no scale"):
        load_checkpoint(tmp_path / "c")


def test_activation_scheme(tmp_path, tiny_official_ckpt, tiny_hf_ckpt):
    """The official format declares dynamic FP8 activations (W8A8 on the GPU); a float checkpoint
    has none; a scheme the format cannot serve is refused by name."""
    assert fp8_activations(tiny_official_ckpt) and not fp8_activations(tiny_hf_ckpt)
    shutil.copytree(tiny_official_ckpt, tmp_path / "c")
    raw = json.loads((tmp_path / "c" / "config.json").read_text())
    raw["quantization_config"]["activation_scheme"] = "static"
    (tmp_path / "c" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"activation_scheme 'static' is not supported"):
        fp8_activations(tmp_path / "c")


def test_missing_config(tmp_path, tiny_official_ckpt):
    shutil.copytree(tiny_official_ckpt, tmp_path / "c")
    (tmp_path / "c" / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path / "c")
    (tmp_path / "empty").mkdir()
    shutil.copy(tiny_official_ckpt / "config.json", tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(tmp_path / "empty")


def test_corrupt_safetensors(tmp_path, tiny_official_ckpt):
    shutil.copytree(tiny_official_ckpt, tmp_path / "garbage")
    (tmp_path / "garbage" / "model.safetensors").write_bytes(b"\x00not a safetensors file" * 10)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unreadable safetensors file"):
        load_checkpoint(tmp_path / "garbage")
    shutil.copytree(tiny_official_ckpt, tmp_path / "truncated")
    path = tmp_path / "truncated" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_checkpoint(tmp_path / "truncated", with_mtp=True)


def test_index_naming_missing_shard(tmp_path, tiny_ckpt_cfg, tiny_ckpt_weights):
    ckpt = write_checkpoint(tmp_path, tiny_ckpt_cfg, tiny_ckpt_weights, "hf", shard_bytes=30_000)
    victim = sorted(ckpt.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"shard '{victim.name}' \(holding '.+'\) does not exist"):
        load_checkpoint(ckpt)
    (ckpt / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        load_checkpoint(ckpt)


def test_writer_validates(tmp_path, tiny_ckpt_cfg, tiny_ckpt_weights):
    w = dict(tiny_ckpt_weights)
    with pytest.raises(CheckpointError, match="format must be one of"):
        write_checkpoint(tmp_path, tiny_ckpt_cfg, w, "gguf")
    with pytest.raises(CheckpointError, match=r"unknown tensor 'x\.weight'"):
        write_checkpoint(tmp_path, tiny_ckpt_cfg, {**w, "x.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"tensor 'head\.weight' has shape \(3,\), expected \(320, 64\)"):
        write_checkpoint(tmp_path, tiny_ckpt_cfg, {**w, "head.weight": torch.zeros(3)})
    odd = tiny_config(moe_intermediate_size=48)
    odd_w = random_weights(expected_shapes(odd, with_mtp=True), odd, seed=0)
    with pytest.raises(CheckpointError, match=r"'layers\.0\.ffn\.experts\.0\.w2\.weight' has shape \(64, 48\): FP4"):
        write_checkpoint(tmp_path, odd, odd_w)
    write_checkpoint(tmp_path, odd, odd_w, "hf")  # unquantized: any shape
    del w["layers.4.ffn.gate.bias"]
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.4\.ffn\.gate\.bias' \(expected shape \(8,\)\)"):
        write_checkpoint(tmp_path, tiny_ckpt_cfg, w)
