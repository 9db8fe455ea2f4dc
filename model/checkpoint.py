"""Checkpoint I/O: write and load DeepSeek-V4 weights in the official and the transformers format.

A checkpoint directory holds `config.json` and either one `model.safetensors` or shards
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json` (`weight_map`). The format
is detected from the tensor names; see :mod:`model.checkpoint_formats` for what each contains.

Loading is lazy: every shard is opened with `safetensors.safe_open` (memory-mapped) and tensors
are read, decoded (FP8 / FP4 → float) and copied into the model one at a time, so at most one
tensor of the checkpoint is materialised at once. Names and shapes are validated against the
model before any data is read; every problem raises :class:`CheckpointError` naming the tensor.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model import checkpoint_formats as fmts
from model.config import ConfigError, ModelConfig
from model.load_progress import CHECKPOINT, LoadProgress, LoadTracker
from model.transformer import Transformer

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
FORMATS = ("official", "hf")
# Fields `DeepseekV4Config.save_pretrained` writes that V4 does not vary (transformers 5.23).
_HF_CONFIG_CONSTANTS = {
    "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
    "mlp_bias": False, "num_key_value_heads": 1, "output_router_logits": False, "pad_token_id": None,
    "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "use_cache": True,
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded into (or written from) the model."""


# ---------------------------------------------------------------------------------------
# expected tensors
# ---------------------------------------------------------------------------------------

def expected_shapes(cfg: ModelConfig, with_mtp: bool = False) -> dict[str, torch.Size]:
    """Official name → shape of every tensor `Transformer(cfg, with_mtp)` holds."""
    with torch.device("meta"):
        model = Transformer(cfg, with_mtp=with_mtp)
    return {k: v.shape for k, v in model.state_dict().items()}


def _fmt_shape(shape) -> str:
    return str(tuple(int(s) for s in shape))


# ---------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------

