"""The `v4serve` command line: make-tiny, generate, and their errors (one line, exit status 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from model.checkpoint import detect_format, load_checkpoint
from model.tokenizer import ByteTokenizer, load_tokenizer


def v4serve(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True, timeout=300)
    if check:
        assert out.returncode == 0, out.stderr
    return out


# the HF format again: the same CLI in subprocesses, so CI runs it and the fast tier does not
@pytest.fixture(scope="module", params=["official", pytest.param("hf", marks=pytest.mark.slow)])
def tiny_dir(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"cli_{request.param}")
    result = v4serve("make-tiny", "--out", str(out), "--seed", "3", "--format", request.param)
    assert json.loads(result.stdout.strip().splitlines()[-1])["format"] == request.param
    return out


def test_make_tiny_has_every_layer_kind(tiny_dir):
    cfg, model = load_checkpoint(tiny_dir)
    assert set(cfg.compress_ratios) == {0, 4, 128} and cfg.hc_mult == 4
    assert 0 < cfg.num_hash_layers < cfg.num_hidden_layers and cfg.sliding_window < 64


def test_generate_greedy_matches_transformers_greedy(tiny_dir):
    transformers = pytest.importorskip("transformers")
    prompt = [5, 77, 200, 31] * 20
    result = v4serve("generate", "--model", str(tiny_dir), "--prompt-ids", ",".join(map(str, prompt)),
                     "--max-new-tokens", "8", "--temperature", "0")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    cfg, model = load_checkpoint(tiny_dir)
    if detect_format(tiny_dir) == "hf":
        hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    else:
        hf = transformers.DeepseekV4ForCausalLM.from_pretrained(
            tiny_dir, quantization_config=transformers.FineGrainedFP8Config(dequantize=True)).float().eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == cfg.eos_token_id:
                break
    assert out["token_ids"] == ids[len(prompt):]
    assert out["text"] == ByteTokenizer(cfg.vocab_size).decode(out["token_ids"])


# the official layout in the CI subset (the HF layout's case adds ~14 s on a 2-core machine; both
# layouts load through the same code once read, which the greedy test above covers for each)
@pytest.mark.parametrize("tiny_dir", ["official", pytest.param("hf", marks=pytest.mark.exhaustive)], indirect=True)
def test_generate_logits_out_and_sampling_is_reproducible(tiny_dir, tmp_path):
    args = ["generate", "--model", str(tiny_dir), "--prompt", "héllo wörld", "--max-new-tokens", "6",
            "--temperature", "0.9", "--top-p", "0.9", "--seed", "11", "--chunk-size", "3"]
    first = json.loads(v4serve(*args, "--logits-out", str(tmp_path / "l.npy")).stdout.strip().splitlines()[-1])
    again = json.loads(v4serve(*args[:-2], "--chunk-size", "5").stdout.strip().splitlines()[-1])
    assert first["token_ids"] == again["token_ids"]  # chunking does not change sampled tokens
    logits = np.load(tmp_path / "l.npy")
    assert logits.dtype == np.float32 and logits.shape == (len(first["token_ids"]), 320)
    assert np.isfinite(logits).all()
    packed = json.loads(v4serve(*args[:-2], "--kv-dtype", "fp8_pack").stdout.strip().splitlines()[-1])
    assert len(packed["token_ids"]) == len(first["token_ids"])


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1,x,3"], "--prompt-ids must be comma-separated integers"),
    (["--prompt-ids", "1,999999"], "out of range"),
    (["--prompt", "a" * 5000], "exceeds the model's max_position_embeddings"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["--prompt", "hi", "--kv-dtype", "fp16"], "invalid choice"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "expected a positive integer"),
])
def test_generate_bad_input_one_line_error(tiny_dir, args, message):
    base = ["generate", "--model", str(tiny_dir), "--max-new-tokens", "2"]
    if "--max-new-tokens" in args:
        base = base[:-2]
    out = v4serve(*base, *args, check=False)
    assert out.returncode == 2
    assert message in out.stderr and out.stdout == ""


def test_generate_missing_model_dir(tmp_path):
    out = v4serve("generate", "--model", str(tmp_path / "nope"), "--prompt", "x", "--max-new-tokens", "1",
                  check=False)
    assert out.returncode == 2 and "config.json" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_tokenizer_json_is_used_when_present(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<｜end▁of▁sentence｜>": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path, vocab_size=4, bos_id=None, eos_id=3)
    assert loaded.encode("hello world") == [1, 2] and loaded.eos_id == 3
    assert loaded.decode([1, 2]) == "hello world"
    assert isinstance(load_tokenizer(tmp_path / "elsewhere", 320, 256, 257), ByteTokenizer)


@pytest.mark.parametrize("extra, message", [
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key must be given together"),
    (["--autoscale", "policy", "--autoscale-config", "{cfg}"], "unknown autoscaler settings"),
    (["--api-key-file", "/nonexistent/keys"], "--api-key-file"),
    (["--device", "cuda"], "--device cuda needs --gpus-per-worker"),
    (["--kernels", "triton"], "--kernels triton needs --device cuda"),
    (["--decode-graphs", "1,8"], "--decode-graphs needs --device cuda"),
    (["--decode-graphs", "0,8"], "batch sizes must be positive"),
])
def test_up_bad_options_fail_before_starting_anything(tiny_official_ckpt, tmp_path, extra, message):
    cfg = tmp_path / "autoscale.json"
    cfg.write_text('{"bogus": 1}')
    out = v4serve("up", "--model", str(tiny_official_ckpt), *[e.replace("{cfg}", str(cfg)) for e in extra],
                  check=False)
    assert out.returncode == 2 and message in out.stderr
