"""DeepSeek-V4 model configuration: `config.json` → one frozen dataclass.

Two key styles exist in the wild and both are accepted:

* official / legacy (the DeepSeek hub `config.json`): per-layer `compress_ratios` (0, 4, 128),
  `num_hash_layers`, `qk_rope_head_dim`, flat YaRN `rope_scaling`;
* transformers (`DeepseekV4Config.save_pretrained`): `layer_types`, `mlp_layer_types`,
  `compress_rates`, `partial_rotary_factor`, nested `rope_parameters` {"main", "compress"}.

Both normalise to :class:`ModelConfig`, whose field names are the `config.json` names. Every
constraint is checked once here; an invalid config raises :class:`ConfigError` naming the field.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

LAYER_TYPE_TO_RATIO = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}
RATIO_TO_LAYER_TYPE = {v: k for k, v in LAYER_TYPE_TO_RATIO.items()}
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")


class ConfigError(ValueError):
    """A `config.json` that cannot describe a valid DeepSeek-V4 model."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency interpolation, applied only on compressed (ratio > 0) layers."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a DeepSeek-V4 checkpoint (names as in `config.json`).

    Shapes below use D = hidden_size, H = num_attention_heads, d = head_dim,
    r = qk_rope_head_dim, E = n_routed_experts.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    compress_ratios: tuple[int, ...]
    num_hash_layers: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: YarnScaling | None
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    max_position_embeddings: int
    num_nextn_predict_layers: int
    bos_token_id: int | None
    eos_token_id: int | None
    tie_word_embeddings: bool = False
    mtp_compress_ratio: int = 0  # the MTP block's attention kind (official: compress_ratios[N])

    # --- derived views -------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    def attention_ratios(self, with_mtp: bool = False) -> tuple[int, ...]:
        """Compress ratio of every attention layer; the MTP block is layer N when included."""
        return self.compress_ratios + ((self.mtp_compress_ratio,) if with_mtp else ())

    def layers_with_ratio(self, ratio: int, with_mtp: bool = False) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.attention_ratios(with_mtp)) if r == ratio)

    def digest(self) -> str:
        """Stable hash of every field: peers exchanging KV must agree on it."""
        blob = json.dumps(asdict(self), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # --- construction --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        return _parse(raw)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"{path}: no such config file") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a JSON object")
        return _parse(raw)

    def to_official_dict(self) -> dict[str, Any]:
        """The official (legacy-key) `config.json` this config was or could be read from."""
        out: dict[str, Any] = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "rope_scaling":
                value = None if value is None else {"type": "yarn", **asdict(value)}
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        mtp_ratio = out.pop("mtp_compress_ratio")
        out["compress_ratios"] = out["compress_ratios"] + [mtp_ratio] * self.num_nextn_predict_layers
        return out

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers-style `config.json` (`layer_types`, `rope_parameters`, ...)."""
        out = self.to_official_dict()
        ratios = out.pop("compress_ratios")[: self.num_hidden_layers]
        n_hash = out.pop("num_hash_layers")
        rope_dim = out.pop("qk_rope_head_dim")
        scaling = out.pop("rope_scaling")
        out["layer_types"] = [RATIO_TO_LAYER_TYPE[r] for r in ratios]
        out["mlp_layer_types"] = ["hash_moe"] * n_hash + ["moe"] * (len(ratios) - n_hash)
        out["partial_rotary_factor"] = rope_dim / self.head_dim
        compress: dict[str, Any] = {"rope_type": "default", "rope_theta": self.compress_rope_theta}
        if scaling is not None:
            compress = {
                "rope_type": "yarn",
                "rope_theta": self.compress_rope_theta,
                "factor": scaling["factor"],
                "original_max_position_embeddings": scaling["original_max_position_embeddings"],
                "beta_fast": scaling["beta_fast"],
                "beta_slow": scaling["beta_slow"],
                "attention_factor": 1.0,
            }
        compress["partial_rotary_factor"] = rope_dim / self.head_dim
        out["rope_parameters"] = {
            "main": {"rope_type": "default", "rope_theta": self.rope_theta,
                     "partial_rotary_factor": rope_dim / self.head_dim},
            "compress": compress,
        }
        out["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        return out


# ---------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------

_DEFAULTS: dict[str, Any] = {
    "n_shared_experts": 1,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}

_REQUIRED_INTS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "q_lora_rank", "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts",
    "num_experts_per_tok", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
    "hc_mult",
)


def _get(raw: dict[str, Any], key: str) -> Any:
    if key in raw and raw[key] is not None:
        return raw[key]
    if key in _DEFAULTS:
        return _DEFAULTS[key]
    raise ConfigError(f"config field '{key}' is missing")


def _int(raw: dict[str, Any], key: str, minimum: int = 1) -> int:
    value = _get(raw, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config field '{key}' must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"config field '{key}' must be >= {minimum}, got {value}")
    return value


def _float(raw: dict[str, Any], key: str) -> float:
    value = _get(raw, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"config field '{key}' must be a finite number, got {value!r}")
    return float(value)


def _compress_ratios(raw: dict[str, Any], n_layers: int) -> tuple[tuple[int, ...], int]:
    """Per-layer ratios of the main layers, and the MTP block's ratio (0 when not listed)."""
    if raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        if not isinstance(ratios, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ratios):
            raise ConfigError("config field 'compress_ratios' must be a list of integers")
        bad = sorted({r for r in ratios if r not in RATIO_TO_LAYER_TYPE})
        if bad:
            raise ConfigError(f"config field 'compress_ratios' has ratios {bad}; each must be one of 0, 4, 128")
        # The official config lists MTP layers after the main ones; only the first n are ours.
        if len(ratios) < n_layers:
            raise ConfigError(
                f"config field 'compress_ratios' has {len(ratios)} entries, fewer than num_hidden_layers={n_layers}")
        mtp = ratios[n_layers] if len(ratios) > n_layers else 0
        ratios = ratios[:n_layers]
        if raw.get("layer_types") is not None:
            if [RATIO_TO_LAYER_TYPE[r] for r in ratios] != list(raw["layer_types"][:n_layers]):
                raise ConfigError("config fields 'layer_types' and 'compress_ratios' disagree")
        return tuple(ratios), mtp
    types = raw.get("layer_types")
    if types is None:
        raise ConfigError("config needs 'compress_ratios' or 'layer_types' (per-layer attention kind)")
    if not isinstance(types, list) or len(types) != n_layers:
        raise ConfigError(f"config field 'layer_types' must list num_hidden_layers={n_layers} entries")
    bad = sorted({t for t in types if t not in LAYER_TYPE_TO_RATIO})
    if bad:
        raise ConfigError(f"config field 'layer_types' has unknown kinds {bad}; allowed: {list(LAYER_TYPE_TO_RATIO)}")
    rates = raw.get("compress_rates") or {}
    for kind, expected in (("compressed_sparse_attention", 4), ("heavily_compressed_attention", 128)):
        if rates.get(kind, expected) != expected:
            raise ConfigError(f"config field 'compress_rates.{kind}' must be {expected}, got {rates[kind]}")
    return tuple(LAYER_TYPE_TO_RATIO[t] for t in types), 0


def _num_hash_layers(raw: dict[str, Any], n_layers: int) -> int:
    if raw.get("mlp_layer_types") is not None:
        types = raw["mlp_layer_types"]
        if not isinstance(types, list) or len(types) != n_layers:
            raise ConfigError(f"config field 'mlp_layer_types' must list num_hidden_layers={n_layers} entries")
        bad = sorted({t for t in types if t not in ("hash_moe", "moe")})
        if bad:
            raise ConfigError(f"config field 'mlp_layer_types' has unknown kinds {bad}; allowed: hash_moe, moe")
        n_hash = types.count("hash_moe")
        if types[:n_hash] != ["hash_moe"] * n_hash:
            raise ConfigError("config field 'mlp_layer_types': hash_moe layers must come first")
        return n_hash
    n_hash = raw.get("num_hash_layers", 3)
    if isinstance(n_hash, bool) or not isinstance(n_hash, int) or not 0 <= n_hash:
        raise ConfigError(f"config field 'num_hash_layers' must be a non-negative integer, got {n_hash!r}")
    return min(n_hash, n_layers)


def _rope(raw: dict[str, Any], head_dim: int) -> tuple[int, float, float, YarnScaling | None]:
    """Returns (qk_rope_head_dim, rope_theta, compress_rope_theta, yarn)."""
    rope_theta = _float(raw, "rope_theta")
    compress_theta = _float(raw, "compress_rope_theta")
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("main"), dict):
        rope_theta = float(params["main"].get("rope_theta", rope_theta))
        scaling_src = params.get("compress") or {}
        compress_theta = float(scaling_src.get("rope_theta", compress_theta))
    else:
        scaling_src = raw.get("rope_scaling") or (params if isinstance(params, dict) else {}) or {}
    if raw.get("qk_rope_head_dim") is not None:
        rope_dim = _int(raw, "qk_rope_head_dim")
    elif raw.get("partial_rotary_factor") is not None:
        rope_dim = int(head_dim * float(raw["partial_rotary_factor"]))
    else:
        rope_dim = 64
    kind = scaling_src.get("rope_type", scaling_src.get("type", "default")) if scaling_src else "default"
    if kind not in ("default", "yarn"):
        raise ConfigError(f"config field 'rope_scaling.type' must be 'yarn' (or absent), got {kind!r}")
    yarn = None
    if kind == "yarn":
        try:
            yarn = YarnScaling(
                factor=float(scaling_src["factor"]),
                original_max_position_embeddings=int(scaling_src["original_max_position_embeddings"]),
                beta_fast=float(scaling_src.get("beta_fast") or 32),
                beta_slow=float(scaling_src.get("beta_slow") or 1),
            )
        except KeyError as e:
            raise ConfigError(f"config field 'rope_scaling' lacks {e.args[0]!r}") from e
        if yarn.factor < 1:
            raise ConfigError(f"config field 'rope_scaling.factor' must be >= 1, got {yarn.factor}")
    return rope_dim, rope_theta, compress_theta, yarn