def write_checkpoint(out_dir: str | os.PathLike, cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                     fmt: str = "official", shard_bytes: int | None = None,
                     hf_dtype: torch.dtype = torch.float32, hf_mtp: bool = False) -> Path:
    """Write `tensors` (official names, float32; int32 `tid2eid`) as a checkpoint in `out_dir`.

    `fmt="official"`: FP8/FP4-quantized hub layout with `mtp.*` (when given) and a
    `quantization_config`; `fmt="hf"`: what `DeepseekV4ForCausalLM.save_pretrained` writes for a
    model in `hf_dtype` (no MTP; with `hf_mtp` the `mtp.*` tensors are added under their official
    names, which the loader reads for speculative decoding). `shard_bytes` splits the tensors
    into shards of at most that many bytes (a single larger tensor gets a shard of its own) plus
    an index json.
    """
    if fmt not in FORMATS:
        raise CheckpointError(f"checkpoint format must be one of {FORMATS}, got {fmt!r}")
    _check_tensors(cfg, tensors)
    if fmt == "official":
        bad = [n for n in tensors if fmts.official_storage(n) == "fp4" and tensors[n].shape[-1] % fmts.FP4_BLOCK]
        if bad:
            raise CheckpointError(f"tensor {bad[0]!r} has shape {_fmt_shape(tensors[bad[0]].shape)}: FP4 experts "
                                  f"need the input dim to be a multiple of {fmts.FP4_BLOCK}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "official":
        write_config(out, cfg)
    else:
        config = {**cfg.to_hf_dict(), **_HF_CONFIG_CONSTANTS, "qk_rope_head_dim": cfg.qk_rope_head_dim,
                  "dtype": str(hf_dtype).removeprefix("torch.")}
        generation = {"_from_model_config": True, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
        (out / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
        (out / CONFIG_FILE).write_text(json.dumps(dict(sorted(config.items())), indent=2) + "\n")

    def stored() -> Iterator[tuple[str, torch.Tensor]]:
        for name in sorted(tensors):
            if fmt == "official":
                yield from fmts.encode_official(name, tensors[name]).items()
            elif hf_mtp or not name.startswith("mtp."):
                yield fmts.encode_hf(name, tensors[name], hf_dtype)

    for stale in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    _write_shards(out, stored(), shard_bytes)
    return out


def _check_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """The tensors must be exactly the model's (MTP ones all or none), with the model's shapes."""
    shapes = expected_shapes(cfg, with_mtp=True)
    unknown = sorted(set(tensors) - set(shapes))
    if unknown:
        raise CheckpointError(f"unknown tensor {unknown[0]!r} (not a parameter of this config's model)")
    has_mtp = any(n.startswith("mtp.") for n in tensors)
    for name, shape in shapes.items():
        if name not in tensors:
            if name.startswith("mtp.") and not has_mtp:
                continue
            raise CheckpointError(f"missing tensor {name!r} (expected shape {_fmt_shape(shape)})")
        if tuple(tensors[name].shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {_fmt_shape(tensors[name].shape)}, "
                                  f"expected {_fmt_shape(shape)}")


def _write_shards(out: Path, items: Iterator[tuple[str, torch.Tensor]], shard_bytes: int | None) -> None:
    metadata = {"format": "pt"}
    if shard_bytes is None:
        save_file(dict(items), str(out / SINGLE_FILE), metadata=metadata)
        return
    if shard_bytes <= 0:
        raise CheckpointError(f"shard_bytes must be positive, got {shard_bytes}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for key, t in items:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
        total += nbytes
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(out / fname), metadata=metadata)
        weight_map.update({key: fname for key in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def write_config(out_dir: str | os.PathLike, cfg: ModelConfig) -> Path:
    """The official `config.json` of `cfg` (FP4 experts, FP8 projections with dynamic activation
    scaling, as the hub's V4 checkpoints declare) in `out_dir`: all the `dummy` load format reads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = cfg.to_official_dict()
    config["expert_dtype"] = "fp4"
    config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = dict(fmts.QUANTIZATION_CONFIG)
    path = out / CONFIG_FILE
    path.write_text(json.dumps(dict(sorted(config.items())), indent=2) + "\n")
    return path


# ---------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------

def read_config(ckpt_dir: str | os.PathLike) -> ModelConfig:
    path = Path(ckpt_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir}: no {CONFIG_FILE} (not a checkpoint directory?)")
    try:
        return ModelConfig.from_json(path)
    except ConfigError as e:
        raise CheckpointError(str(e)) from e


def fp8_activations(ckpt_dir: str | os.PathLike) -> bool:
    """Whether the checkpoint's FP8 projections quantise their inputs on the fly (W8A8): its
    `quantization_config` says `"activation_scheme": "dynamic"`, as the official V4 checkpoints
    do. A checkpoint without one (float weights) runs bf16 activations. "static" would need
    per-tensor input scales, which no V4 checkpoint carries: refused with the scheme named."""
    path = Path(ckpt_dir) / CONFIG_FILE
    try:
        quant_cfg = json.loads(path.read_text()).get("quantization_config") or {}
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from e
    scheme = quant_cfg.get("activation_scheme")
    if scheme not in (None, "dynamic"):
        raise CheckpointError(f"{path}: quantization_config.activation_scheme {scheme!r} is not supported "
                              "(only 'dynamic': FP8 activations scaled per 128 on the fly)")
    return scheme == "dynamic" and quant_cfg.get("quant_method", "fp8") == "fp8"


def _weight_block(ckpt_dir: Path) -> tuple[int, int]:
    try:
        raw = json.loads((ckpt_dir / CONFIG_FILE).read_text())
        block = (raw.get("quantization_config") or {}).get("weight_block_size") or [fmts.FP8_BLOCK] * 2
        return int(block[0]), int(block[1])
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        return fmts.FP8_BLOCK, fmts.FP8_BLOCK


def tensor_files(ckpt_dir: str | os.PathLike) -> dict[str, Path]:
    """Key → shard file, from the index json, else from every `*.safetensors` file's header."""
    root = Path(ckpt_dir)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = {}
        for key, fname in weight_map.items():
            path = root / fname
            if fname not in files and not path.is_file():
                raise CheckpointError(f"{index}: shard {fname!r} (holding {key!r}) does not exist")
            files[fname] = path
        return {key: files[fname] for key, fname in weight_map.items()}
    paths = sorted(root.glob("*.safetensors"))
    if not paths:
        raise CheckpointError(f"{ckpt_dir}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors files")
    out: dict[str, Path] = {}
    for path in paths:
        for key in _open(path).keys():
            if key in out:
                raise CheckpointError(f"tensor {key!r} appears in both {out[key].name} and {path.name}")
            out[key] = path
    return out


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types (and OSError)
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from e


class _Reader:
    """Open shards (memory-mapped) and per-tensor reads with clear errors."""

    def __init__(self, files: dict[str, Path], stack: ExitStack):
        self.files, self.stack, self.handles = files, stack, {}

    def handle(self, key: str):
        path = self.files[key]
        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(_open(path))
        return self.handles[path]

    def _slice(self, key: str):
        path = self.files[key]
        try:
            return self.handle(key).get_slice(key)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"tensor {key!r} cannot be read from {path.name} ({e})") from e

    def shape_dtype(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        sl = self._slice(key)
        return tuple(sl.get_shape()), _DTYPES.get(sl.get_dtype(), torch.float32)

    def read(self, key: str, index: tuple | None = None) -> torch.Tensor:
        try:
            if index is None:
                return self.handle(key).get_tensor(key)
            e, half = index
            sl = self._slice(key)
            t = sl[e:e + 1][0]
            if half is not None:
                rows = t.shape[0] // 2
                t = t[half * rows:(half + 1) * rows]
            return t
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"tensor {key!r} cannot be read from {self.files[key].name} ({exc})") from exc


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def detect_format(ckpt_dir: str | os.PathLike) -> str:
    """'official' or 'hf', from the tensor names."""
    try:
        return fmts.detect_format(set(tensor_files(ckpt_dir)))
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{ckpt_dir}: {e}") from e


def load_weights(model: Transformer, ckpt_dir: str | os.PathLike,
                 progress: Callable[[LoadProgress], None] | None = None) -> str:
    """Copy the checkpoint's tensors into `model` (its MTP block too when it has one).

    MTP tensors in the checkpoint are ignored when the model has no MTP block. Returns the
    detected format. `progress` is told the shards and bytes read so far: once before any
    data, then after every tensor (`model.load_progress`). Shards are read one after another, so
    a shard counts as done once every tensor read from it is.
    """
    root = Path(ckpt_dir)
    files = tensor_files(root)
    try:
        fmt = fmts.detect_format(set(files))
    except ValueError as e:
        raise CheckpointError(f"{ckpt_dir}: {e}") from e
    params = model.state_dict(keep_vars=True)
    expected = list(params)
    with_mtp = any(n.startswith("mtp.") for n in expected)
    sources, unknown, dups = fmts.plan_sources(fmt, set(files), expected, model.cfg.n_routed_experts)
    if not with_mtp:
        unknown = [k for k in unknown if not k.startswith(("mtp.", "model.mtp."))]
    if unknown:
        raise CheckpointError(f"unexpected tensor {unknown[0]!r} in {files[unknown[0]].name} "
                              f"(not a parameter of the model; {len(unknown)} unknown in all)")
    if dups:
        name, key = dups[0]
        raise CheckpointError(f"tensor {name!r} is stored twice (as {sources[name].key!r} and {key!r})")
    missing = [n for n in expected if n not in sources]
    if missing:
        name = missing[0]
        hint = ""
        if name.startswith("mtp.") and not any(n.startswith("mtp.") for n in sources):
            hint = "; the checkpoint has no MTP block (mtp.*): load it without MTP"
        elif fmt == "hf":
            hint = f" (looked for {fmts.hf_saved_name(name)!r})"
        raise CheckpointError(f"missing tensor {name!r} (expected shape {_fmt_shape(params[name].shape)})"
                              f"{hint}; {len(missing)} missing in all")
    block = _weight_block(root)
    with ExitStack() as stack, torch.no_grad():
        reader = _Reader(files, stack)
        # validate every shape before reading any data
        nbytes = {name: _check_stored(reader, name, sources[name], params[name].shape, block) for name in expected}
        order, reads = fmts.shard_order(expected, sources, files)
        tracker = LoadTracker(progress, CHECKPOINT, "shards", len(reads), sum(nbytes.values()))
        for name in order:
            src = sources[name]
            scale = reader.read(src.scale_key) if src.scale_key else None
            value = fmts.decode(reader.read(src.key, src.index), scale, block)
            params[name].copy_(value.to(params[name].dtype))
            finished = 0
            for key in (src.key, src.scale_key) if src.scale_key else (src.key,):
                reads[files[key]] -= 1
                finished += reads[files[key]] == 0
            tracker.step(finished, nbytes[name])
    return fmt


def _check_stored(reader: _Reader, name: str, src: fmts.Source, expected: torch.Size,
                  block: tuple[int, int]) -> int:
    """Refuses a stored tensor (or its scale) of the wrong shape or kind; → the bytes to read for it."""
    shape, dtype = reader.shape_dtype(src.key)
    if src.index is not None:  # stacked experts [E, 2I or D, ...] → one expert's (half) slice
        shape = shape[1:]
        if src.index[1] is not None:
            shape = (shape[0] // 2,) + shape[1:] if shape else shape
    quantized = dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or (
        dtype in (torch.int8, torch.uint8) and src.scale_key is not None)
    if quantized and src.scale_key is None:
        raise CheckpointError(f"tensor {name!r} ({src.key!r}) is {dtype} but has no scale tensor")
    if src.scale_key is not None and not quantized:
        raise CheckpointError(f"tensor {name!r} ({src.key!r}) is {dtype} but has a scale "
                              f"{src.scale_key!r}; only FP8/FP4 weights carry scales")
    want, want_scale = fmts.stored_shape(expected, dtype, src.scale_key is not None, block)
    where = f" in {reader.files[src.key].name}"
    label = repr(name) if src.key == name else f"{name!r} (stored as {src.key!r})"
    if tuple(shape) != want:
        note = "" if want == tuple(expected) else f", the packed form of {_fmt_shape(expected)}"
        raise CheckpointError(f"tensor {label}{where} has shape {_fmt_shape(shape)}, "
                              f"expected {_fmt_shape(want)}{note}")
    nbytes = math.prod(shape) * dtype.itemsize
    if src.scale_key is not None:
        got, scale_dtype = reader.shape_dtype(src.scale_key)
        if tuple(got) != want_scale:
            raise CheckpointError(f"scale tensor {src.scale_key!r} of {name!r} has shape {_fmt_shape(got)}, "
                                  f"expected {_fmt_shape(want_scale)}")
        nbytes += math.prod(got) * scale_dtype.itemsize
    return nbytes


def load_checkpoint(ckpt_dir: str | os.PathLike, dtype: torch.dtype = torch.float32, with_mtp: bool = False,
                    device: str | torch.device = "cpu", progress: Callable[[LoadProgress], None] | None = None
                    ) -> tuple[ModelConfig, Transformer]:
    """Read `config.json`, build the model (with its MTP block if `with_mtp`) and load the weights
    (telling `progress` how far, as `load_weights`)."""
    cfg = read_config(ckpt_dir)
    if with_mtp and cfg.num_nextn_predict_layers == 0:
        raise CheckpointError(f"{ckpt_dir}: with_mtp requested but config has num_nextn_predict_layers=0")
    tensor_files(ckpt_dir)  # fail on missing / corrupt files before building the model
    with torch.device(device):
        model = Transformer(cfg, with_mtp=with_mtp).to(dtype)
    load_weights(model, ckpt_dir, progress=progress)
    return cfg, model.eval()
