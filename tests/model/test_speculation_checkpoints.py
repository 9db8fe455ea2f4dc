"""`v4serve generate --speculative-tokens N` on random-weight checkpoints in both formats: the
transformers format keeps the MTP block beside save_pretrained's tensors (`write_checkpoint(...,
hf_mtp=True)`) and loads to the same weights as the official one; N = 1..3 print the tokens of
N = 0, greedy and at temperature 0.8, and the final JSON line counts the drafts."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.cli import main
from model.checkpoint import CheckpointError, expected_shapes, load_checkpoint, write_checkpoint
from model.tiny import random_weights, tiny_config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cfg = tiny_config()
    weights = random_weights(expected_shapes(cfg, with_mtp=True), cfg, 5)
    root = tmp_path_factory.mktemp("spec_ckpt")
    return {"official": write_checkpoint(root / "official", cfg, weights, "official"),
            "hf": write_checkpoint(root / "hf", cfg, weights, "hf", hf_mtp=True),
            "hf-plain": write_checkpoint(root / "hf-plain", cfg, weights, "hf"), "weights": weights}


def test_the_transformers_format_carries_the_mtp_block_beside_its_tensors(checkpoints):
    _, hf = load_checkpoint(checkpoints["hf"], with_mtp=True)
    loaded = {f"mtp.0.{k}": v for k, v in hf.mtp[0].state_dict().items()}
    mtp = {k: v for k, v in checkpoints["weights"].items() if k.startswith("mtp.")}
    assert mtp and all(torch.equal(loaded[k], v) for k, v in mtp.items())  # float32: exact
    load_checkpoint(checkpoints["hf"])  # without MTP its tensors are skipped
    with pytest.raises(CheckpointError, match="no MTP block"):
        load_checkpoint(checkpoints["hf-plain"], with_mtp=True)


def generate(capsys, ckpt, n: int, *extra: str) -> dict:
    args = ["generate", "--model", str(ckpt), "--prompt-ids", ",".join(str(7 * i % 251) for i in range(40)),
            "--max-new-tokens", "10", "--speculative-tokens", str(n), *extra]
    assert main(args) in (0, None)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


CASES = [("hf", "0.8", 1)]  # the rest: exhaustive (greedy at depth 3 is in test_speculation.py)
MORE = [(f, t, n) for f in ("official", "hf") for t in ("0.0", "0.8") for n in (1, 2, 3) if (f, t, n) not in CASES]


def check(capsys, checkpoints, fmt: str, temperature: str, n: int) -> None:
    sampling = ["--temperature", temperature, "--seed", "9"]
    plain = generate(capsys, checkpoints[fmt], 0, *sampling)
    got = generate(capsys, checkpoints[fmt], n, *sampling)
    assert "spec" not in plain
    assert got["token_ids"] == plain["token_ids"] and got["finish_reason"] == plain["finish_reason"]
    assert got["spec"]["proposed"] >= 9 // (n + 1) and 0 <= got["spec"]["accepted"] <= got["spec"]["proposed"]


@pytest.mark.parametrize("fmt,temperature,n", CASES)
def test_generate_with_speculation_prints_the_tokens_of_plain_generate(capsys, checkpoints, fmt, temperature, n):
    check(capsys, checkpoints, fmt, temperature, n)


@pytest.mark.exhaustive
@pytest.mark.parametrize("fmt,temperature,n", MORE)
def test_generate_with_speculation_at_every_depth_and_format(capsys, checkpoints, fmt, temperature, n):
    check(capsys, checkpoints, fmt, temperature, n)


def test_generate_refuses_speculation_without_mtp_weights(capsys, checkpoints):
    assert main(["generate", "--model", str(checkpoints["hf-plain"]), "--prompt-ids", "1,2", "--max-new-tokens", "2",
                 "--speculative-tokens", "1"]) == 2
    assert "no MTP block" in capsys.readouterr().err