def _parse(raw: dict[str, Any]) -> ModelConfig:
    if raw.get("model_type") not in (None, "deepseek_v4"):
        raise ConfigError(f"config field 'model_type' is {raw['model_type']!r}, expected 'deepseek_v4'")
    ints = {k: _int(raw, k) for k in _REQUIRED_INTS}
    n_layers = ints["num_hidden_layers"]
    rope_dim, rope_theta, compress_theta, yarn = _rope(raw, ints["head_dim"])
    eos = raw.get("eos_token_id", _DEFAULTS["eos_token_id"])
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    ratios, mtp_ratio = _compress_ratios(raw, n_layers)
    cfg = ModelConfig(
        **ints,
        qk_rope_head_dim=rope_dim,
        n_shared_experts=_int(raw, "n_shared_experts", minimum=0),
        compress_ratios=ratios,
        mtp_compress_ratio=mtp_ratio,
        num_hash_layers=_num_hash_layers(raw, n_layers),
        hc_sinkhorn_iters=_int(raw, "hc_sinkhorn_iters"),
        hc_eps=_float(raw, "hc_eps"),
        rms_norm_eps=_float(raw, "rms_norm_eps"),
        rope_theta=rope_theta,
        compress_rope_theta=compress_theta,
        rope_scaling=yarn,
        scoring_func=str(_get(raw, "scoring_func")),
        norm_topk_prob=bool(_get(raw, "norm_topk_prob")),
        routed_scaling_factor=_float(raw, "routed_scaling_factor"),
        swiglu_limit=_float(raw, "swiglu_limit"),
        max_position_embeddings=_int(raw, "max_position_embeddings"),
        num_nextn_predict_layers=_int(raw, "num_nextn_predict_layers", minimum=0),
        bos_token_id=raw.get("bos_token_id", _DEFAULTS["bos_token_id"]),
        eos_token_id=eos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )
    validate(cfg)
    return cfg


