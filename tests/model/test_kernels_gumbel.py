"""The Gumbel-max draw's kernel against the torch reference: the same token for every row, bit-exact
noise included (interpreter on CPU, compiled on a GPU)."""

import math

import pytest
import torch

from model.kernels.common import gumbel
from model.sampling import SamplingParams, _draw, _row_key, draw_rows, sample_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(rows: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    scaled = torch.randn(rows, vocab, generator=g) * 3
    scaled[1:3, 100:140] = float(scaled.max()) + 1  # ties on top, cut inside them
    keys = torch.randint(0, 1 << 32, (rows, 3), generator=g)
    ranked, order = scaled.sort(dim=-1, descending=True, stable=True)
    last = torch.randint(0, 60, (rows,), generator=g)
    last[1] = 17  # the 18th of the 40 tied tokens: ids 100..117 kept
    last[2] = 0  # only the best: the lowest id among the ties, whatever the noise
    thr_value, thr_id = ranked.gather(1, last[:, None])[:, 0], order.gather(1, last[:, None])[:, 0]
    thr_value[0], thr_id[0] = float("-inf"), vocab  # row 0 keeps everything
    return [t.to(DEVICE) for t in (scaled, keys, thr_value, thr_id)]


@pytest.mark.parametrize("rows,vocab", [(6, 9000), (3, 4096), (3, 70)])
def test_gumbel_argmax_matches_reference(rows, vocab):
    scaled, keys, thr_value, thr_id = _case(rows, vocab, seed=rows * vocab)
    ref = gumbel.gumbel_argmax(scaled, keys, thr_value, thr_id, "torch")
    got = gumbel.gumbel_argmax(scaled, keys, thr_value, thr_id, "triton")
    assert got.tolist() == ref.tolist()
    assert gumbel.kept(scaled, thr_value, thr_id)[torch.arange(rows), got].all()
    if vocab > 100:
        assert 100 <= int(got[1]) <= 117 and int(got[2]) == 100
    else:
        assert int(got[2]) == int(scaled[2].argmax())
    # the noise decides: other keys draw other tokens from the same full-support row
    others = [int(gumbel.gumbel_argmax(scaled[:1], keys[:1] + i, thr_value[:1], thr_id[:1], "triton"))
              for i in range(1, 9)]
    assert len(set(others)) > 1


def test_sample_rows_is_the_same_with_either_draw():
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(8, 5000, generator=g) * 2).to(DEVICE)
    params = [SamplingParams(temperature=0.5 + 0.2 * i, top_k=(0, 30)[i % 2], top_p=(1.0, 0.9, 1.0, 0.5)[i % 4],
                             seed=i) for i in range(8)]
    positions = list(range(100, 108))
    assert sample_rows(logits, params, positions, "triton") == sample_rows(logits, params, positions, "torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_draw_matches_its_reference_and_the_filtered_draw(dtype):
    """`gumbel.draw` (temperature, min_p and greedy rows in one launch) against its torch reference
    and against `_draw` / argmax, the path of rows with top-k or top-p: the same token on every row,
    with ties on top, min_p cutting inside the row and keys read through a strided view."""
    g = torch.Generator().manual_seed(11)
    rows, vocab = 6, 9000
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    logits[0:2, 200:240] = logits.float().max() + 1  # a greedy row's tie: its first id wins
    params = [SamplingParams(), SamplingParams(temperature=0.7, seed=3),
              SamplingParams(temperature=1.3, min_p=0.2, seed=4), SamplingParams(min_p=0.5),
              SamplingParams(temperature=0.9, min_p=0.9, seed=6), SamplingParams(temperature=2.0, seed=7)]
    positions = [10, 11, 12, 13, 14, 15]
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params])
    log_min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else float("-inf") for p in params])
    greedy = torch.tensor([p.greedy for p in params])
    wide = torch.randint(0, 1 << 32, (rows, 4, 3), generator=g)
    wide[:, 2] = torch.tensor([_row_key(p.seed, pos) for p, pos in zip(params, positions)])
    keys = wide[:, 2]  # rows 12 words apart, as `DrawInputs` reads one step's keys
    args = [t.to(DEVICE) for t in (logits, temperature, log_min_p, greedy, keys)]
    ref = gumbel.draw(*args, "torch")
    got = gumbel.draw(*args, "triton")
    assert got.tolist() == ref.tolist()
    assert int(got[0]) == 200 and int(got[3]) == int(logits[3].float().argmax())
    # the filtered path (`_draw` for drawn rows, argmax for greedy ones) draws the same tokens
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    filtered = logits.float().argmax(-1)
    filtered[drawn] = _draw(logits[drawn].float(), [params[i] for i in drawn], [positions[i] for i in drawn],
                            "torch")
    assert got.tolist() == filtered.tolist()
    assert draw_rows(args[0], params, positions, "triton").tolist() == got.tolist()
    # min_p cuts: row 4 (min_p 0.9 at temperature 0.9) draws only near its best
    scaled = logits[4].float() / 0.9
    assert float(scaled[int(got[4])]) >= float(scaled.max()) + math.log(0.9) - 1e-6
    # a flat row, where min_p's floor decides among many tokens: the same draw under 24 keys
    flat = (torch.randn(1, vocab, generator=g) * 0.5).to(dtype).to(DEVICE)
    one = [t[2:3] for t in args[1:4]]
    for k in range(24):
        key = torch.tensor([_row_key(k, 7)], device=DEVICE)
        assert gumbel.draw(flat, *one, key, "triton").tolist() == gumbel.draw(flat, *one, key, "torch").tolist()
