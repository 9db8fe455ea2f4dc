"""config.json parsing in both key styles; invalid configs name the offending field."""

import json

import pytest

from model.config import ConfigError, ModelConfig
from model.tiny import TINY_CONFIG, tiny_config


def test_official_and_hf_styles_agree():
    cfg = tiny_config()
    assert ModelConfig.from_dict(cfg.to_official_dict()) == cfg
    assert ModelConfig.from_dict(cfg.to_hf_dict()) == cfg
    assert cfg.compress_ratios == (0, 4, 128, 4, 128) and cfg.mtp_compress_ratio == 0
    assert cfg.num_hash_layers == 2 and cfg.qk_rope_head_dim == 64
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 4.0


def test_transformers_accepts_our_hf_dict():
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV4Config(**{k: v for k, v in tiny_config().to_hf_dict().items()
                                          if k not in ("model_type", "architectures")})
    assert hf.layer_types[1] == "compressed_sparse_attention"
    assert hf.mlp_layer_types[:3] == ["hash_moe", "hash_moe", "moe"]
    assert hf.rope_parameters["compress"]["rope_type"] == "yarn"


def test_from_json_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    assert ModelConfig.from_json(path) == tiny_config()
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(path)
    with pytest.raises(ConfigError, match="no such config"):
        ModelConfig.from_json(tmp_path / "missing.json")


def test_digest_is_stable_and_sensitive():
    assert tiny_config().digest() == tiny_config().digest()
    assert tiny_config().digest() != tiny_config(sliding_window=32).digest()


@pytest.mark.parametrize("override, message", [
    ({"compress_ratios": [0, 4, 64, 4, 128]}, "'compress_ratios' has ratios \\[64\\]"),
    ({"compress_ratios": [0, 4]}, "'compress_ratios' has 2 entries, fewer than num_hidden_layers=5"),
    ({"o_groups": 3}, "'o_groups' \\(3\\) must divide num_attention_heads \\(4\\)"),
    ({"num_experts_per_tok": 9}, "'num_experts_per_tok'"),
    ({"hidden_size": "64"}, "'hidden_size' must be an integer"),
    ({"hidden_size": 0}, "'hidden_size' must be >= 1"),
    ({"scoring_func": "relu"}, "'scoring_func'"),
    ({"qk_rope_head_dim": 63}, "'qk_rope_head_dim'"),
    ({"model_type": "llama"}, "'model_type'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "'rope_scaling' lacks 'original_max_position_embeddings'"),
    ({"eos_token_id": 5000}, "'eos_token_id'"),
])
def test_invalid_configs_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**TINY_CONFIG, **override})


def test_missing_field_is_named():
    raw = dict(TINY_CONFIG)
    del raw["head_dim"]
    with pytest.raises(ConfigError, match="'head_dim' is missing"):
        ModelConfig.from_dict(raw)


def test_hf_style_errors():
    hf = tiny_config().to_hf_dict()
    with pytest.raises(ConfigError, match="'layer_types' has unknown kinds"):
        ModelConfig.from_dict({**hf, "layer_types": ["sliding_attention", "full_attention"] + hf["layer_types"][2:]})
    with pytest.raises(ConfigError, match="'layer_types' must list num_hidden_layers=5"):
        ModelConfig.from_dict({**hf, "layer_types": hf["layer_types"][:3]})
    with pytest.raises(ConfigError, match="'mlp_layer_types': hash_moe layers must come first"):
        ModelConfig.from_dict({**hf, "mlp_layer_types": ["moe", "hash_moe", "moe", "moe", "moe"]})
    with pytest.raises(ConfigError, match="'layer_types' and 'compress_ratios' disagree"):
        ModelConfig.from_dict({**tiny_config().to_official_dict(), "layer_types": list(reversed(hf["layer_types"]))})