def validate(cfg: ModelConfig) -> None:
    """Constraints the V4 architecture needs (seed 003 §3.4 and the module shapes)."""
    checks = [
        (cfg.num_attention_heads % cfg.o_groups == 0,
         f"'o_groups' ({cfg.o_groups}) must divide num_attention_heads ({cfg.num_attention_heads})"),
        (0 < cfg.qk_rope_head_dim <= cfg.head_dim and cfg.qk_rope_head_dim % 2 == 0,
         f"'qk_rope_head_dim' ({cfg.qk_rope_head_dim}) must be even and within head_dim ({cfg.head_dim})"),
        (cfg.qk_rope_head_dim <= cfg.index_head_dim,
         f"'qk_rope_head_dim' ({cfg.qk_rope_head_dim}) must not exceed index_head_dim ({cfg.index_head_dim})"),
        (cfg.num_experts_per_tok <= cfg.n_routed_experts,
         f"'num_experts_per_tok' ({cfg.num_experts_per_tok}) exceeds n_routed_experts ({cfg.n_routed_experts})"),
        (cfg.scoring_func in SCORING_FUNCS,
         f"'scoring_func' must be one of {SCORING_FUNCS}, got {cfg.scoring_func!r}"),
        (cfg.swiglu_limit >= 0, f"'swiglu_limit' must be >= 0, got {cfg.swiglu_limit}"),
        (cfg.n_shared_experts <= 1, f"'n_shared_experts' must be 0 or 1, got {cfg.n_shared_experts}"),
        (cfg.num_nextn_predict_layers <= 1,
         f"'num_nextn_predict_layers' must be 0 or 1, got {cfg.num_nextn_predict_layers}"),
        (cfg.eos_token_id is None or 0 <= cfg.eos_token_id < cfg.vocab_size,
         f"'eos_token_id' ({cfg.eos_token_id}) out of range for vocab_size {cfg.vocab_size}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"config field {message}")
